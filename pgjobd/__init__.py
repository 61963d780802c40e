"""pgjobd: a job scheduler daemon on PostgreSQL.

The names below are imported on first use (PEP 562): a handler's `from pgjobd import job,
JobContext` loads the handler API only, not the client and its asyncpg and anyio, so a
worker process stays small.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0.dev0"

if TYPE_CHECKING:
    from pgjobd.client import Batch, Client, JobInfo, JobSpec, SyncClient
    from pgjobd.errors import DuplicateJob, EnqueueError, PgjobdError, QueueFull
    from pgjobd.handler_api import BatchCounts, Discard, JobContext, Retry, Snooze, job

_LAZY = {
    "Batch": "pgjobd.client",
    "BatchCounts": "pgjobd.handler_api",
    "Client": "pgjobd.client",
    "JobInfo": "pgjobd.client",
    "JobSpec": "pgjobd.client",
    "SyncClient": "pgjobd.client",
    "DuplicateJob": "pgjobd.errors",
    "EnqueueError": "pgjobd.errors",
    "PgjobdError": "pgjobd.errors",
    "QueueFull": "pgjobd.errors",
    "Discard": "pgjobd.handler_api",
    "JobContext": "pgjobd.handler_api",
    "Retry": "pgjobd.handler_api",
    "Snooze": "pgjobd.handler_api",
    "job": "pgjobd.handler_api",
}

__all__ = [
    "Batch",
    "BatchCounts",
    "Client",
    "Discard",
    "DuplicateJob",
    "EnqueueError",
    "JobContext",
    "JobInfo",
    "JobSpec",
    "PgjobdError",
    "QueueFull",
    "Retry",
    "Snooze",
    "SyncClient",
    "__version__",
    "job",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
