"""Prefill → decode KV transfer between two real worker processes, over real NIXL (UCX over host memory).

The frontend's part is played by hand here: a hold request on the prefill engine, its KvTransferParams
(plus the source address) as the decode engine's prefill_result. What must hold: the decode side gets
exactly the tokens an aggregated engine would produce, pulls only what it lacks, verifies every block
(an injected corruption is DATA_LOSS, never tokens), and afterwards no block is held anywhere.
"""

from __future__ import annotations

import asyncio
import glob
import time

import grpc
import pytest
from kvmesh.v1 import discovery_pb2, worker_pb2, worker_pb2_grpc

from tests.disagg.support import BLOCK, cards_sync, load, wait_no_active_blocks, worker
from tests.support.daemons import running
from tests.support.generate import RequestFailed, StreamClient, generate_sync, tokens_of

pytestmark = pytest.mark.e2e

PROMPT = list(range(100, 100 + 10 * BLOCK + 2))  # 10 full blocks and a partial one


def _pair(tmp_path, prefill_env=None):
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0", env=prefill_env)
    decode = worker(tmp_path, discovery, "xfer", "decode", "--speedup-ratio", "0", "--kv-transfer-gbps", "1")
    return discovery, prefill, decode


def _engines(discovery):
    found = cards_sync(discovery, "xfer", 2)
    by_role = {card.role: card for card in found}
    return by_role[discovery_pb2.WORKER_ROLE_PREFILL], by_role[discovery_pb2.WORKER_ROLE_DECODE]


def _sampling(max_tokens):
    return worker_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True)


def _prefill(stub, engine_id, prompt, rid, address):
    responses = generate_sync(
        stub,
        worker_pb2.GenerateRequest(
            request_id=rid, engine_id=engine_id, token_ids=prompt, sampling=_sampling(1), hold_kv_for_transfer=True
        ),
    )
    params = responses[-1].kv_transfer
    assert params.transfer_id and params.backend == "nixl"
    params.source_address = address
    return params


def _run_pair(discovery, prefill, decode, scenario) -> None:
    """Run ``scenario(prefill_stub, decode_stub, prefill_card, decode_card)`` (async: the decode side's
    stream clients) on the started pair; afterwards neither engine holds a block."""
    with running(prefill, decode):
        prefill.wait_serving(30)
        decode.wait_serving(30)
        pcard, dcard = _engines(discovery)
        with grpc.insecure_channel(prefill.address) as pch:
            pstub = worker_pb2_grpc.WorkerServiceStub(pch)

            async def run() -> None:
                async with grpc.aio.insecure_channel(decode.address) as dch:
                    await scenario(pstub, worker_pb2_grpc.WorkerServiceStub(dch), pcard, dcard)

            asyncio.run(run())
        assert wait_no_active_blocks(decode.address, dcard.engine_id, timeout=5.0).active_blocks == 0
        assert wait_no_active_blocks(prefill.address, pcard.engine_id, timeout=5.0).active_blocks == 0


def _failed_decode(dstub, engine_id, params) -> RequestFailed:
    """The decode leg of PROMPT with ``params`` as its prefill_result, which must fail: how it failed."""
    with pytest.raises(RequestFailed) as failed:
        generate_sync(
            dstub,
            worker_pb2.GenerateRequest(
                request_id="d1", engine_id=engine_id, token_ids=PROMPT, sampling=_sampling(8), prefill_result=params
            ),
        )
    return failed.value


