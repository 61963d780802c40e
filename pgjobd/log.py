"""Logging: one JSON object per line (or plain text), with stable event names.

Code logs with ``log.info("...", extra={"event": "job.completed", "job_id": 7})``; every
key of `extra` becomes a field of the JSON line.

Worker processes log in the daemon's format: the supervisor passes it in the
environment (WORKER_ENV_*), and `setup_worker` adds to each line the worker's queue, pid
and member, and, while a job runs, the job's id, kind, queue and attempt (`job_fields`,
a context variable, so a handler's own loggers get them too). In JSON mode a handler's
print() and sys.stderr writes become lines of the log as well (event `job.output`).
"""

from __future__ import annotations

import io
import logging
import sys
import threading
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import msgspec

from pgjobd.redact import redact_text

_STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_encoder = msgspec.json.Encoder(enc_hook=str)

# The environment a worker process learns the daemon's logging from.
ENV_FORMAT = "PGJOBD_LOG_FORMAT"
ENV_LEVEL = "PGJOBD_LOG_LEVEL"
ENV_MEMBER = "PGJOBD_MEMBER"

# The fields of the job the current task (or handler thread) runs, if any.
job_fields: ContextVar[Mapping[str, Any] | None] = ContextVar("pgjobd_job_fields", default=None)
# The texts of its args fields that the running job's handler declared redact=[...]:
# kept out of every line logged while it runs.
job_secrets: ContextVar[tuple[str, ...]] = ContextVar("pgjobd_job_secrets", default=())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES:
                line[key] = value
        if record.exc_info:
            line["exc"] = record.exc_text or self.formatException(record.exc_info)
        return _encoder.encode(line).decode(errors="replace")


class TextFormatter(logging.Formatter):
    def __init__(self, prefix: str = "") -> None:
        super().__init__(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRIBUTES}
        if extra:
            text += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return text


class ContextFilter(logging.Filter):
    """Adds fixed fields, and the current job's, to records that lack them."""

    def __init__(self, fixed: Mapping[str, Any]) -> None:
        super().__init__()
        self.fixed = dict(fixed)

    def filter(self, record: logging.LogRecord) -> bool:
        fields = record.__dict__
        for key, value in self.fixed.items():
            fields.setdefault(key, value)
        job = job_fields.get()
        if job is not None:
            fields.setdefault("event", "job.log")  # a handler's own line
            for key, value in job.items():
                fields.setdefault(key, value)
        hidden = job_secrets.get()
        if hidden:
            _redact_record(record, hidden)
        return True


def _redact_record(record: logging.LogRecord, hidden: tuple[str, ...]) -> None:
    """The record's message and traceback with the running job's secrets masked (the
    formatters use a record's exc_text when it is set)."""
    record.msg = redact_text(record.getMessage(), hidden)
    record.args = None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    record.exc_text = redact_text(record.exc_text, hidden)


def setup(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def worker_env(log_format: str, level: str, member_id: str) -> dict[str, str]:
    """The environment that makes a worker process log like its daemon."""
    return {ENV_FORMAT: log_format, ENV_LEVEL: level, ENV_MEMBER: member_id}


def setup_worker(environ: Mapping[str, str], queue: str, pid: int) -> None:
    """A worker process's logging: the daemon's format and level when it passed them
    (else text at info), with the worker's and the running job's fields on each line."""
    log_format = environ.get(ENV_FORMAT, "text")
    level = environ.get(ENV_LEVEL, "info")
    fixed: dict[str, Any] = {"worker_pid": pid, "worker_queue": queue}
    member = environ.get(ENV_MEMBER)
    if member:
        fixed["member"] = member
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(prefix=f"pgjobd worker[{pid}] {queue}: "))
        fixed = {}  # the prefix says it; job fields still show as key=value
    handler.addFilter(ContextFilter(fixed))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if log_format == "json":
        # print() and sys.stderr writes: lines of the log too, with the job's fields.
        output = logging.getLogger("pgjobd.job.output")
        sys.stdout = LineLogger(output, logging.INFO, "stdout", sys.stdout.fileno())
        sys.stderr = LineLogger(output, logging.WARNING, "stderr", sys.stderr.fileno())


class LineLogger(io.TextIOBase):
    """A text stream that logs each complete line it is written (per thread, so that
    handler threads printing at once do not mix their lines)."""

    def __init__(
        self, logger: logging.Logger, level: int, stream: str, fd: int | None = None
    ) -> None:
        super().__init__()
        self.logger = logger
        self.level = level
        self.stream = stream
        self._fd = fd
        self._local = threading.local()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        """The descriptor underneath (subprocess(stdout=sys.stdout) and the like): what
        is written to it directly is passed through as is."""
        if self._fd is None:
            raise io.UnsupportedOperation("fileno")
        return self._fd

    def write(self, text: str) -> int:
        pending: str = getattr(self._local, "pending", "") + text
        *lines, pending = pending.split("\n")
        self._local.pending = pending
        for line in lines:
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        pending: str = getattr(self._local, "pending", "")
        if pending:
            self._local.pending = ""
            self._emit(pending)

    def _emit(self, line: str) -> None:
        if getattr(self._local, "emitting", False):  # logging itself wrote to us
            if sys.__stderr__ is not None:
                sys.__stderr__.write(line + "\n")
            return
        self._local.emitting = True
        try:
            self.logger.log(
                self.level, "%s", line, extra={"event": "job.output", "stream": self.stream}
            )
        finally:
            self._local.emitting = False
