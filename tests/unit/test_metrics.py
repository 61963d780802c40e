"""The metrics module's pure parts: how recorded outcomes and claims move the counters,
the leader's gauges, and the HTTP endpoint's answers (no database)."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pgjobd import health, metrics
from pgjobd.model import ClaimedJob, Outcome, Verdict

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def job(queue: str, kind: str = "k", attempt: int = 1) -> ClaimedJob:
    return ClaimedJob(
        id=1, fence=1, kind=kind, queue=queue, attempt=attempt, max_attempts=3, crashes=0,
        priority=0, tenant=None, enqueued_at=NOW, scheduled_at=NOW, args=b"{}",
    )  # fmt: skip


def outcome(queue: str, verdict: Verdict, duration_s: float = 0.1) -> Outcome:
    return Outcome(job(queue), verdict, duration_s=duration_s)


def test_recorded_outcomes_move_the_counters_by_kind_and_reason() -> None:
    q = f"q{uuid.uuid4().hex[:8]}"  # a queue of its own: the registry is process-wide
    metrics.record_outcomes([
        (outcome(q, "completed"), None),
        (outcome(q, "completed"), None),
        (outcome(q, "failed"), None),  # retried
        (outcome(q, "retry"), None),  # retried
        (outcome(q, "failed"), "attempts_exhausted"),
        (outcome(q, "discarded"), "discarded"),
        (outcome(q, "crashed"), "worker_crash"),
        (outcome(q, "snoozed"), None),
        (outcome(q, "failed"), "cancelled"),
        (outcome(q, "given_back"), None),
    ])  # fmt: skip
    labels = {"queue": q, "kind": "k"}
    assert value("pgjobd_jobs_completed_total", **labels) == 2
    assert value("pgjobd_jobs_failed_total", **labels) == 6
    assert value("pgjobd_jobs_retried_total", **labels) == 2
    assert value("pgjobd_jobs_snoozed_total", **labels) == 1
    assert value("pgjobd_jobs_discarded_total", **labels) == 1
    assert value("pgjobd_jobs_cancelled_total", **labels) == 1
    assert value("pgjobd_jobs_quarantined_total", **labels) == 1
    for reason in ("attempts_exhausted", "discarded", "worker_crash"):
        assert value("pgjobd_jobs_dead_total", reason=reason, **labels) == 1
    assert value("pgjobd_jobs_dead_total", reason="cancelled", **labels) == 0
    assert value("pgjobd_jobs_given_back_total", queue=q) == 1
    # Every attempt that ran has a duration; a give-back did not run.
    assert value("pgjobd_job_duration_seconds_count", **labels) == 9


def test_a_claim_counts_its_jobs_by_kind_and_their_waits() -> None:
    q = f"q{uuid.uuid4().hex[:8]}"
    metrics.record_claim(q, 0.002, ["a", "a", "b"], [0.5, 2.0, -0.01])
    assert value("pgjobd_claim_duration_seconds_count", queue=q) == 1
    assert value("pgjobd_jobs_claimed_total", queue=q, kind="a") == 2
    assert value("pgjobd_jobs_claimed_total", queue=q, kind="b") == 1
    assert value("pgjobd_job_wait_seconds_count", queue=q) == 3
    assert value("pgjobd_job_wait_seconds_sum", queue=q) == pytest.approx(2.5)
    assert value("pgjobd_job_wait_seconds_bucket", queue=q, le="1.0") == 2


# Any finite value, the bounds themselves and their neighbours among them.
_OBSERVED = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(metrics.DURATION_BUCKETS),
    st.sampled_from(metrics.DURATION_BUCKETS).map(lambda b: b * (1 + 2**-52)),
    st.sampled_from(metrics.DURATION_BUCKETS).map(lambda b: b * (1 - 2**-53)),
    st.just(0.0), st.just(-0.0), st.just(float("inf")),
)  # fmt: skip


@given(observations=st.lists(st.tuples(st.sampled_from(["a", 'b\n"c']), _OBSERVED)))
def test_a_loop_histogram_exports_what_prometheus_clients_histogram_does(
    observations: list[tuple[str, float]],
) -> None:
    """The lock-free histogram of the per-job metrics against the library's own, given
    the same observations: the same text, bucket by bucket (an infinity lands in +Inf),
    but for the `_created` series, which the daemon turns off (watch_member)."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop_histogram = metrics.LoopHistogram(
        "h_seconds", "doc", ["queue"], metrics.DURATION_BUCKETS, registry=ours
    )
    histogram = Histogram(
        "h_seconds", "doc", ["queue"], buckets=metrics.DURATION_BUCKETS, registry=theirs
    )
    for label, value in observations:
        loop_histogram.labels(label).observe(value)
        histogram.labels(label).observe(value)
    created = re.compile(rb"^.*h_seconds_created.*\n", re.MULTILINE)
    assert generate_latest(ours) == created.sub(b"", generate_latest(theirs))