def test_decode_pulls_only_missing_blocks_verifies_them_and_nothing_stays_held(tmp_path):
    discovery, prefill, decode = _pair(tmp_path)
    with running(prefill, decode):
        prefill.wait_serving(30)
        decode.wait_serving(30)
        pcard, dcard = _engines(discovery)
        assert pcard.capabilities.kv_transfer and pcard.capabilities.kv_transfer_metadata
        with grpc.insecure_channel(prefill.address) as pch, grpc.insecure_channel(decode.address) as dch:
            pstub, dstub = worker_pb2_grpc.WorkerServiceStub(pch), worker_pb2_grpc.WorkerServiceStub(dch)
            # The reference: the same request run whole (aggregated) on the prefill engine.
            reference = tokens_of(
                generate_sync(
                    pstub,
                    worker_pb2.GenerateRequest(
                        request_id="ref", engine_id=pcard.engine_id, token_ids=PROMPT, sampling=_sampling(24)
                    ),
                )
            )
            params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
            assert list(params.block_hashes) and len(params.block_ids) == 10
            assert params.bytes_per_block == 4096
            responses = generate_sync(
                dstub,
                worker_pb2.GenerateRequest(
                    request_id="d1",
                    engine_id=dcard.engine_id,
                    token_ids=PROMPT,
                    sampling=_sampling(24),
                    prefill_result=params,
                ),
            )
            report = responses[0].kv_report
            assert (report.offered_blocks, report.local_hit_blocks, report.transferred_blocks) == (10, 0, 10)
            assert report.transferred_bytes == report.pull_everything_bytes == 10 * 4096
            # Modelled at the model-true size (kvmesh-mock: 128 KiB per token) over the 1 GB/s link.
            assert params.model_bytes_per_block == 128 * 1024 * BLOCK
            assert report.modelled_ms == pytest.approx(10 * params.model_bytes_per_block / 1e9 * 1e3)
            assert tokens_of(responses) == reference  # same prompt and seed: the same tokens on any engine
            # Released by the decode worker after its pull (asynchronously: poll the prefill engine's
            # held blocks rather than race it); then a second release finds nothing.
            assert wait_no_active_blocks(prefill.address, pcard.engine_id, timeout=10).active_blocks == 0
            assert not pstub.ReleaseKv(
                worker_pb2.ReleaseKvRequest(engine_id=pcard.engine_id, transfer_id=params.transfer_id)
            ).released
            # A prompt sharing the first 10 blocks, 4 blocks longer: only the 4 new blocks move.
            longer = PROMPT[: 10 * BLOCK] + list(range(900, 900 + 4 * BLOCK + 1))
            params2 = _prefill(pstub, pcard.engine_id, longer, "p2", prefill.address)
            responses2 = generate_sync(
                dstub,
                worker_pb2.GenerateRequest(
                    request_id="d2", engine_id=dcard.engine_id, token_ids=longer, sampling=_sampling(5),
                    prefill_result=params2,
                ),
            )  # fmt: skip
            report2 = responses2[0].kv_report
            assert (report2.offered_blocks, report2.local_hit_blocks, report2.transferred_blocks) == (14, 10, 4)
            assert report2.transferred_bytes == 4 * 4096 < report2.pull_everything_bytes
        assert wait_no_active_blocks(prefill.address, pcard.engine_id).active_blocks == 0
        assert wait_no_active_blocks(decode.address, dcard.engine_id).active_blocks == 0


def test_a_corrupted_block_fails_the_request_with_data_loss(tmp_path):
    discovery, prefill, decode = _pair(tmp_path, prefill_env={"KVMESH_TEST_CORRUPT_KV": "1"})
    with running(prefill, decode):
        prefill.wait_serving(30)
        decode.wait_serving(30)
        pcard, dcard = _engines(discovery)
        with grpc.insecure_channel(prefill.address) as pch, grpc.insecure_channel(decode.address) as dch:
            pstub, dstub = worker_pb2_grpc.WorkerServiceStub(pch), worker_pb2_grpc.WorkerServiceStub(dch)
            params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
            failed = _failed_decode(dstub, dcard.engine_id, params)
            assert failed.code == grpc.StatusCode.DATA_LOSS
            assert "failed verification" in failed.message
        assert wait_no_active_blocks(prefill.address, pcard.engine_id).active_blocks == 0
        assert wait_no_active_blocks(decode.address, dcard.engine_id).active_blocks == 0


