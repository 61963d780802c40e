"""The failover benchmark's handler: sleeps for ``args["s"]`` seconds (0.5-2 s), so that
every member always has jobs running when its leader is killed."""

from __future__ import annotations

import time
from typing import Any

from pgjobd import job


@job(kind="failover_sleep")
def failover_sleep(args: dict[str, Any]) -> None:
    time.sleep(float(args.get("s", 1.0)))
