"""Making an attempt's outcome storable by PostgreSQL, wherever it was made.

A handler controls every field of its outcome: the result, the exception's class name
and message, the traceback, a Retry or Snooze delay. PostgreSQL refuses some values
outright (a NUL character in text, the escape \\u0000 in jsonb, a lone UTF-16
surrogate, a time beyond its timestamp range), and unbounded sizes cost every reader.
`storable` rewrites such fields the same way in the worker (at the source) and in the
completer (for outcomes made elsewhere, and in case a worker did not):

- NUL and lone surrogates in text become U+FFFD, the replacement character; in a
  result they are replaced inside the JSON's strings and keys.
- Texts longer than their cap are cut, with a marker saying how much was cut.
- A result over MAX_RESULT_BYTES, or one that is not valid JSON, is dropped (the job
  still completes; a warning says why).
- A delay that is not a finite number of seconds, or beyond MAX_DELAY_S, becomes
  MAX_DELAY_S; a negative one becomes 0. The error message notes the change.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Protocol, TypeVar, cast

import msgspec

log = logging.getLogger(__name__)

MAX_CLASS_CHARS = 256
MAX_MESSAGE_CHARS = 4096
MAX_TRACEBACK_CHARS = 32 * 1024
MAX_RESULT_BYTES = 1024 * 1024
# Ten years of 365.25 days: far enough for any real snooze, far inside the timestamp range.
MAX_DELAY_S = 10 * 365.25 * 86400
REPLACEMENT = "\ufffd"

_UNSTORABLE_CHARS = re.compile("[\x00\ud800-\udfff]")


class OutcomeFields(Protocol):
    """What Outcome (the completer's) and Done (the worker's frame) have in common."""

    @property
    def duration_s(self) -> float: ...
    @property
    def result(self) -> bytes | None: ...
    @property
    def error_class(self) -> str | None: ...
    @property
    def error_message(self) -> str | None: ...
    @property
    def traceback(self) -> str | None: ...
    @property
    def after_s(self) -> float | None: ...


T = TypeVar("T", bound=OutcomeFields)


def storable_text(text: str | None, limit: int, *, keep_end: bool = False) -> str | None:
    """`text` without NUL or lone surrogates, cut to `limit` characters with a marker
    (keeping its end instead of its start: tracebacks end with the error)."""
    if text is None:
        return None
    if not text.isascii() or "\x00" in text:
        text = _UNSTORABLE_CHARS.sub(REPLACEMENT, text)
    if len(text) > limit:
        marker = f"...(cut to {limit} of {len(text)} characters)"
        keep = max(0, limit - len(marker) - keep_end)
        text = f"{marker}\n{text[-keep:]}" if keep_end else f"{text[:keep]}{marker}"
    return text


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return _UNSTORABLE_CHARS.sub(REPLACEMENT, value)
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def storable_result(result: bytes | None) -> tuple[bytes | None, str | None]:
    """(the result as jsonb takes it, or None; why it was changed or dropped, or None)."""
    if result is None:
        return None, None
    if len(result) > MAX_RESULT_BYTES:
        return None, f"the result is {len(result)} bytes of JSON, over {MAX_RESULT_BYTES}"
    # msgspec writes UTF-8 and escapes only control characters: the common case needs
    # no parsing. An escape (\u0000 among them) or bytes that are not UTF-8 do.
    try:
        result.decode()
    except UnicodeDecodeError:
        utf8 = False
    else:
        utf8 = True
        if b"\\u" not in result:
            return result, None
    try:
        value = msgspec.json.decode(result)
        cleaned = msgspec.json.encode(_clean(value))
    except (msgspec.DecodeError, msgspec.EncodeError, ValueError, OverflowError) as e:
        return None, f"the result is not valid JSON ({e})"
    if utf8 and cleaned == result:
        return result, None
    if len(cleaned) > MAX_RESULT_BYTES:
        return None, f"the result is {len(cleaned)} bytes of JSON, over {MAX_RESULT_BYTES}"
    return cleaned, None


def storable_delay(after_s: float | None) -> tuple[float | None, str | None]:
    """(a delay `now() + interval` can take, or None; a note if it was changed)."""
    if after_s is None:
        return None, None
    if math.isnan(after_s) or after_s > MAX_DELAY_S:  # inf too
        return MAX_DELAY_S, f"a delay of {after_s!r}s is beyond {MAX_DELAY_S:.0f}s (10 years)"
    if after_s < 0:
        return 0.0, None
    return after_s, None


def storable(outcome: T) -> T:
    """`outcome` (an Outcome or a worker's Done) with every field storable: itself when
    nothing needed changing, which is the common case and costs a few checks."""
    if (
        outcome.error_class is None
        and outcome.error_message is None
        and outcome.traceback is None
        and outcome.result is None
        and outcome.after_s is None
        and 0.0 <= outcome.duration_s < math.inf
    ):
        return outcome  # the common case: a job that completed and returned nothing
    fields: dict[str, Any] = {}
    error_class, message = outcome.error_class, outcome.error_message
    traceback, result, after_s = outcome.traceback, outcome.result, outcome.after_s
    new_class = storable_text(error_class, MAX_CLASS_CHARS)
    if new_class is not error_class:
        fields["error_class"] = new_class
    new_traceback = storable_text(traceback, MAX_TRACEBACK_CHARS, keep_end=True)
    if new_traceback is not traceback:
        fields["traceback"] = new_traceback
    new_result, result_note = storable_result(result)
    if new_result is not result:
        fields["result"] = new_result
    new_after_s, delay_note = storable_delay(after_s)
    if new_after_s is not after_s:
        fields["after_s"] = new_after_s
    if not math.isfinite(outcome.duration_s) or outcome.duration_s < 0:
        fields["duration_s"] = 0.0
    new_message = message
    if delay_note is not None:
        new_message = f"{message} ({delay_note}: capped)" if message else delay_note
    new_message = storable_text(new_message, MAX_MESSAGE_CHARS)
    if new_message is not message:
        fields["error_message"] = new_message
    for note in (result_note, delay_note):
        if note is not None:
            log.warning(
                "job %s: %s; %s", _job_id(outcome), note,
                "the result is dropped" if note is result_note else "capped",
                extra={"event": "job.outcome_adjusted", "job_id": _job_id(outcome)},
            )  # fmt: skip
    if not fields:
        return outcome
    return cast(T, msgspec.structs.replace(cast(msgspec.Struct, outcome), **fields))


def _job_id(outcome: Any) -> int | None:
    job = getattr(outcome, "job", None)
    return getattr(job, "id", None) or getattr(outcome, "job_id", None)