@pytest.mark.parametrize("offset", ["+60s", "-60s"])
def test_a_hold_is_timed_on_the_decode_hosts_own_clock_not_by_comparing_wall_clocks(tmp_path, offset):
    """The decode worker's wall clock is a minute off (libfaketime; its monotonic clock is true). Its pull of
    a fresh hold (30 s) must go through: compared with the source's wall clock, a decode host ahead took
    every hold for expired and prefilled every prompt again. And a hold past its timeout (1 s here) is
    still refused on a host whose clock is behind: counted on its own clock from receipt."""
    libs = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    assert libs, "libfaketime is missing (Debian: apt-get install faketime; make setup-dev)"
    skewed = {"LD_PRELOAD": libs[0], "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0")
    short = worker(tmp_path, discovery, "short", "prefill", "--speedup-ratio", "0", "--kv-hold-timeout", "1")
    decode = worker(tmp_path, discovery, "xfer", "decode", "--speedup-ratio", "0", env=skewed)
    with running(prefill, short, decode):
        for daemon in (prefill, short, decode):
            daemon.wait_serving(30)
        (scard,) = cards_sync(discovery, "short", 1)
        pcard, dcard = _engines(discovery)
        with (
            grpc.insecure_channel(prefill.address) as pch,
            grpc.insecure_channel(short.address) as sch,
            grpc.insecure_channel(decode.address) as dch,
        ):
            pstub, sstub = worker_pb2_grpc.WorkerServiceStub(pch), worker_pb2_grpc.WorkerServiceStub(sch)
            dstub = worker_pb2_grpc.WorkerServiceStub(dch)
            params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
            request = worker_pb2.GenerateRequest(
                request_id="d1", engine_id=dcard.engine_id, token_ids=PROMPT, sampling=_sampling(4)
            )
            request.prefill_result.CopyFrom(params)
            report = generate_sync(dstub, request)[0].kv_report
            assert (report.transferred_blocks, report.recomputed_because) == (10, "")
            stale = _prefill(sstub, scard.engine_id, PROMPT, "p2", short.address)
            time.sleep(1.1)  # its hold timed out on the source; a relay that kept the params says so:
            stale.hold_remaining_ms -= 1100
            failed = _failed_decode(dstub, dcard.engine_id, stale)
            assert failed.code == grpc.StatusCode.ABORTED and "expired" in failed.message
        assert wait_no_active_blocks(prefill.address, pcard.engine_id, timeout=10).active_blocks == 0


def test_only_a_prefill_engine_holds_kv_or_answers_a_release(tmp_path):
    """A decode engine asked to hold a prompt's KV pinned its blocks for the hold's whole lease (30 s), and
    answered ReleaseKv as if it held transfers: both are a prefill engine's alone."""
    discovery, prefill, decode = _pair(tmp_path)
    with running(prefill, decode):
        prefill.wait_serving(30)
        decode.wait_serving(30)
        _, dcard = _engines(discovery)
        with grpc.insecure_channel(decode.address) as dch:
            dstub = worker_pb2_grpc.WorkerServiceStub(dch)
            with pytest.raises(RequestFailed) as refused:
                _prefill(dstub, dcard.engine_id, PROMPT, "h1", decode.address)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.message.endswith("is decode: only --role prefill holds KV for a transfer")
            assert load(decode.address, dcard.engine_id).active_blocks == 0
            with pytest.raises(grpc.RpcError) as release:
                dstub.ReleaseKv(worker_pb2.ReleaseKvRequest(engine_id=dcard.engine_id, transfer_id="h1-0"), timeout=5)
            assert release.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "only --role prefill holds KV for transfers" in release.value.details()


def test_an_unreleased_hold_expires_with_its_lease(tmp_path):
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0", "--kv-hold-timeout", "1")
    with running(prefill):
        prefill.wait_serving(30)
        (pcard,) = cards_sync(discovery, "xfer", 1)
        with grpc.insecure_channel(prefill.address) as pch:
            pstub = worker_pb2_grpc.WorkerServiceStub(pch)
            params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
            assert load(prefill.address, pcard.engine_id).active_blocks == 10  # held: pinned, counted as load
            assert wait_no_active_blocks(prefill.address, pcard.engine_id, timeout=3.0).active_blocks == 0
            assert not pstub.ReleaseKv(
                worker_pb2.ReleaseKvRequest(engine_id=pcard.engine_id, transfer_id=params.transfer_id)
            ).released


