"""Every Prometheus metric of a member, in one registry of its own (docs/metrics.md).

All of them are recorded in the supervisor process (the daemon's event loop): worker
processes report their jobs' durations in Done frames, so no multiprocess mode is
needed. Counters move where the fact becomes true: the completer counts outcomes once
the database has recorded them (fence-checked), producers count claims, the queue
workers count restarts, the leader's roles set the fleet-wide gauges. Values that are
cheaper to read than to track (jobs in flight, crash-looping queues) are read at scrape
time by `MemberCollector`.

`pgjobd_queue_*` and the vacuum gauges describe the whole fleet and are exported by the
leader only: a follower exports none of them (they are cleared when leadership ends), so
`max by (queue)` or a plain query over every member gives the one true value.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pgjobd.model import Outcome
    from pgjobd.roles.horizon import HorizonReading

REGISTRY = CollectorRegistry()
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Handler run times: from a few ms to the default timeout's order of magnitude.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
    300, 900, 3600,
)  # fmt: skip
# Due -> started: sub-second when keeping up; minutes when a queue is behind.
WAIT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800,
    3600,
)  # fmt: skip
# One claim statement: a millisecond or two when healthy; bloat makes it seconds.
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
TICK_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)

# -- jobs -------------------------------------------------------------------------------


def _per_kind(name: str, documentation: str) -> Counter:
    """A job counter labelled by queue and kind."""
    return Counter(name, documentation, ["queue", "kind"], registry=REGISTRY)


JOBS_CLAIMED = _per_kind(
    "pgjobd_jobs_claimed_total", "Jobs claimed by this member (each attempt once)."
)
JOBS_THROTTLED = Counter(
    "pgjobd_jobs_throttled_total",
    "Claims by this member that a fleet-wide limit held back while jobs were available "
    "(limit: global_concurrency, rate_limit, tenant_concurrency, kind_global_concurrency, "
    "kind_rate_limit, kind_circuit_breaker).",
    ["queue", "limit"], registry=REGISTRY,
)  # fmt: skip
JOBS_COMPLETED = _per_kind(
    "pgjobd_jobs_completed_total", "Jobs whose handler returned, as recorded."
)
JOBS_FAILED = _per_kind(
    "pgjobd_jobs_failed_total",
    "Failed attempts, as recorded: the handler raised (incl. Retry, Discard), timed out, "
    "had invalid args or an unknown kind, or its worker crashed.",
)
JOBS_RETRIED = _per_kind(
    "pgjobd_jobs_retried_total", "Failed attempts after which the job will run again."
)
JOBS_SNOOZED = _per_kind(
    "pgjobd_jobs_snoozed_total", "Attempts that snoozed (not counted as an attempt)."
)
JOBS_DISCARDED = _per_kind(
    "pgjobd_jobs_discarded_total", "Jobs the handler discarded (Discard or discard_on)."
)
JOBS_DEAD = Counter(
    "pgjobd_jobs_dead_total",
    "Jobs that ended dead, by reason (attempts_exhausted, worker_crash, discarded, "
    "invalid_args, unknown_kind), as recorded by this member.",
    ["queue", "kind", "reason"], registry=REGISTRY,
)  # fmt: skip
JOBS_QUARANTINED = _per_kind(
    "pgjobd_jobs_quarantined_total",
    "Jobs made dead for killing their worker max_crashes times (poison pills).",
)
JOBS_CANCELLED = _per_kind(
    "pgjobd_jobs_cancelled_total", "Running jobs that ended cancelled by an admin."
)
JOBS_GIVEN_BACK = Counter(
    "pgjobd_jobs_given_back_total",
    "Jobs handed back unfinished (drain), available again with the attempt uncharged.",
    ["queue"], registry=REGISTRY,
)  # fmt: skip
STALE_OUTCOMES = Counter(
    "pgjobd_stale_outcomes_total",
    "Outcomes dropped because the job's lease (fence) was lost before they were recorded.",
    ["queue"], registry=REGISTRY,
)  # fmt: skip


class LoopHistogram(Collector):
    """A labelled histogram for what is observed once per job: counted in plain lists
    and exported at scrape time. prometheus_client's Histogram takes a lock for its sum
    and another for a bucket on every observation: 0.9 µs against 0.15 here, twice per
    job (docs/decisions.md, "CPU per job on the Python side"). Every observation and
    every scrape of these happen on the member's event loop (the /metrics endpoint is
    served there), so none needs a lock."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(bound) for bound in buckets)
        self._les = [repr(bound) for bound in self.bounds] + ["+Inf"]
        self._series: dict[tuple[str, ...], LoopHistogramSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogramSeries:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, not {values}")
            series = self._series[values] = LoopHistogramSeries(self.bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self._series.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._les, series.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(list(values), buckets, series.sum)
        yield family


class LoopHistogramSeries:
    """One label set's counts: counts[i] holds the observations above bounds[i - 1] and
    up to bounds[i] (the last: above every bound, +Inf's own)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


JOB_DURATION = LoopHistogram(
    "pgjobd_job_duration_seconds",
    "Handler run time of recorded attempts (as the worker measured it; for a crash, until "
    "the death was seen).",
    ["queue", "kind"], DURATION_BUCKETS,
)  # fmt: skip
JOB_WAIT = LoopHistogram(
    "pgjobd_job_wait_seconds",
    "From when a job was due (run_at) to its claim, on the database clock.",
    ["queue"], WAIT_BUCKETS,
)  # fmt: skip
CLAIM_DURATION = LoopHistogram(
    "pgjobd_claim_duration_seconds",
    "Round trip of one claim statement (pool acquire included).",
    ["queue"], CLAIM_BUCKETS,
)  # fmt: skip

# -- workers ----------------------------------------------------------------------------

WORKER_RESTARTS = Counter(
    "pgjobd_worker_restarts_total",
    "Worker processes replaced, by reason: crash (died on its own), timeout_kill (killed "
    "holding a job past its timeout), protocol_error, recycled (max_jobs_per_process or "
    "max_rss), boot_failure (a replacement that failed to start).",
    ["queue", "reason"], registry=REGISTRY,
)  # fmt: skip

# -- leadership and roles ---------------------------------------------------------------

LEADER = Gauge("pgjobd_leader", "1 while this member leads, else 0.", registry=REGISTRY)
LEADER_TERM = Gauge(
    "pgjobd_leader_term", "The term this member leads (or last led); 0 if never.",
    registry=REGISTRY,
)  # fmt: skip
ROLE_TICK = Histogram(
    "pgjobd_role_tick_duration_seconds", "Duration of one tick of a leader role.",
    ["role"], buckets=TICK_BUCKETS, registry=REGISTRY,
)  # fmt: skip
ROLE_ERRORS = Counter(
    "pgjobd_role_errors_total", "Leader role ticks that failed.", ["role"], registry=REGISTRY
)
JOBS_AGED = Counter(
    "pgjobd_jobs_aged_total",
    "Steps of priority aging: jobs moved up one priority by the leader's priority_ager "
    "(queues with a priority_aging).",
    ["queue"], registry=REGISTRY,
)  # fmt: skip
JOBS_EXPIRED = Counter(
    "pgjobd_jobs_expired_total",
    "Jobs not started by their expires_at (ttl), ended dead with reason 'expired' by the "
    "reaper (on the leader).",
    ["queue", "kind"], registry=REGISTRY,
)  # fmt: skip
LEASES_EXPIRED = Counter(
    "pgjobd_leases_expired_total",
    "Running jobs whose member stopped renewing their lease, taken back by the reaper "
    "(on the leader): result rescued (available again) or dead.",
    ["result"], registry=REGISTRY,
)  # fmt: skip

# -- fleet-wide, from the leader --------------------------------------------------------


class QueueJobsCollector(Collector):
    """`pgjobd_queue_jobs`: live jobs per queue and state, and for a queue with `fair` or
    `tenant_concurrency` per queue, state and tenant instead (one family, two label
    sets: a sum by queue and state is the queue's total either way). Set by the
    leader's queue_stats role; a follower exports none."""

    def __init__(self) -> None:
        self._values: dict[tuple[tuple[str, str], ...], float] = {}

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked, like MemberCollector

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "pgjobd_queue_jobs",
            "Live jobs per queue and state (available, scheduled, running, retryable, "
            "blocked), per tenant too in queues with fair or tenant_concurrency (the "
            f"{TENANTS_SHOWN} tenants with most live jobs, the rest as tenant "
            f'"{OTHER_TENANTS}"); leader only.',
        )
        for labels, value in self._values.items():
            family.add_sample("pgjobd_queue_jobs", dict(labels), value)
        yield family

    def set(self, value: float, queue: str, state: str, tenant: str | None = None) -> None:
        labels = [("queue", queue), ("state", state)]
        if tenant is not None:
            labels.append(("tenant", tenant))
        key = tuple(labels)
        self._values[key] = self._values.get(key, 0.0) + value

    def clear(self) -> None:
        self._values = {}


# Per queue broken down by tenant: the tenants with most live jobs shown by name (jobs
# without a tenant as ""), the others summed as OTHER_TENANTS (a real tenant of that
# name is summed with them). At most queues x (TENANTS_SHOWN + 1) x 5 series.
TENANTS_SHOWN = 20
OTHER_TENANTS = "*"
QUEUE_JOBS = QueueJobsCollector()
REGISTRY.register(QUEUE_JOBS)
QUEUE_OLDEST_AGE = Gauge(
    "pgjobd_queue_oldest_available_age_seconds",
    "Age of the oldest available job per queue (0 when none waits); leader only.",
    ["queue"], registry=REGISTRY,
)  # fmt: skip
QUEUE_PAUSED = Gauge(
    "pgjobd_queue_paused", "1 when the queue is paused fleet-wide; leader only.",
    ["queue"], registry=REGISTRY,
)  # fmt: skip
JOB_TABLE_ROWS = Gauge(
    "pgjobd_job_table_rows",
    "Live and dead tuples of the hot job table (pg_stat_user_tables); leader only.",
    ["kind"], registry=REGISTRY,
)  # fmt: skip
JOB_TABLE_DEAD_RATIO = Gauge(
    "pgjobd_job_table_dead_ratio", "Dead / (live + dead) tuples of the job table; leader only.",
    registry=REGISTRY,
)  # fmt: skip
XMIN_HORIZON_AGE = Gauge(
    "pgjobd_xmin_horizon_age_seconds",
    "How long the database's xmin horizon has been held back (0: nothing holds it); "
    "leader only.",
    registry=REGISTRY,
)  # fmt: skip
XMIN_HORIZON_XIDS = Gauge(
    "pgjobd_xmin_horizon_age_xids",
    "Transactions since the xid the oldest horizon holder pins; leader only.",
    registry=REGISTRY,
)  # fmt: skip
WRAPAROUND_AGE = Gauge(
    "pgjobd_database_wraparound_age_xids", "age(datfrozenxid) of the database; leader only.",
    registry=REGISTRY,
)  # fmt: skip
KIND_BREAKER_STATE = Gauge(
    "pgjobd_kind_breaker_state",
    "State of each declared circuit breaker: 0 closed, 1 half-open, 2 open; leader only.",
    ["kind"], registry=REGISTRY,
)  # fmt: skip
KIND_BREAKER_OPENED = Counter(
    "pgjobd_kind_breaker_opened_total",
    "Circuit breakers opened by this member's breaker role (again after a failed probe "
    "included); leader only.",
    ["kind"], registry=REGISTRY,
)  # fmt: skip
_FLEET_GAUGES: tuple[Gauge | QueueJobsCollector, ...] = (
    QUEUE_JOBS, QUEUE_OLDEST_AGE, QUEUE_PAUSED, JOB_TABLE_ROWS, JOB_TABLE_DEAD_RATIO,
    XMIN_HORIZON_AGE, XMIN_HORIZON_XIDS, WRAPAROUND_AGE, KIND_BREAKER_STATE,
)  # fmt: skip
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}

QUEUE_STATES = ("available", "scheduled", "running", "retryable", "blocked")

# Verdicts that are failed attempts (job_attempt rows), and the rest.
_FAILED_ATTEMPT = frozenset({"failed", "retry", "discarded", "invalid_args", "unknown_kind",
                             "crashed"})  # fmt: skip


def record_outcomes(recorded: Iterable[tuple[Outcome, str | None]]) -> None:
    """Count outcomes the database recorded, each with its dead/cancelled reason (None:
    the job goes on, or completed). Grouped, so a batch costs one call per label set."""
    tally: Tally[tuple[Counter, tuple[str, ...]]] = Tally()
    # Each label set's histogram, looked up once.
    durations: dict[tuple[str, str], LoopHistogramSeries] = {}
    for outcome, reason in recorded:
        job = outcome.job
        labels = (job.queue, job.kind)
        verdict = outcome.verdict
        if verdict == "given_back":
            tally[JOBS_GIVEN_BACK, (job.queue,)] += 1
            continue
        if (duration := durations.get(labels)) is None:
            duration = durations[labels] = JOB_DURATION.labels(*labels)
        duration.observe(outcome.duration_s)
        if verdict == "completed":
            tally[JOBS_COMPLETED, labels] += 1
            continue
        if verdict == "snoozed":
            tally[JOBS_SNOOZED, labels] += 1
        elif verdict in _FAILED_ATTEMPT:
            tally[JOBS_FAILED, labels] += 1
            if verdict == "discarded":
                tally[JOBS_DISCARDED, labels] += 1
            if reason is None:
                tally[JOBS_RETRIED, labels] += 1
        if reason == "cancelled":
            tally[JOBS_CANCELLED, labels] += 1
        elif reason is not None:
            tally[JOBS_DEAD, (*labels, reason)] += 1
            if reason == "worker_crash":
                tally[JOBS_QUARANTINED, labels] += 1
    for (counter, label_values), n in tally.items():
        counter.labels(*label_values).inc(n)


def record_claim(queue: str, seconds: float, kinds: Sequence[str], waits: Sequence[float]) -> None:
    CLAIM_DURATION.labels(queue).observe(seconds)
    for kind, n in Tally(kinds).items():
        JOBS_CLAIMED.labels(queue, kind).inc(n)
    wait = JOB_WAIT.labels(queue)
    for seconds_waited in waits:
        wait.observe(max(0.0, seconds_waited))


def record_throttled(queue: str, limits: Sequence[str]) -> None:
    for limit in limits:
        JOBS_THROTTLED.labels(queue, limit).inc()


def set_leader(leading: bool, term: int) -> None:
    LEADER.set(1 if leading else 0)
    if term:
        LEADER_TERM.set(term)
    if not leading:
        clear_fleet_gauges()


def clear_fleet_gauges() -> None:
    """A follower exports no fleet-wide values (another member's are the true ones)."""
    for gauge in _FLEET_GAUGES:
        gauge.clear()


@dataclass(frozen=True)
class QueueStat:
    queue: str
    counts: dict[str, int]  # by state
    oldest_available_age_s: float | None
    paused: bool
    # A queue broken down by tenant: tenant (None: the others) -> counts by state.
    by_tenant: dict[str | None, dict[str, int]] | None = None


def set_queue_stats(stats: Iterable[QueueStat]) -> None:
    """Replace the queue gauges: a queue that disappeared leaves no stale series."""
    QUEUE_JOBS.clear()
    QUEUE_OLDEST_AGE.clear()
    QUEUE_PAUSED.clear()
    for stat in stats:
        for state in QUEUE_STATES:
            if not stat.by_tenant:  # (no live job: the queue's zeros)
                QUEUE_JOBS.set(stat.counts.get(state, 0), stat.queue, state)
                continue
            for tenant, counts in stat.by_tenant.items():
                name = OTHER_TENANTS if tenant is None else tenant
                QUEUE_JOBS.set(counts.get(state, 0), stat.queue, state, name)
        QUEUE_OLDEST_AGE.labels(stat.queue).set(stat.oldest_available_age_s or 0.0)
        QUEUE_PAUSED.labels(stat.queue).set(1 if stat.paused else 0)


def set_breakers(states: Iterable[tuple[str, str]]) -> None:
    """Replace the breaker gauge with (kind, state) pairs: a kind no longer declaring a
    breaker leaves no stale series."""
    KIND_BREAKER_STATE.clear()
    for kind, state in states:
        KIND_BREAKER_STATE.labels(kind).set(BREAKER_STATES[state])


def set_horizon(reading: HorizonReading) -> None:
    JOB_TABLE_ROWS.labels("live").set(reading.live_rows)
    JOB_TABLE_ROWS.labels("dead").set(reading.dead_rows)
    JOB_TABLE_DEAD_RATIO.set(reading.dead_ratio)
    XMIN_HORIZON_AGE.set(reading.held_s if reading.holder is not None else 0.0)
    XMIN_HORIZON_XIDS.set(reading.holder.xmin_age if reading.holder is not None else 0)
    WRAPAROUND_AGE.set(reading.wraparound_age)


# -- read at scrape time ----------------------------------------------------------------


@dataclass
class MemberState:
    """What the member reports of itself when scraped."""

    in_flight: dict[str, int] = field(default_factory=dict)  # by queue
    workers: dict[str, int] = field(default_factory=dict)  # live worker processes by queue
    failed_queues: set[str] = field(default_factory=set)
    ready: bool = False
    draining: bool = False
    event_loop_lag_s: float = 0.0


class MemberCollector(Collector):
    """Gauges computed from the member's state at scrape time (no bookkeeping on the
    hot path). Exports nothing until a member is watched."""

    def __init__(self) -> None:
        self.state: Callable[[], MemberState] | None = None

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked collector: its families are known only when collected

    def collect(self) -> Iterator[Metric]:
        if self.state is None:
            return
        s = self.state()
        in_flight = GaugeMetricFamily(
            "pgjobd_jobs_in_flight", "Jobs held by this member's workers now.", labels=["queue"]
        )
        for queue, n in sorted(s.in_flight.items()):
            in_flight.add_metric([queue], n)
        yield in_flight
        workers = GaugeMetricFamily(
            "pgjobd_worker_processes", "Live worker processes of this member.", labels=["queue"]
        )
        for queue, n in sorted(s.workers.items()):
            workers.add_metric([queue], n)
        yield workers
        failed = GaugeMetricFamily(
            "pgjobd_queue_crash_looping",
            "1 when the queue's workers fail to start again and again (see /readyz).",
            labels=["queue"],
        )
        for queue in sorted(s.workers.keys() | s.failed_queues):
            failed.add_metric([queue], 1 if queue in s.failed_queues else 0)
        yield failed
        yield GaugeMetricFamily("pgjobd_ready", "1 when /readyz answers 200.", value=int(s.ready))
        yield GaugeMetricFamily(
            "pgjobd_draining", "1 while the member drains.", value=int(s.draining)
        )
        yield GaugeMetricFamily(
            "pgjobd_event_loop_lag_seconds",
            "How late the daemon's event loop last woke a 0.5 s sleep.",
            value=s.event_loop_lag_s,
        )


_MEMBER = MemberCollector()
REGISTRY.register(_MEMBER)


def watch_member(state: Callable[[], MemberState]) -> None:
    """Export `state` at scrape time (one member per process; a later call replaces it).
    Also drops the `_created` series prometheus-client adds by default (process-wide:
    this is for the daemon's process, not for an application embedding pgjobd)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]
    _MEMBER.state = state


def exposition() -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(REGISTRY)
