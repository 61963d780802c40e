"""The queue_stats role counts the whole hot table: on a big table it counts less often,
so that the count never takes more than 1/COST_FACTOR of a core (issue 17)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pgjobd.config import Config
from pgjobd.roles.queue_stats import (
    COST_FACTOR,
    INTERVAL_S,
    MAX_INTERVAL_S,
    QueueStats,
    next_interval_s,
)


@given(st.floats(min_value=0.0, max_value=3600.0))
def test_the_count_costs_at_most_its_share_of_a_core(last_count_s: float) -> None:
    interval = next_interval_s(last_count_s)
    assert INTERVAL_S <= interval <= MAX_INTERVAL_S
    if interval < MAX_INTERVAL_S:
        assert last_count_s <= interval / COST_FACTOR


def test_the_console_never_finds_the_published_counts_too_old() -> None:
    # web/app.py shows them while at most 3 * INTERVAL_S old; the runner jitters 10 %.
    assert MAX_INTERVAL_S * 1.1 + 1.0 < 3 * INTERVAL_S


def test_a_slow_count_spaces_the_next_ones_out() -> None:
    role = QueueStats()
    config = Config()
    assert role.interval_s(config) == INTERVAL_S  # nothing counted yet
    role.last_count_s = 0.5  # a million scheduled jobs on the 2-core test machine
    assert role.interval_s(config) == 10.0
    role.last_count_s = 0.01  # a small table: every 5 s, as before
    assert role.interval_s(config) == INTERVAL_S
