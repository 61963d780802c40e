"""The LISTEN session: turns `<schema>.job_ready` notifications into per-queue wake-ups,
and `<schema>.job_cancel` ones (an admin cancelled a running job) into `on_cancel`.

NOTIFY is a hint, never the source of truth: producers also poll. When the session is
lost every producer is woken (to poll at once) and the session is opened again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

import anyio
import asyncpg

from pgjobd import backoff
from pgjobd.config import Config
from pgjobd.db import connect_session
from pgjobd.errors import TRANSIENT

log = logging.getLogger(__name__)

PING_INTERVAL_S = 5.0
PING_TIMEOUT_S = 5.0
# The longest wait between two reconnects, as the leader session's: /readyz wants this
# session, so after an outage it must be back within seconds of the server.
RECONNECT_MAX_S = 2.0


class Wakeup:
    """A level-triggered wake-up a producer clears before it claims and waits on after."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self, timeout_s: float) -> None:
        with anyio.move_on_after(timeout_s):
            await self._event.wait()


class Notifier:
    def __init__(self, config: Config, queues: Iterable[str], member_id: str = "") -> None:
        self.config = config
        self.member_id = member_id
        self.channel = f"{config.database.schema}.job_ready"
        self.cancel_channel = f"{config.database.schema}.job_cancel"
        self.room_channel = f"{config.database.schema}.job_room"
        self.wakeups = {queue: Wakeup() for queue in queues}
        self.on_cancel: Callable[[int], None] = lambda _job_id: None
        self.healthy = False

    def wakeup(self, queue: str) -> Wakeup:
        """The queue's wake-up (queues may be added by a reload)."""
        return self.wakeups.setdefault(queue, Wakeup())

    def _on_notify(self, _conn: object, _pid: int, _channel: str, queue: str) -> None:
        wakeup = self.wakeups.get(queue)
        if wakeup is not None:
            wakeup.set()

    def _on_room(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        """queue_room_announce: "queue\nmember". A member's own announcements wake
        nothing: its producers took the places as the jobs ended (OwnEnds), so a claim
        woken by them would come back empty."""
        queue, _, member = payload.partition("\n")
        if member != self.member_id:
            self._on_notify(_conn, _pid, _channel, queue)

    def _on_cancel(self, _conn: object, _pid: int, _channel: str, job_id: str) -> None:
        with contextlib.suppress(ValueError):
            self.on_cancel(int(job_id))

    def _wake_all(self) -> None:
        for wakeup in self.wakeups.values():
            wakeup.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        failures = 0
        while True:
            try:
                # LISTEN needs a session of its own: behind a transaction-pooling proxy this is
                # database.leader_dsn (a direct connection), like the leader's lock.
                conn = await connect_session(self.config, "pgjobd listener")
            except TRANSIENT as e:
                failures += 1
                log.warning(
                    "LISTEN session: cannot connect: %s", e, extra={"event": "listener.down"}
                )
                await anyio.sleep(backoff.jittered(min(RECONNECT_MAX_S, 0.5 * 2**failures)))
                continue
            try:
                await conn.add_listener(self.channel, self._on_notify)
                await conn.add_listener(self.cancel_channel, self._on_cancel)
                await conn.add_listener(self.room_channel, self._on_room)
                self.healthy, failures = True, 0
                log.info("listening on %s", self.channel, extra={"event": "listener.up"})
                self._wake_all()  # anything enqueued while we were not listening
                if not started:
                    task_status.started()
                    started = True
                while True:
                    await anyio.sleep(PING_INTERVAL_S)
                    with anyio.fail_after(PING_TIMEOUT_S):
                        await conn.fetchval("SELECT 1")
            except (*TRANSIENT, asyncpg.PostgresError) as e:
                log.warning("LISTEN session lost: %s", e, extra={"event": "listener.down"})
            finally:
                self.healthy = False
                self._wake_all()
                with anyio.move_on_after(2, shield=True):
                    await conn.close()
            failures += 1
            await anyio.sleep(backoff.jittered(min(RECONNECT_MAX_S, 0.2 * 2**failures)))
