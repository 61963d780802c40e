"""SIGTERMs that keep coming while a member shuts down: every one of them, however late,
must find a handler (or be ignored) rather than end the process by its default action."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from .conftest import MemberProcess

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]


async def test_a_sigterm_storm_through_the_whole_shutdown_exits_0(
    start_member: StartMember,
) -> None:
    """At d1c1ca0 the signal receiver closed with the member's services while the
    process still had its pool to close and the interpreter to finalise: a SIGTERM
    landing then killed it (exit -15, which the chaos suite's drain-during-claim
    scenario saw as `exited -15 on sigterm-twice`)."""
    member = await start_member()
    process = member.process
    with anyio.fail_after(60):
        while process.returncode is None:
            member.send_signal(signal.SIGTERM)
            await anyio.sleep(0.001)
        code = await process.wait()
    assert code == 0, member.log[-3000:]
    assert "draining" in member.log


async def test_signalling_a_member_process_never_takes_its_exit_status(tmp_path: Path) -> None:
    """The storm above once failed in CI with exit code 255 from a member that exited 0:
    anyio's process.send_signal polls the child first and can reap it under asyncio's
    child watcher, which then reports 255. MemberProcess.send_signal goes through a
    pidfd (with process.send_signal here, nearly every one of these exits reads 255)."""
    log_path = tmp_path / "child.log"
    log_path.touch()
    for _ in range(50):
        process = await anyio.open_process(["sleep", "0.01"])
        child = MemberProcess(process, log_path)
        while process.returncode is None:
            child.send_signal(signal.SIGCONT)
            await anyio.lowlevel.checkpoint()
        assert await process.wait() == 0


async def test_a_process_reaped_before_it_is_watched_takes_no_signal(tmp_path: Path) -> None:
    """CI at 3585ef3: a `sleep 0.01` above ended and was reaped by asyncio's child
    watcher before MemberProcess opened its pidfd, and the constructor raised
    ProcessLookupError. A process already reaped is one that ended: it takes no signal."""
    log_path = tmp_path / "child.log"
    log_path.touch()
    process = await anyio.open_process(["true"])
    assert await process.wait() == 0
    child = MemberProcess(process, log_path)  # raised ProcessLookupError before the fix
    assert not child.watched
    child.send_signal(signal.SIGTERM)  # nothing to signal: returns without raising
