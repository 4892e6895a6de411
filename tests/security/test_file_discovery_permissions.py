"""The file discovery backend keeps other local users out: the tree is 0700, files 0600, and a root
another user could write to (or own) is refused, by a daemon with one line and exit 2."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kvmesh.discovery import DiscoveryUnavailable, open_discovery

from tests.support.daemons import run_cli

NOBODY = 65534


async def test_the_whole_tree_is_0700_and_every_file_0600(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "discovery"  # parents are created too: 0700 as well
    discovery = await open_discovery(f"file://{root}", ttl=5)
    try:
        lease = await discovery.grant_lease()
        await lease.put("v1/instances/ns/worker/engine/1", b"record")
        await lease.put("deep/er/key/than/that", b"x")
    finally:
        await discovery.close()
    created = [tmp_path / "a", tmp_path / "a" / "b"]
    for path in [*created, *root.rglob("*"), root]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {mode:o}"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
async def test_a_group_or_world_writable_root_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "discovery"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(DiscoveryUnavailable, match="writable"):
        await open_discovery(f"file://{root}", ttl=5)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
async def test_a_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "discovery"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(DiscoveryUnavailable, match="owned by uid"):
        await open_discovery(f"file://{root}", ttl=5)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
async def test_a_predictable_parent_created_first_by_another_user_is_refused(tmp_path: Path) -> None:
    """What stops the /tmp/kvmesh-$UID squatter: the parent is theirs, so the root under it is refused."""
    squatted = tmp_path / "kvmesh-squatted"
    squatted.mkdir(mode=0o777)
    squatted.chmod(0o777)
    os.chown(squatted, NOBODY, NOBODY)
    with pytest.raises(DiscoveryUnavailable, match="ancestor"):
        await open_discovery(f"file://{squatted / 'kvmesh-discovery'}", ttl=5)


def test_a_daemon_refuses_an_unsafe_root_with_one_line_and_exit_2(tmp_path: Path) -> None:
    root = tmp_path / "discovery"
    root.mkdir()
    root.chmod(0o777)
    result = run_cli("kvmesh-worker", "--discovery", f"file://{root}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "writable" in result.stderr, result.stderr


def test_the_default_root_is_checked_too(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    runtime.chmod(0o777)  # e.g. a runtime dir another user can write to
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    result = run_cli("kvmesh-worker", env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a symlink to another user")
async def test_an_ancestor_symlink_another_user_can_re_point_is_refused(tmp_path: Path) -> None:
    """The ancestors were checked where their symlinks pointed (os.stat): a symlink in a sticky /tmp,
    owned by another user and pointing at this user's 0700 directory, passed; its owner then re-pointed
    it at a directory of theirs, and the running daemon wrote its lease and records there."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = sticky / "kvmesh-x"
    link.symlink_to(mine)
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(DiscoveryUnavailable, match="is a symlink another user"):
        await open_discovery(f"file://{link / 'kvmesh-discovery'}", ttl=5)
    os.chown(link, 0, 0, follow_symlinks=False)  # root's (as /var/run -> /run is): where it leads is checked
    discovery = await open_discovery(f"file://{link / 'kvmesh-discovery'}", ttl=5)
    await discovery.close()
