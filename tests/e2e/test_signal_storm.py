"""SIGTERMs that keep coming while a member shuts down: every one of them, however late,
must find a handler (or be ignored) rather than end the process by its default action."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable

import anyio
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
            try:
                process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
            await anyio.sleep(0.001)
        code = await process.wait()
    assert code == 0, member.log[-3000:]
    assert "draining" in member.log
