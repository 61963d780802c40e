"""Log records a test captured in-process (pytest's caplog), by the `event` field every
pgjobd log line carries (docs/metrics.md lists the names): what tests assert on instead
of log text. A member's own log, in a separate process, is read by tests/e2e/events.py."""

from __future__ import annotations

import logging

import pytest


def events(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The event of every captured record, in order ("" for a record without one)."""
    return [getattr(record, "event", "") for record in caplog.records]


def records_of(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    """The captured records of one event, in order."""
    return [record for record in caplog.records if getattr(record, "event", "") == event]
