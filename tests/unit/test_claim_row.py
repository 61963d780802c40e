"""A claimed row as the member holds it (ClaimRow.claimed_job): every field where its
name says, for any values a claim can return (the job is built by position, for speed)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.model import ClaimedJob
from pgjobd.statements.job import ClaimRow

_ints = st.integers(-(2**63), 2**63 - 1)
_times = st.datetimes(timezones=st.just(UTC))
_ids = st.none() | st.lists(_ints, max_size=4)
_trace = st.none() | st.sampled_from(['{"traceparent": "00-ab-cd-01"}', "[1]", "{", '"x"', "{}"])


# ClaimRow's fields in order: id, fence, kind, queue, attempt, max_attempts, crashes,
# priority, tenant, enqueued_at, scheduled_at, args, waited_s, depends_on, after_jobs,
# blockers_failed, trace_context.
_ROWS = st.tuples(
    _ints,
    _ints,
    st.text(),
    st.text(),
    _ints,
    _ints,
    _ints,
    _ints,
    st.none() | st.text(),
    _times,
    _times,
    st.text(),
    st.floats(),
    _ids,
    _ids,
    _ints,
    _trace,
)


@given(values=_ROWS)
def test_a_claimed_row_becomes_the_job_field_by_field(values: tuple[object, ...]) -> None:
    row = ClaimRow(*values)  # type: ignore[arg-type]
    job = row.claimed_job()
    expected_trace = None
    if row.trace_context is not None:
        try:
            expected_trace = msgspec.json.decode(row.trace_context, type=dict[str, str])
        except msgspec.DecodeError:
            expected_trace = None
    assert job == ClaimedJob(
        id=row.id, fence=row.fence, kind=row.kind, queue=row.queue, attempt=row.attempt,
        max_attempts=row.max_attempts, crashes=row.crashes, priority=row.priority,
        tenant=row.tenant, enqueued_at=row.enqueued_at, scheduled_at=row.scheduled_at,
        args=row.args.encode(), depends_on=tuple(row.depends_on or ()),
        after=tuple(row.after_jobs or ()), after_failed=row.blockers_failed,
        trace_context=expected_trace,
    )  # fmt: skip


def test_distinct_values_land_in_their_own_fields() -> None:
    """Values of one type in neighbouring fields: a swap of two positions shows here."""
    t1, t2 = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)
    row = ClaimRow(1, 2, "kind", "queue", 3, 4, 5, 6, "tenant", t1, t2, "{}", 0.5,
                   [7], [8, 9], 10, None)  # fmt: skip
    job = row.claimed_job()
    assert (job.id, job.fence, job.attempt, job.max_attempts, job.crashes, job.priority) == (
        1, 2, 3, 4, 5, 6,
    )  # fmt: skip
    assert (job.kind, job.queue, job.tenant) == ("kind", "queue", "tenant")
    assert (job.enqueued_at, job.scheduled_at) == (t1, t2)
    assert (job.depends_on, job.after, job.after_failed) == ((7,), (8, 9), 10)