def test_a_decode_leg_refused_before_its_pull_releases_the_prefill_engines_hold(tmp_path):
    """Refused on arrival (an engine the worker does not host, a draining worker, an id sent twice), the
    decode leg never pulls: the worker releases its source's hold at once, not at the hold's lease (30 s),
    which kept those blocks from every other request of the prefill engine meanwhile."""
    discovery, prefill, decode = _pair(tmp_path)
    with running(prefill, decode):
        prefill.wait_serving(30)
        decode.wait_serving(30)
        pcard, dcard = _engines(discovery)
        with grpc.insecure_channel(prefill.address) as pch, grpc.insecure_channel(decode.address) as dch:
            pstub, dstub = worker_pb2_grpc.WorkerServiceStub(pch), worker_pb2_grpc.WorkerServiceStub(dch)
            params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
            assert load(prefill.address, pcard.engine_id).active_blocks == 10
            refused = _failed_decode(dstub, dcard.engine_id + 1, params)
            assert refused.code == grpc.StatusCode.NOT_FOUND
        assert wait_no_active_blocks(prefill.address, pcard.engine_id, timeout=5.0).active_blocks == 0


def test_a_pull_from_an_engine_of_another_block_size_is_refused_naming_both(tmp_path):
    """Engines of one model started with different --block-size hash different blocks: the decode side says
    so (FAILED_PRECONDITION, a mesh misconfiguration), rather than that the blocks do not match the prompt."""
    discovery, prefill, decode = _pair(tmp_path)
    with running(prefill, decode):
        prefill.wait_serving(30)
        decode.wait_serving(30)
        pcard, dcard = _engines(discovery)
        with grpc.insecure_channel(prefill.address) as pch, grpc.insecure_channel(decode.address) as dch:
            pstub, dstub = worker_pb2_grpc.WorkerServiceStub(pch), worker_pb2_grpc.WorkerServiceStub(dch)
            params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
            params.block_size = 2 * BLOCK  # as a prefill engine started with --block-size 8 describes its hold
            refused = _failed_decode(dstub, dcard.engine_id, params)
            assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"has {2 * BLOCK} tokens per block, this engine {BLOCK} (--block-size must match" in (
                refused.message
            )
        assert wait_no_active_blocks(prefill.address, pcard.engine_id, timeout=5.0).active_blocks == 0


def test_a_cancelled_pull_lets_the_request_queued_behind_its_blocks_run(tmp_path):
    """A pull pins the blocks it lands; cancelled mid-transfer it gave them back without waking the engine,
    so a request waiting for those blocks stayed queued until some other request happened along."""
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0")
    # 16 blocks: the pull's 10 leave too few for the local request; a slow modelled link keeps them pinned.
    decode = worker(tmp_path, discovery, "xfer", "decode", "--num-gpu-blocks", "16", "--kv-transfer-gbps", "0.00001")

    async def scenario(pstub, dstub, pcard, dcard) -> None:
        params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
        client = StreamClient(dstub)
        try:
            pull = worker_pb2.GenerateRequest(
                request_id="pull", engine_id=dcard.engine_id, token_ids=PROMPT, sampling=_sampling(4),
                prefill_result=params,
            )  # fmt: skip
            await client.send([pull])
            async with asyncio.timeout(10):
                while (await asyncio.to_thread(load, decode.address, dcard.engine_id)).active_blocks < 10:
                    await asyncio.sleep(0.05)
            local = worker_pb2.GenerateRequest(
                request_id="local", engine_id=dcard.engine_id, token_ids=list(range(2000, 2000 + 8 * BLOCK)),
                sampling=_sampling(2),
            )  # fmt: skip
            await client.send([local])
            await asyncio.sleep(0.5)
            assert client.final("local") is None, "the local request should wait for the pulled blocks"
            await client.send(cancel=["pull"])
            (final,) = await client.wait_final("local", timeout=5)
            assert not final.error_code and len(client.tokens("local")) == 2
        finally:
            await client.close()

    _run_pair(discovery, prefill, decode, scenario)


