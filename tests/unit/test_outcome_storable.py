"""pgjobd.outcome: what makes an outcome's fields storable. Pure functions; the
database side is in tests/integration/test_outcome_storage.py."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pgjobd import outcome as storage
from pgjobd.model import ClaimedJob, Outcome
from pgjobd.protocol import Done

_specials = st.sampled_from(["\x00", "\ud800", "\udfff", "é", "\U0001d11e", "\\", '"'])
_texts = st.text(alphabet=st.one_of(_specials, st.characters()), max_size=300)
JOB = ClaimedJob(
    id=1, fence=2, kind="k", queue="default", attempt=1, max_attempts=3, crashes=0,
    priority=0, tenant=None, enqueued_at=datetime(2026, 1, 1, tzinfo=UTC),
    scheduled_at=datetime(2026, 1, 1, tzinfo=UTC), args=b"{}",
)  # fmt: skip


def _storable_text(text: str) -> bool:
    return "\x00" not in text and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@given(text=_texts, limit=st.integers(60, 200), keep_end=st.booleans())
def test_text_is_storable_bounded_and_stable(text: str, limit: int, keep_end: bool) -> None:
    stored = storage.storable_text(text, limit, keep_end=keep_end)
    assert stored is not None
    assert _storable_text(stored)
    assert len(stored) <= limit
    assert storage.storable_text(stored, limit, keep_end=keep_end) == stored
    if len(text) <= limit and _storable_text(text):
        assert stored is text


@given(after_s=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)))
def test_delays_are_finite_and_bounded(after_s: float | None) -> None:
    delay, note = storage.storable_delay(after_s)
    if after_s is None:
        assert delay is None
        return
    assert delay is not None and math.isfinite(delay)
    assert 0 <= delay <= storage.MAX_DELAY_S
    assert (note is not None) == (math.isnan(after_s) or after_s > storage.MAX_DELAY_S)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.floats(), st.integers(-(2**63), 2**63 - 1), _texts),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(_texts, children, max_size=3)),
    max_leaves=8,
)  # fmt: skip


@given(value=_json)
def test_results_keep_their_shape_without_nul(value: object) -> None:
    try:
        encoded = msgspec.json.encode(value)
    except (msgspec.EncodeError, ValueError):  # lone surrogates: the worker keeps no result
        return
    stored, note = storage.storable_result(encoded)
    assert note is None and stored is not None
    assert b"\\u0000" not in stored
    stored.decode()  # UTF-8
    assert storage.storable_result(stored) == (stored, None)


@given(
    message=st.one_of(st.none(), _texts),
    traceback=st.one_of(st.none(), _texts),
    after_s=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    duration_s=st.floats(allow_nan=True, allow_infinity=True),
)
def test_storable_is_idempotent_on_outcomes_and_frames(
    message: str | None, traceback: str | None, after_s: float | None, duration_s: float
) -> None:
    outcome = Outcome(JOB, "retry", duration_s=duration_s, error_class=message,
                      error_message=message, traceback=traceback, after_s=after_s)  # fmt: skip
    once = storage.storable(outcome)
    assert storage.storable(once) is once
    assert math.isfinite(once.duration_s)
    done = Done(1, 2, "retry", duration_s, error_message=message, after_s=after_s)
    assert storage.storable(done).error_message == once.error_message
