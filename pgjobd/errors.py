"""The pgjobd error tree, and which errors are worth retrying."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


class PgjobdError(Exception):
    """Base of every error pgjobd raises on purpose."""


class ConfigError(PgjobdError):
    """A configuration file, option or handler directory is unusable (exit status 78)."""


class SchemaError(PgjobdError):
    """The database's pgjobd schema is missing, or newer than this code."""


class EnqueueError(PgjobdError, ValueError):
    """A job was rejected at enqueue time; nothing was written."""


class DuplicateJob(EnqueueError):
    """A live job with the same unique_key exists (raised only with on_conflict="raise")."""

    def __init__(self, unique_key: str, existing_id: int) -> None:
        super().__init__(f"a live job with unique_key {unique_key!r} exists: id {existing_id}")
        self.unique_key = unique_key
        self.existing_id = existing_id


class QueueFull(EnqueueError):
    """The queue holds its max_depth of live jobs (contract §9); nothing was written."""


# SQLSTATEs raised by pgjobd's SQL functions (class "PJ" is not used by PostgreSQL).
SQLSTATE_ARGS_TOO_LARGE = "PJ001"
SQLSTATE_ARGS_NOT_OBJECT = "PJ002"
SQLSTATE_INVALID_QUEUE = "PJ003"
SQLSTATE_INVALID_OPTION = "PJ004"
SQLSTATE_DUPLICATE_JOB = "PJ005"
SQLSTATE_QUEUE_FULL = "PJ006"
SQLSTATE_WRONG_TENANT = "PJ007"  # a job for another tenant than the session's
SQLSTATE_UNKNOWN_DEPENDENCY = "PJ008"  # depends_on/after names no job (migration 0010)
ENQUEUE_SQLSTATES = frozenset(
    {
        SQLSTATE_ARGS_TOO_LARGE,
        SQLSTATE_ARGS_NOT_OBJECT,
        SQLSTATE_INVALID_QUEUE,
        SQLSTATE_INVALID_OPTION,
        SQLSTATE_WRONG_TENANT,
        SQLSTATE_UNKNOWN_DEPENDENCY,
    }
)

# Errors after which the same operation may succeed if simply tried again: the network,
# a restarting server, serialization failures and deadlocks. Built on first use (PEP 562):
# a worker process imports this module, through the handler API, but never asyncpg.
if TYPE_CHECKING:
    TRANSIENT: tuple[type[BaseException], ...]


def _transient() -> tuple[type[BaseException], ...]:
    import asyncpg  # noqa: PLC0415 (lazy: see above)

    return (
        OSError,
        TimeoutError,
        asyncpg.exceptions.ConnectionDoesNotExistError,
        asyncpg.exceptions.InterfaceError,
        # A connection left mid-operation when the server went away ("cannot switch to
        # state ..."): retried on a fresh connection; the pool discards this one.
        asyncpg.exceptions.InternalClientError,
        asyncpg.exceptions.PostgresConnectionError,
        asyncpg.exceptions.CannotConnectNowError,
        asyncpg.exceptions.AdminShutdownError,
        asyncpg.exceptions.CrashShutdownError,
        asyncpg.exceptions.SerializationError,
        asyncpg.exceptions.DeadlockDetectedError,
    )


# SQLSTATE classes of a database that refuses for now, whatever the statement: it is
# read-only (25), out of resources (53: its disk full, out of memory, no connection
# slot), a lock or object not available (55), an operator's intervention (57: a
# statement_timeout, a shutdown), a system or I/O error (58).
_REFUSING_FOR_NOW = frozenset({"25", "53", "55", "57", "58"})


def retry_later(error: BaseException) -> bool:
    """Whether a loop that must outlive an outage should try again later: a TRANSIENT
    error, or the server refusing for now (a full disk, read-only)."""
    import asyncpg  # noqa: PLC0415 (lazy: see above)

    if isinstance(error, globals().get("TRANSIENT") or __getattr__("TRANSIENT")):
        return True
    return isinstance(error, asyncpg.PostgresError) and (error.sqlstate or "")[:2] in (
        _REFUSING_FOR_NOW
    )


def __getattr__(name: str) -> Any:
    if name == "TRANSIENT":
        value = _transient()
        globals()["TRANSIENT"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
