"""Rate limits as written in TOML and in @job: "N/DURATION"; a kind's circuit breaker."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd import job
from pgjobd.config import loads
from pgjobd.errors import ConfigError
from pgjobd.flow import (
    BREAKER_COOLDOWN_MIN_S,
    BREAKER_COOLDOWN_S,
    BREAKER_SPAN_MAX_S,
    MAX_RATE,
    RateLimit,
    parse_circuit_breaker,
    parse_rate_limit,
)
from pgjobd.handler_api import _build_spec, handler_spec
from pgjobd.worker import kind_info


def test_rate_limits_parse() -> None:
    assert parse_rate_limit("100/1s") == RateLimit(100, timedelta(seconds=1))
    assert parse_rate_limit("600/1m") == RateLimit(600, timedelta(minutes=1))
    assert parse_rate_limit(" 5 / 250ms ") == RateLimit(5, timedelta(milliseconds=250))
    assert str(RateLimit(600, timedelta(minutes=1))) == "600/1m"


@pytest.mark.parametrize(
    "text", ["", "100", "/1s", "100/", "-1/1s", "0/1s", f"{MAX_RATE + 1}/1s", "1/0s", "x/1s",
             "1/1 parsec", "1.5/1s"],
)  # fmt: skip
def test_bad_rate_limits_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match='expected "N/DURATION"'):
        parse_rate_limit(text)


@given(st.text(max_size=30))
def test_any_text_is_a_rate_limit_or_a_clear_error(text: str) -> None:
    try:
        rate = parse_rate_limit(text)
    except ValueError as e:
        assert 'expected "N/DURATION"' in str(e)
    else:
        assert 1 <= rate.starts <= MAX_RATE and rate.window > timedelta(0)
        assert parse_rate_limit(str(rate)) == rate


@given(st.integers(1, MAX_RATE), st.integers(1, 10**9))
def test_written_rate_limits_read_back(starts: int, window_ms: int) -> None:
    rate = RateLimit(starts, timedelta(milliseconds=window_ms))
    assert parse_rate_limit(str(rate)) == rate


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"x.toml: queues.api.rate_limit: expected \"N/DUR"):
        loads('[queues.api]\nrate_limit = "fast"\n', Path("x.toml"))
    with pytest.raises(
        ConfigError, match=r"queues\.api\.global_concurrency: expected an integer >= 1"
    ):
        loads("[queues.api]\nglobal_concurrency = 0\n", Path("x.toml"))
    with pytest.raises(ConfigError, match=r"queues\.api\.max_depth: expected an integer >= 1"):
        loads("[queues.api]\nmax_depth = -5\n", Path("x.toml"))


def test_job_declares_kind_limits() -> None:
    @job(global_concurrency=3, rate_limit="10/1s")
    def limited(args: dict[str, object]) -> None: ...

    spec = handler_spec(limited)
    assert spec is not None
    assert (spec.global_concurrency, spec.rate_limit) == (3, RateLimit(10, timedelta(seconds=1)))
    with pytest.raises(ValueError, match="global_concurrency must be an int >= 1"):

        @job(global_concurrency=0)
        def none_at_all(args: dict[str, object]) -> None: ...

    with pytest.raises(ValueError, match='rate_limit: expected "N/DURATION"'):

        @job(rate_limit="lots")
        def too_fast(args: dict[str, object]) -> None: ...


def test_the_flow_lock_purpose_is_the_one_the_sql_uses() -> None:
    from importlib import resources  # noqa: PLC0415

    from pgjobd.lock_keys import FLOW  # noqa: PLC0415

    migrations = resources.files("pgjobd").joinpath("sql", "migrations")
    texts = [m.read_text("utf-8") for m in migrations.iterdir() if m.name.endswith(".sql")]
    (defining,) = [t for t in texts if "FUNCTION {{schema}}.flow_lock(" in t]
    assert f"pg_advisory_xact_lock({FLOW}," in defining


def test_job_declares_a_circuit_breaker() -> None:
    @job(circuit_breaker="5/1m", breaker_cooldown="45s")
    def flaky(args: dict[str, object]) -> None: ...

    @job(circuit_breaker="2/10s")
    def defaulted(args: dict[str, object]) -> None: ...

    with pytest.raises(ValueError, match=r"\.broken \(kind payments\): circuit_breaker: expected"):

        @job(kind="payments", circuit_breaker="5 per minute")
        def broken(args: dict[str, object]) -> None: ...

    with pytest.raises(ValueError, match=r"\(kind slow\): breaker_cooldown must be from"):

        @job(kind="slow", circuit_breaker="5/1m", breaker_cooldown="2d")
        def slow(args: dict[str, object]) -> None: ...

    spec, other = handler_spec(flaky), handler_spec(defaulted)
    assert spec is not None and other is not None
    assert (spec.circuit_breaker, spec.breaker_cooldown_s) == (
        RateLimit(5, timedelta(minutes=1)), 45.0)  # fmt: skip
    assert other.breaker_cooldown_s == BREAKER_COOLDOWN_S
    assert kind_info(spec).circuit_breaker == "5/1m"
    assert parse_circuit_breaker(kind_info(spec).circuit_breaker) == spec.circuit_breaker


_GOOD_COOLDOWN = st.one_of(
    st.floats(BREAKER_COOLDOWN_MIN_S, BREAKER_SPAN_MAX_S),
    st.integers(1, int(BREAKER_SPAN_MAX_S)).map(lambda s: f"{s}s"),
)
_ANY_VALUE = st.one_of(
    st.none(), st.text(max_size=12), st.integers(-10, 10**6), st.booleans(),
    st.integers(-(2**70), 2**70),  # past int64 both ways
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
        ["5/1m", "0/1m", "1/0s", "1/500ms", "3/2d", "1/1d", "100001/1s", "", "\x00", "5/1m ",
         "1s", "30s", "0s", "1d", "25h", "-1s", "nan", "inf", "-5/1m", "5/inf",
         "9223372036854775808/1s", "1/9223372036854775808s", "1/99999999999999999999d",
         "5/1m\x00", "9" * 10_000 + "/1s", 2**63, -(2**63) - 1]),
    _GOOD_COOLDOWN,
)  # fmt: skip


@given(breaker=_ANY_VALUE, cooldown=_ANY_VALUE)
def test_any_breaker_declaration_is_taken_in_bounds_or_refused_naming_kind_and_key(
    breaker: object, cooldown: object
) -> None:
    def flaky(args: dict[str, object]) -> None: ...

    try:
        spec = _build_spec(flaky, kind="flaky", queue=None, max_attempts=None, timeout=None,
                           priority=None, discard_on=(), circuit_breaker=breaker,  # type: ignore[arg-type]
                           breaker_cooldown=cooldown)  # type: ignore[arg-type]  # fmt: skip
    except ValueError as e:
        message = str(e)
        assert message.startswith("@job on ") and ".flaky (kind flaky): " in message
        try:
            parse_circuit_breaker(breaker)
        except ValueError:
            key = "breaker_cooldown" if breaker is None else "circuit_breaker"
        else:
            key = "breaker_cooldown"
        assert f"(kind flaky): {key}" in message, message
    else:
        if breaker is None:
            assert cooldown is None and spec.circuit_breaker is None
            assert spec.breaker_cooldown_s is None
        else:
            rate = spec.circuit_breaker
            assert rate is not None and 1 <= rate.starts <= MAX_RATE
            assert BREAKER_COOLDOWN_MIN_S <= rate.window.total_seconds() <= BREAKER_SPAN_MAX_S
            assert spec.breaker_cooldown_s is not None
            assert BREAKER_COOLDOWN_MIN_S <= spec.breaker_cooldown_s <= BREAKER_SPAN_MAX_S
