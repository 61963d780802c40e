"""Logging: one JSON object per line (or plain text), with stable event names.

Code logs with ``log.info("...", extra={"event": "job.completed", "job_id": 7})``; every
key of `extra` becomes a field of the JSON line.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import msgspec

_STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_encoder = msgspec.json.Encoder(enc_hook=str)


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
            line["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(line).decode(errors="replace")


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRIBUTES}
        if extra:
            text += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return text


def setup(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
