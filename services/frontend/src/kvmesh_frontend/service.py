"""``inference.GRPCInferenceService``: the KServe v2 / Triton-compatible front door.

- Health: ServerLive (always), ServerReady (at least one model has a live engine and its
  tokenizer settled), ModelReady (that model does).
- Metadata: ServerMetadata, ModelMetadata and ModelConfig describe the LLM tensor contract; the
  config is *decoupled* (one request, many responses) with every input optional, which is what
  tritonclient, perf_analyzer and genai-perf need to stream.
- Inference: ModelInfer (one response; errors are gRPC statuses) and ModelStreamInfer (many
  requests in flight on one stream, demultiplexed by request ``id``; per-request errors come back
  in-band as ``error_message`` = ``STATUS_NAME: message`` and do not end the stream).
- ModelStatistics answers with per-model success/failure counts. Every other Triton RPC answers
  UNIMPLEMENTED, saying why.

Cancellation: when the client cancels or disconnects, the handler is cancelled and so is every
request in flight on it; each request's cleanup cancels its engine stream and frees its booking.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import grpc
from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from inference import model_config_pb2 as mc
from kvmesh import grpc_services

from kvmesh_frontend.errors import FrontendError, invalid, unavailable
from kvmesh_frontend.models import MODEL_VERSION, is_served_version
from kvmesh_frontend.pipeline import Frontend

log = logging.getLogger(__name__)

SERVER_NAME = "kvmesh"
PLATFORM = "kvmesh"
EXTENSIONS = ("model_configuration", "parameters", "statistics")

# (name, datatype, dims) in ModelMetadata order; every input is optional in ModelConfig.
INPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("text_input", "BYTES", (1,)),
    ("input_ids", "INT32", (-1,)),
    ("messages", "BYTES", (1,)),
    ("stream", "BOOL", (1,)),
    ("streaming", "BOOL", (1,)),
    ("sampling_parameters", "BYTES", (1,)),
    ("exclude_input_in_output", "BOOL", (1,)),
    ("return_finish_reason", "BOOL", (1,)),
    ("return_num_input_tokens", "BOOL", (1,)),
    ("return_num_output_tokens", "BOOL", (1,)),
    ("return_logprobs", "BOOL", (1,)),
    ("return_cumulative_logprob", "BOOL", (1,)),
    ("return_output_ids", "BOOL", (1,)),
    ("max_tokens", "INT32", (1,)),
    ("min_length", "INT32", (1,)),
)
OUTPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("text_output", "BYTES", (-1,)),
    ("finish_reason", "BYTES", (-1,)),
    ("num_input_tokens", "UINT32", (1,)),
    ("num_output_tokens", "UINT32", (-1,)),
    ("cumulative_logprob", "FP32", (-1,)),
    ("logprobs", "BYTES", (-1,)),
    ("output_ids", "INT32", (-1,)),
)
_CONFIG_TYPES = {
    "BYTES": mc.TYPE_STRING,
    "BOOL": mc.TYPE_BOOL,
    "INT32": mc.TYPE_INT32,
    "UINT32": mc.TYPE_UINT32,
    "FP32": mc.TYPE_FP32,
}


def model_metadata(name: str) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(
        name=name,
        versions=[MODEL_VERSION],
        platform=PLATFORM,
        inputs=[pb.ModelMetadataResponse.TensorMetadata(name=n, datatype=d, shape=s) for n, d, s in INPUTS],
        outputs=[pb.ModelMetadataResponse.TensorMetadata(name=n, datatype=d, shape=s) for n, d, s in OUTPUTS],
    )


def model_config(name: str, parameters: dict[str, str] | None = None) -> mc.ModelConfig:
    config = mc.ModelConfig(
        name=name,
        platform=PLATFORM,
        backend=PLATFORM,
        max_batch_size=0,
        input=[mc.ModelInput(name=n, data_type=_CONFIG_TYPES[d], dims=s, optional=True) for n, d, s in INPUTS],
        output=[mc.ModelOutput(name=n, data_type=_CONFIG_TYPES[d], dims=s) for n, d, s in OUTPUTS],
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
    )
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = value
    return config


SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
#: ModelStreamInfer refuses a message that does not parse in band (an error response without an id) and
#: serves the stream's other requests; every other method's call ends INVALID_ARGUMENT (kvmesh.grpc_services).
IN_BAND = ("ModelStreamInfer",)
MALFORMED = grpc_services.malformed_details(pb.ModelInferRequest)
DRAINING = "kvmesh-frontend is shutting down; send new requests to another instance"


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, frontend: Frontend, version: str, has_router: Callable[[], bool] = lambda: True) -> None:
        """``has_router``: whether a router replica is reachable; without one nothing is ready (every
        request would fail UNAVAILABLE)."""
        self._frontend = frontend
        self._registry = frontend.registry
        self._version = version
        self._has_router = has_router
        self._draining = asyncio.Event()

    def drain(self) -> None:
        """The frontend drains: each ModelStreamInfer stream ends once its requests in flight have (an idle
        one at once), refusing new ones meanwhile. Else an idle stream a client keeps open held the drain
        for its whole timeout."""
        self._draining.set()

    # -- health and metadata --------------------------------------------------------------------
    async def ServerLive(
        self,
        request: pb.ServerLiveRequest,
        context: grpc.aio.ServicerContext[pb.ServerLiveRequest, pb.ServerLiveResponse],
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self,
        request: pb.ServerReadyRequest,
        context: grpc.aio.ServicerContext[pb.ServerReadyRequest, pb.ServerReadyResponse],
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.server_ready())

    def server_ready(self) -> bool:
        """ServerReady's answer, which grpc.health.v1 follows too (``kvmesh_frontend.main``)."""
        return self._registry.any_ready() and self._has_router()

    async def ModelReady(
        self,
        request: pb.ModelReadyRequest,
        context: grpc.aio.ServicerContext[pb.ModelReadyRequest, pb.ModelReadyResponse],
    ) -> pb.ModelReadyResponse:
        try:
            served = is_served_version(request.version)
        except FrontendError as error:
            _refuse(context, error)
            return pb.ModelReadyResponse()
        entry = self._registry.get(request.name)
        return pb.ModelReadyResponse(ready=entry is not None and entry.ready and served and self._has_router())

    async def ServerMetadata(
        self,
        request: pb.ServerMetadataRequest,
        context: grpc.aio.ServicerContext[pb.ServerMetadataRequest, pb.ServerMetadataResponse],
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self._version, extensions=EXTENSIONS)

    def _known(self, name: str, context: grpc.aio.ServicerContext[Any, Any], version: str = "") -> Any:
        """The model's entry, or None with the call's status set (the caller returns at once).

        The same answer as inference gets (``ModelRegistry.resolve``): NOT_FOUND for a name never served,
        UNAVAILABLE while a served model has no live engine (a worker restarting), so a client that reads
        the metadata before inferring (perf_analyzer, genai-perf) is told to retry, not that it is wrong.
        """
        try:
            return self._registry.resolve(name, version)
        except FrontendError as error:
            _refuse(context, error)
            return None

    async def ModelMetadata(
        self,
        request: pb.ModelMetadataRequest,
        context: grpc.aio.ServicerContext[pb.ModelMetadataRequest, pb.ModelMetadataResponse],
    ) -> pb.ModelMetadataResponse:
        if self._known(request.name, context, request.version) is None:
            return pb.ModelMetadataResponse()
        return model_metadata(request.name)

    async def ModelConfig(
        self,
        request: pb.ModelConfigRequest,
        context: grpc.aio.ServicerContext[pb.ModelConfigRequest, pb.ModelConfigResponse],
    ) -> pb.ModelConfigResponse:
        entry = self._known(request.name, context, request.version)
        if entry is None:
            return pb.ModelConfigResponse()
        parameters = {
            "block_size": str(entry.block_size),
            "context_length": str(entry.context_length),
            "engines": str(len(entry.cards)),
        }
        return pb.ModelConfigResponse(config=model_config(request.name, parameters))

    async def ModelStatistics(
        self,
        request: pb.ModelStatisticsRequest,
        context: grpc.aio.ServicerContext[pb.ModelStatisticsRequest, pb.ModelStatisticsResponse],
    ) -> pb.ModelStatisticsResponse:
        if request.name:
            if self._known(request.name, context, request.version) is None:
                return pb.ModelStatisticsResponse()
            names = [request.name]
        else:
            names = self._registry.names()
        response = pb.ModelStatisticsResponse()
        for name in names:
            stats = self._frontend.stats.get(name)
            entry = response.model_stats.add(name=name, version=MODEL_VERSION)
            if stats is None:
                continue
            count = stats.success_count
            entry.last_inference = stats.last_inference_ms
            entry.inference_count = count
            entry.execution_count = count
            entry.inference_stats.success.count = count
            entry.inference_stats.success.ns = stats.success_ns
            entry.inference_stats.fail.count = stats.fail_count
            entry.inference_stats.fail.ns = stats.fail_ns
            phases = entry.inference_stats
            for duration, ns in (
                (phases.queue, stats.queue_ns),
                (phases.compute_input, stats.input_ns),
                (phases.compute_infer, stats.infer_ns),
                (phases.compute_output, 0),
            ):
                duration.count = count
                duration.ns = ns
        return response

    # -- inference ------------------------------------------------------------------------------
    async def ModelInfer(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelInferResponse],
    ) -> pb.ModelInferResponse:
        counted, refusal = self._frontend.admit(request, unary=True)
        if refusal is not None:
            _refuse(context, refusal)
            return pb.ModelInferResponse()
        try:
            result: pb.ModelInferResponse | None = None

            def deadline_passed() -> bool:  # the call's timeout, not the client, cancelled it
                left = context.time_remaining()
                return left is not None and left <= 0

            async with aclosing(
                self._frontend.infer(request, unary=True, deadline_passed=deadline_passed)
            ) as responses:
                async for response in responses:
                    assert isinstance(response, pb.ModelInferResponse)
                    result = response
            if result is None:  # pragma: no cover - infer always yields once or raises
                raise FrontendError(grpc.StatusCode.INTERNAL, "no response was produced")
            return result
        except FrontendError as exc:
            _refuse(context, exc)
            return pb.ModelInferResponse()
        finally:
            if counted:
                self._frontend.release(request.model_name)

    # grpc.aio also serves a stream-stream RPC from a coroutine that writes through context.write (one
    # writer per request task here); the generated servicer stub only models generator methods.
    async def ModelStreamInfer(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelStreamInferResponse],
    ) -> None:
        # Each request runs in its own task and writes its responses itself; a lock serializes the
        # writes (gRPC allows one at a time), which costs nothing when uncontended and applies the
        # client's flow control to every request's engine stream.
        tasks: set[asyncio.Task[None]] = set()
        frontend = self._frontend
        lock = asyncio.Lock()
        write = context.write
        loop = asyncio.get_running_loop()

        async def serve(request: pb.ModelInferRequest) -> None:
            try:
                async with aclosing(frontend.infer(request, unary=False)) as responses:
                    async for response in responses:
                        assert isinstance(response, pb.ModelStreamInferResponse)  # infer(unary=False) yields only these
                        async with lock:
                            await write(response)
            except FrontendError as exc:
                await refuse(request, exc)

        async def refuse(request: pb.ModelInferRequest, error: FrontendError) -> None:
            message = pb.ModelStreamInferResponse(
                error_message=error.in_band(), infer_response=_error_response(request)
            )
            async with lock:
                await write(message)

        def release(model_name: str, _task: asyncio.Task[None]) -> None:
            frontend.release(model_name)

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:  # the client is gone mid-write
                log.debug("stream request ended: %r", task.exception())

        draining = self._draining

        async def read() -> None:
            async for request in request_iterator:
                if draining.is_set():  # the stream ends when its requests in flight have
                    frontend.refused(request, error := unavailable(DRAINING), unary=False)
                    await refuse(request, error)
                    continue
                if grpc_services.is_malformed(request):  # in band: the stream's other requests go on
                    frontend.refused(pb.ModelInferRequest(), error := invalid(MALFORMED), unary=False)
                    await refuse(pb.ModelInferRequest(), error)
                    continue
                # Admission first, on the raw request: a model at its bound is refused right here, with
                # no task, no parsing, no router and no engine involved (kvmesh_frontend/admission.py).
                counted, refusal = frontend.admit(request, unary=False)
                if refusal is not None:
                    await refuse(request, refusal)
                    continue
                task = loop.create_task(serve(request))
                tasks.add(task)
                task.add_done_callback(done)
                if counted:  # a done callback, not a finally: a task cancelled before its first step runs no finally
                    task.add_done_callback(functools.partial(release, request.model_name))

        reader = loop.create_task(read())
        drained = loop.create_task(draining.wait())
        try:
            await asyncio.wait((reader, drained), return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # the stream broke (the client is gone): the finally cancels what is in flight
            while tasks:  # the client half-closed, or the frontend drains: finish what is in flight
                await asyncio.wait(list(tasks))
        finally:
            for task in (reader, drained, *tasks):
                task.cancel()
            await asyncio.gather(reader, drained, *tasks, return_exceptions=True)

    # -- the rest of Triton's service -------------------------------------------------------------
    async def _unimplemented(self, context: grpc.aio.ServicerContext[Any, Any], rpc: str, why: str) -> Any:
        _refuse(
            context, FrontendError(grpc.StatusCode.UNIMPLEMENTED, f"kvmesh-frontend does not implement {rpc}: {why}")
        )
        return None

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "RepositoryIndex", _NO_REPOSITORY)

    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "RepositoryModelLoad", _NO_REPOSITORY)

    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "RepositoryModelUnload", _NO_REPOSITORY)

    async def SystemSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "SystemSharedMemoryStatus", _NO_SHM)

    async def SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "SystemSharedMemoryRegister", _NO_SHM)

    async def SystemSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "SystemSharedMemoryUnregister", _NO_SHM)

    async def CudaSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "CudaSharedMemoryStatus", _NO_SHM)

    async def CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "CudaSharedMemoryRegister", _NO_SHM)

    async def CudaSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "CudaSharedMemoryUnregister", _NO_SHM)

    async def TraceSetting(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "TraceSetting", "tracing is configured with --otel-exporter")

    async def LogSettings(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await self._unimplemented(context, "LogSettings", "logging is configured with --log-level")


_NO_REPOSITORY = "models come and go with the workers' model cards in discovery"
_NO_SHM = "tensors travel in the request; shared-memory regions are not supported"


def _refuse(context: grpc.aio.ServicerContext[Any, Any], error: FrontendError) -> None:
    """End a unary call with ``error``'s status; the caller then returns any response (gRPC drops it).

    Not ``context.abort``: its exception and the call's state reference each other, so every
    aborted request, up to the whole received message, stays in memory until Python's cyclic GC
    happens to run. Measured on a bare grpc.aio server: +80 MB RSS per aborted 60 MB request,
    growing without bound; with set_code and a return, flat.
    """
    context.set_code(error.code)
    context.set_details(error.message)


def _error_response(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    """The ``infer_response`` of an in-band error: names the failed request; it is that request's last."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
    response.parameters["triton_final_response"].bool_param = True
    return response


def add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """The KServe service on ``server`` as the daemon serves it (for a server outside the daemon's runtime)."""
    grpc_services.add_service(server, SERVICE, servicer, in_band=IN_BAND)
