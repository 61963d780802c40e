"""The signal watcher: one receiver for SIGTERM, SIGINT and SIGHUP from the moment the
member joins until it has left, turning each into a Control message for the member:

  SIGHUP                    Reload
  first SIGTERM or SIGINT   Drain (SIGHUP is ignored from then on)
  any later one             StopNow

The receiver stays open through the whole drain, so no second signal finds the default
action in place; once it closes (the member has left), SIGTERM and SIGINT are ignored
for the rest of the shutdown."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import ClassVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from pgjobd.member import MemberContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reload:
    """Read the config and the handler directories again."""


@dataclass(frozen=True)
class Drain:
    """Stop taking jobs; let those in flight finish until drain_timeout."""

    signal_name: str


@dataclass(frozen=True)
class StopNow:
    """End the drain at once: kill the workers holding jobs and give the jobs back."""


Control = Reload | Drain | StopNow

WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class SignalWatcher:
    name: ClassVar[str] = "signals"

    def __init__(self, controls: MemoryObjectSendStream[Control]) -> None:
        self.controls = controls  # never full: a signal is never held up
        self.draining = False

    async def run(
        self, ctx: MemberContext, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        stopping = {signal.SIGTERM, signal.SIGINT}
        blocked = False
        try:
            with anyio.open_signal_receiver(*WATCHED) as signals:
                task_status.started()
                try:
                    async for signum in signals:
                        control = self.meaning(signal.Signals(signum))
                        if control is not None:
                            self.controls.send_nowait(control)
                finally:
                    if self.draining:
                        # Closing the receiver restores the default action before the
                        # SIG_IGN below replaces it: held back meanwhile, a SIGTERM then
                        # lands on SIG_IGN (which discards it), not on the default.
                        signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
                        blocked = True
        finally:
            if self.draining:
                # The receiver is gone but the shutdown goes on (the member leaves, the
                # pool closes): a late SIGTERM must not end it by the default action.
                for signum in stopping:
                    signal.signal(signum, signal.SIG_IGN)
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)

    def meaning(self, signum: signal.Signals) -> Control | None:
        if signum == signal.SIGHUP:
            return None if self.draining else Reload()
        if not self.draining:
            self.draining = True
            return Drain(signum.name)
        return StopNow()