def test_a_pulled_request_refused_as_a_duplicate_gives_its_pulled_blocks_back(tmp_path):
    """An id already running on another stream is refused after its pull: the blocks it pinned stayed
    pinned for good (and a later pull of that id failed with "already pulled KV")."""
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0")
    decode = worker(tmp_path, discovery, "xfer", "decode", "--speedup-ratio", "1")  # real time: x stays running

    async def scenario(pstub, dstub, pcard, dcard) -> None:
        params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
        first, second = StreamClient(dstub), StreamClient(dstub)
        try:
            running_x = worker_pb2.GenerateRequest(
                request_id="x", engine_id=dcard.engine_id, token_ids=[7, 8, 9], sampling=_sampling(100)
            )
            await first.send([running_x])
            await first.wait_first("x")
            pulled_x = worker_pb2.GenerateRequest(
                request_id="x", engine_id=dcard.engine_id, token_ids=PROMPT, sampling=_sampling(4),
                prefill_result=params,
            )  # fmt: skip
            await second.send([pulled_x])
            (refused,) = await second.wait_final("x")
            assert refused.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            await first.wait_final("x", timeout=30)  # the running x ends too: nothing is left to hold a block
        finally:
            await first.close()
            await second.close()

    _run_pair(discovery, prefill, decode, scenario)


def test_a_request_resent_while_its_pull_runs_gets_only_its_own_tokens(tmp_path):
    """A frontend's retry: cancel and resend one id while its pull runs, twice. The first resend's pull,
    cancelled in turn, took the second's place in the books and its outputs reached the live request (5
    tokens for a request of 7), which the worker contract rules out."""
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0")
    decode = worker(
        tmp_path, discovery, "xfer", "decode", "--speedup-ratio", "0", env={"KVMESH_TEST_PULL_DELAY_S": "1"}
    )

    async def scenario(pstub, dstub, pcard, dcard) -> None:
        holds = [_prefill(pstub, pcard.engine_id, PROMPT, f"p{i}", prefill.address) for i in range(3)]

        def leg(i: int, max_tokens: int) -> worker_pb2.GenerateRequest:
            return worker_pb2.GenerateRequest(
                request_id="x", engine_id=dcard.engine_id, token_ids=PROMPT, sampling=_sampling(max_tokens),
                prefill_result=holds[i],
            )  # fmt: skip

        client = StreamClient(dstub)
        try:
            await client.send([leg(0, 3)])
            await asyncio.sleep(0.3)
            await client.send([leg(1, 5)], cancel=["x"])
            await asyncio.sleep(0.3)
            await client.send([leg(2, 7)], cancel=["x"])
            (final,) = await client.wait_final("x", timeout=20)
            assert not final.error_code
            await asyncio.sleep(1.5)  # the cancelled pulls end meanwhile: nothing of theirs may arrive
            assert len(client.tokens("x")) == 7
        finally:
            await client.close()

    _run_pair(discovery, prefill, decode, scenario)