def test_a_loop_histogram_refuses_the_wrong_number_of_labels() -> None:
    loop_histogram = metrics.LoopHistogram(
        "h_seconds", "doc", ["queue", "kind"], (1.0,), registry=CollectorRegistry()
    )
    with pytest.raises(ValueError, match=r"h_seconds takes labels \('queue', 'kind'\)"):
        loop_histogram.labels("q")


def test_queue_gauges_are_replaced_and_cleared_when_leadership_ends() -> None:
    stat = metrics.QueueStat("gone", {"available": 3}, 12.5, paused=True)
    metrics.set_leader(True, 7)
    metrics.set_queue_stats([stat])
    assert value("pgjobd_leader") == 1 and value("pgjobd_leader_term") == 7
    assert value("pgjobd_queue_jobs", queue="gone", state="available") == 3
    assert value("pgjobd_queue_jobs", queue="gone", state="running") == 0
    assert value("pgjobd_queue_oldest_available_age_seconds", queue="gone") == 12.5
    assert value("pgjobd_queue_paused", queue="gone") == 1
    metrics.set_queue_stats([metrics.QueueStat("new", {}, None, paused=False)])
    assert metrics.REGISTRY.get_sample_value(
        "pgjobd_queue_jobs", {"queue": "gone", "state": "available"}
    ) is None  # fmt: skip
    metrics.set_leader(False, 7)
    assert value("pgjobd_leader") == 0 and value("pgjobd_leader_term") == 7
    assert "pgjobd_queue_jobs{" not in metrics.exposition().decode()


def test_member_state_is_read_at_scrape_time() -> None:
    state = metrics.MemberState(
        in_flight={"default": 2}, workers={"default": 2, "other": 1},
        failed_queues={"other"}, ready=False,
    )  # fmt: skip
    metrics.watch_member(lambda: state)
    assert value("pgjobd_jobs_in_flight", queue="default") == 2
    assert value("pgjobd_worker_processes", queue="other") == 1
    assert value("pgjobd_queue_crash_looping", queue="other") == 1
    assert value("pgjobd_queue_crash_looping", queue="default") == 0
    assert value("pgjobd_ready") == 0
    state.ready = True
    assert value("pgjobd_ready") == 1


def test_readiness_names_every_problem() -> None:
    ready = health.Checks(started=True, db_ok_age_s=1.0, listener_healthy=True)
    assert health.ready_problems(ready) == []
    assert health.ready_problems(health.Checks()) == ["starting"]
    broken = health.Checks(
        started=True, draining=True, db_ok_age_s=60.0, listener_healthy=False,
        recording=False, failed_queues={"q": "5 worker starts failed in a row"},
        dead_task="producers: RuntimeError()",
    )  # fmt: skip
    problems = health.ready_problems(broken)
    assert problems[0] == "core task died: producers: RuntimeError()"
    assert "draining" in problems
    assert "database: last successful round trip 60 s ago" in problems
    assert "LISTEN session down" in problems
    assert "queue q crash-looping: 5 worker starts failed in a row" in problems
    assert health.live_problems(broken) == ["core task died: producers: RuntimeError()"]
    assert health.live_problems(health.Checks(loop_lag_s=9.0)) != []


@pytest.mark.anyio
async def test_the_endpoint_answers_over_http() -> None:
    checks = health.Checks(started=True, db_ok_age_s=0.0, listener_healthy=True)

    async def get(port: int, path: str) -> tuple[int, str]:
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = b""
            with anyio.fail_after(5):
                while True:
                    try:
                        data += await stream.receive()
                    except anyio.EndOfStream:
                        break
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), body.decode()

    async with anyio.create_task_group() as tg:
        port = await tg.start(health.serve, "127.0.0.1", 0, lambda: checks)
        assert await get(port, "/healthz") == (200, '{"status":"ok","problems":[]}\n')
        assert (await get(port, "/readyz"))[0] == 200
        checks.draining = True
        assert await get(port, "/readyz") == (
            503, '{"status":"unavailable","problems":["draining"]}\n'
        )  # fmt: skip
        status, body = await get(port, "/metrics")
        assert status == 200 and "# TYPE pgjobd_leader gauge" in body
        assert (await get(port, "/nope"))[0] == 404
        tg.cancel_scope.cancel()


def test_every_metric_and_every_alerted_metric_is_documented() -> None:
    docs = Path(__file__).parents[2] / "docs"
    documented = (docs / "metrics.md").read_text()
    metrics.watch_member(metrics.MemberState)
    names = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in metrics.REGISTRY.collect()
    }
    assert len(names) > 30
    assert not [name for name in names if f"`{name}`" not in documented]
    alerted = set(re.findall(r"pgjobd_[a-z_]+", (docs / "alerts.yml").read_text()))
    histograms = {n for n in alerted if n.endswith("_bucket")}
    assert alerted - histograms <= names and {h[: -len("_bucket")] for h in histograms} <= names
