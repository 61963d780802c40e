"""The reload coordinator: consumes Reload messages one at a time. Each reads the config
and the handler directories again and starts a new generation of workers on them; the
old generations stop claiming, finish what they hold, and exit. A config or handler
module that fails keeps the current generation running.

The new config reaches the rest of the member through the LiveConfig it publishes
(roles, the completer, presence and the lease keeper read it there)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from pgjobd import systemd
from pgjobd.config import Config
from pgjobd.errors import ConfigError
from pgjobd.member import MemberContext
from pgjobd.member.generations import Generations
from pgjobd.member.signals import Reload

log = logging.getLogger(__name__)


class ReloadCoordinator:
    name: ClassVar[str] = "reload"

    def __init__(
        self,
        requests: MemoryObjectReceiveStream[Reload],
        generations: Generations,
        reload_config: Callable[[], Config] | None,
    ) -> None:
        self.requests = requests
        self.generations = generations
        self.reload_config = reload_config

    async def run(
        self, ctx: MemberContext, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with self.requests:
            task_status.started()
            async for _ in self.requests:
                systemd.notify("RELOADING=1")
                try:
                    await self.reload(ctx)
                finally:
                    systemd.notify("READY=1")

    async def reload(self, ctx: MemberContext) -> None:
        if self.reload_config is None:
            log.warning("SIGHUP: nothing to reload from")
            return
        current = ctx.config.current
        try:
            config = self.reload_config()
            if (config.dsn, config.database) != (current.dsn, current.database):
                raise ConfigError("[database] settings change only with a restart")
            new = await self.generations.start(config)
        except ConfigError as e:
            log.error(
                "SIGHUP: reload rejected, the current configuration keeps running: %s", e,
                extra={"event": "member.reload_rejected"},
            )  # fmt: skip
            return
        old = [g for g in self.generations.running if g is not new]
        for generation in old:
            # Claim no more into the old workers: a claim in flight hands its jobs over
            # (and they give them back), so none is stranded.
            generation.stop_claiming(ctx.config.current.daemon.lease.total_seconds())
        ctx.config.publish(config)
        await self.generations.declare(new)
        self.generations.start_producers(new)
        for generation in old:
            self.generations.retire(generation)
        log.info(
            "SIGHUP: reloaded; generation %d serves queues %s", new.number,
            ", ".join(new.workers),
            extra={"event": "member.reloaded", "generation": new.number},
        )  # fmt: skip