def test_a_hold_that_expires_is_reported_free_to_load_watchers(tmp_path):
    """An idle engine runs no pass, and the load watch learned of changes from passes: a router kept
    seeing the expired hold's blocks as in use for as long as nothing else ran there."""
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0", "--kv-hold-timeout", "1")

    async def scenario(stub, sync_stub, pcard) -> None:
        watch = stub.WatchLoad(worker_pb2.WatchLoadRequest(engine_ids=[pcard.engine_id]))
        seen = [(await watch.read()).loads[0].active_blocks]
        await asyncio.to_thread(_prefill, sync_stub, pcard.engine_id, PROMPT, "p1", prefill.address)
        async with asyncio.timeout(5):  # the hold lasts 1 s
            while seen[-1:] != [0] or 10 not in seen:
                for engine_load in (await watch.read()).loads:
                    seen.append(engine_load.active_blocks)
        watch.cancel()

    with running(prefill):
        prefill.wait_serving(30)
        (pcard,) = cards_sync(discovery, "xfer", 1)
        with grpc.insecure_channel(prefill.address) as pch:
            sync_stub = worker_pb2_grpc.WorkerServiceStub(pch)

            async def run() -> None:
                async with grpc.aio.insecure_channel(prefill.address) as ch:
                    await scenario(worker_pb2_grpc.WorkerServiceStub(ch), sync_stub, pcard)

            asyncio.run(run())


def test_a_decode_engine_without_room_for_the_pulled_blocks_computes_the_prompt_itself(tmp_path):
    """An aggregated engine queues a request that does not fit now; a decode engine without room to pin
    the pulled blocks failed it RESOURCE_EXHAUSTED after the transfer. It queues it the same way now, to
    compute the prompt itself once room frees, and its report says so (the frontend's ``kvmesh.disagg``)."""
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0")
    decode = worker(tmp_path, discovery, "xfer", "decode", "--num-gpu-blocks", "16", "--speedup-ratio", "0.5")

    async def scenario(pstub, dstub, pcard, dcard) -> None:
        params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
        client = StreamClient(dstub)
        try:
            busy = worker_pb2.GenerateRequest(
                request_id="busy", engine_id=dcard.engine_id, token_ids=list(range(2000, 2000 + 8 * BLOCK)),
                sampling=_sampling(5 * BLOCK),
            )  # fmt: skip
            await client.send([busy])
            await client.wait_first("busy")  # 9 of the 16 blocks in use: no room to pin the pull's 10
            pull = worker_pb2.GenerateRequest(
                request_id="pull", engine_id=dcard.engine_id, token_ids=PROMPT, sampling=_sampling(4),
                prefill_result=params,
            )  # fmt: skip
            await client.send([pull])
            await client.wait_final("busy", "pull", timeout=60)
            outputs = client.outputs["pull"]
            assert not outputs[-1].error_code, outputs[-1].error_message
            assert len(client.tokens("pull")) == 4
            report = outputs[0].response.kv_report
            assert report.recomputed_because == "the decode engine had no room for the pulled KV"
            assert report.transferred_blocks == 0 and report.offered_blocks == 10
        finally:
            await client.close()

    _run_pair(discovery, prefill, decode, scenario)


def test_a_pull_of_a_hold_that_has_expired_is_aborted_at_once_for_a_local_prefill(tmp_path):
    """A hold past its lease may have its blocks reused for another prompt: a pull then read someone else's
    KV (DATA_LOSS, a failed request) or waited out the read timeout (10 s) for a source that no longer
    served it. ABORTED at once is the frontend's cue to prefill locally on the same engine."""
    discovery = f"file://{tmp_path / 'disc'}"
    prefill = worker(tmp_path, discovery, "xfer", "prefill", "--speedup-ratio", "0", "--kv-hold-timeout", "1")
    decode = worker(tmp_path, discovery, "xfer", "decode", "--speedup-ratio", "0")

    async def scenario(pstub, dstub, pcard, dcard) -> None:
        params = _prefill(pstub, pcard.engine_id, PROMPT, "p1", prefill.address)
        await asyncio.sleep(1.1)  # the hold expired; a relay that kept the params says so:
        params.hold_remaining_ms -= 1100
        failed = await asyncio.to_thread(_failed_decode, dstub_sync, dcard.engine_id, params)
        assert failed.code == grpc.StatusCode.ABORTED
        assert "expired" in failed.message

    with grpc.insecure_channel(decode.address) as dch:
        dstub_sync = worker_pb2_grpc.WorkerServiceStub(dch)
        _run_pair(discovery, prefill, decode, scenario)
