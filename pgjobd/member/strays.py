"""Stray sweeping: the member is a child subreaper, so whatever a handler starts and
leaves behind ends up its child; this kills it (see supervisor.kill_strays), every
STRAY_SWEEP_S while the member serves, and at exit once the workers have ended."""

from __future__ import annotations

from typing import ClassVar

import anyio

from pgjobd.member import MemberContext
from pgjobd.supervisor import kill_strays

STRAY_SWEEP_S = 1.0


class StraySweeper:
    name: ClassVar[str] = "stray sweeper"

    async def run(self, ctx: MemberContext) -> None:
        while True:
            await anyio.sleep(STRAY_SWEEP_S)
            kill_strays()


async def end_strays() -> None:
    """At exit, after the workers: nothing a handler started may outlive the member."""
    with anyio.move_on_after(5, shield=True):
        while kill_strays(spare_workers=False):  # noqa: ASYNC110 - /proc has no event
            await anyio.sleep(0.02)
