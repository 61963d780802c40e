from __future__ import annotations

import dataclasses
import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

import msgspec
import pytest

from pgjobd.handler_api import (
    ArgsError,
    Discard,
    HandlerSpec,
    JobContext,
    JobOutcome,
    Retry,
    Snooze,
    handler_spec,
    job,
    validate_args,
)


class Welcome(msgspec.Struct):
    user_id: int
    locale: str = "en"
    at: datetime | None = None


def spec_of(fn: object) -> HandlerSpec:
    spec = handler_spec(fn)
    assert spec is not None
    return spec


def test_bare_decorator_takes_defaults_and_returns_the_function() -> None:
    async def send_welcome(args: Welcome, ctx: JobContext) -> None: ...

    decorated = job(send_welcome)
    assert decorated is send_welcome
    spec = spec_of(send_welcome)
    assert spec.kind == "send_welcome"
    assert spec.function is send_welcome
    assert spec.args_type is Welcome
    assert (spec.queue, spec.max_attempts, spec.timeout_s, spec.priority) == (None,) * 4
    assert spec.discard_on == ()
    assert spec.is_async and spec.takes_ctx
    assert spec.source == __file__


def test_decorator_with_options() -> None:
    @job(
        kind="email.welcome",
        queue="email",
        max_attempts=5,
        timeout="30s",
        priority=2,
        discard_on=(KeyError,),
    )
    def send(args: dict[str, int]) -> None: ...

    spec = spec_of(send)
    assert spec.kind == "email.welcome"
    assert (spec.queue, spec.max_attempts, spec.timeout_s, spec.priority) == ("email", 5, 30, 2)
    assert spec.discard_on == (KeyError,)
    assert not spec.is_async and not spec.takes_ctx
    assert spec.args_type == dict[str, int]


def test_empty_parentheses_and_other_timeout_forms() -> None:
    @job()
    def a(args: dict[str, Any]) -> None: ...

    @job(timeout=1.5, discard_on=ValueError)
    def b(args: dict[str, Any]) -> None: ...

    @job(timeout=timedelta(minutes=2))
    def c(args: dict[str, Any]) -> None: ...

    assert spec_of(a).kind == "a"
    assert spec_of(b).timeout_s == 1.5
    assert spec_of(b).discard_on == (ValueError,)
    assert spec_of(c).timeout_s == 120


@dataclasses.dataclass
class DataArgs:
    n: int


class DictArgs(TypedDict):
    n: int


@pytest.mark.parametrize("args_type", [Welcome, DataArgs, DictArgs, dict[str, Any]])
def test_supported_args_types(args_type: Any) -> None:
    def handler(args): ...  # type: ignore[no-untyped-def]

    handler.__annotations__ = {"args": args_type}
    assert spec_of(job(handler)).args_type == args_type


def test_missing_or_loose_annotation_means_a_dict() -> None:
    def plain(args, ctx): ...  # type: ignore[no-untyped-def]

    def loose(args: dict) -> None: ...  # type: ignore[type-arg]

    assert spec_of(job(plain)).args_type == dict[str, Any]
    assert spec_of(plain).takes_ctx
    assert spec_of(job(loose)).args_type == dict[str, Any]


def test_string_annotations_are_resolved() -> None:
    # This module uses `from __future__ import annotations`, so annotations are strings.
    def handler(args: Welcome) -> None: ...

    assert handler.__annotations__["args"] == "Welcome"
    assert spec_of(job(handler)).args_type is Welcome


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kind": "1bad"}, "invalid job kind '1bad'"),
        ({"kind": ""}, "invalid job kind ''"),
        ({"queue": "no spaces"}, "invalid queue name 'no spaces'"),
        ({"max_attempts": 0}, "max_attempts must be an int >= 1, not 0"),
        ({"max_attempts": True}, "max_attempts must be an int >= 1"),
        ({"priority": "high"}, "priority must be an int"),
        ({"timeout": 0}, "timeout must be more than 0"),
        ({"timeout": -1}, "timeout: expected a duration that is not negative"),
        ({"timeout": "soon"}, "timeout:"),
        ({"timeout": [1]}, "timeout: expected a duration"),
    ],
)
def test_invalid_options_name_the_function(options: dict[str, Any], message: str) -> None:
    def handler(args: dict[str, Any]) -> None: ...

    with pytest.raises(ValueError, match=r"^@job on \S*test_handler_api\.") as info:
        job(**options)(handler)
    assert message in str(info.value)
    assert "handler" in str(info.value)


def test_option_types() -> None:
    def handler(args: dict[str, Any]) -> None: ...

    with pytest.raises(TypeError, match="handler: kind must be a str, not 3"):
        job(kind=3)(handler)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="handler: queue must be a str"):
        job(queue=b"email")(handler)  # type: ignore[call-overload]

    with pytest.raises(TypeError, match="discard_on takes exception classes, not 'oops'"):
        job(discard_on=("oops",))(handler)  # type: ignore[arg-type]


def test_bad_signatures() -> None:
    def no_params() -> None: ...

    def three_required(args: dict[str, Any], ctx: JobContext, extra: int) -> None: ...

    def keyword_only(args: dict[str, Any], *, ctx: JobContext) -> None: ...

    def gen(args: dict[str, Any]):  # type: ignore[no-untyped-def]
        yield 1

    with pytest.raises(TypeError, match="no_params: a handler takes the job's args"):
        job(no_params)
    with pytest.raises(TypeError, match="parameter 'extra' needs a default"):
        job(three_required)
    with pytest.raises(TypeError, match="parameter 'ctx' needs a default"):
        job(keyword_only)
    with pytest.raises(TypeError, match="cannot be a generator"):
        job(gen)


def test_extra_parameters_with_defaults_are_allowed() -> None:
    def handler(args: dict[str, Any], ctx: JobContext, *, dry_run: bool = False) -> None: ...

    assert spec_of(job(handler)).takes_ctx


def test_args_type_must_be_an_object_type() -> None:
    def numbers(args: list[int]) -> None: ...

    def int_keys(args: dict[int, str]) -> None: ...

    with pytest.raises(TypeError, match=r"annotation list\[int\] is not an args type"):
        job(numbers)
    with pytest.raises(TypeError, match="is not an args type"):
        job(int_keys)


def test_unresolvable_annotation() -> None:
    def handler(args: NoSuchType) -> None: ...  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(TypeError, match="handler: cannot resolve its annotations"):
        job(handler)


def test_decorating_twice_is_an_error() -> None:
    def handler(args: dict[str, Any]) -> None: ...

    job(handler)
    with pytest.raises(TypeError, match="already a handler"):
        job(handler)


def test_validate_args_converts_like_json_decoding() -> None:
    @job
    def send_welcome(args: Welcome) -> None: ...

    spec = spec_of(send_welcome)
    converted = validate_args(spec, {"user_id": 7, "at": "2026-01-01T00:00:00Z"})
    assert converted == Welcome(user_id=7, at=datetime(2026, 1, 1, tzinfo=UTC))


def test_validate_args_error_names_kind_type_and_path() -> None:
    @job
    def send_welcome(args: Welcome) -> None: ...

    with pytest.raises(ArgsError) as info:
        validate_args(spec_of(send_welcome), {"user_id": "7"})
    assert str(info.value) == (
        "args for kind 'send_welcome' do not match Welcome: "
        "Expected `int`, got `str` - at `$.user_id`"
    )
    assert info.value.kind == "send_welcome"
    assert info.value.detail == "Expected `int`, got `str` - at `$.user_id`"
    assert isinstance(info.value, ValueError)


def test_validate_args_for_other_types() -> None:
    @job
    def counted(args: DataArgs) -> None: ...

    @job
    def typed(args: DictArgs) -> None: ...

    @job
    def anything(args: dict[str, Any]) -> None: ...

    assert validate_args(spec_of(counted), {"n": 1}) == DataArgs(n=1)
    assert validate_args(spec_of(typed), {"n": 1}) == {"n": 1}
    assert validate_args(spec_of(anything), {"a": [1]}) == {"a": [1]}
    with pytest.raises(ArgsError, match="do not match DataArgs: Object missing required field `n`"):
        validate_args(spec_of(counted), {})
    with pytest.raises(ArgsError, match=r"do not match dict\[str, Any\]: Expected `object`"):
        validate_args(spec_of(anything), [1])  # type: ignore[arg-type]


def test_outcomes() -> None:
    assert Retry().after_s is None
    assert Retry(after="10s").after_s == 10
    assert Retry(after=timedelta(seconds=3)).after_s == 3
    assert Snooze("5m").after_s == 300
    assert Snooze(0.5).after_s == 0.5
    assert Discard("bad input").reason == "bad input"
    assert str(Discard("bad input")) == "bad input"
    assert Discard().reason == ""
    for outcome in (Retry(), Snooze(1), Discard()):
        assert isinstance(outcome, JobOutcome)
        assert isinstance(outcome, Exception)
    with pytest.raises(ValueError, match="not negative"):
        Snooze(-1)
    with pytest.raises(TypeError):
        Snooze()  # type: ignore[call-arg]


def make_context(**overrides: Any) -> JobContext:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    fields: dict[str, Any] = {
        "id": 42,
        "kind": "send_welcome",
        "queue": "email",
        "attempt": 1,
        "max_attempts": 5,
        "tenant": None,
        "enqueued_at": now,
        "scheduled_at": now,
    }
    return JobContext(**(fields | overrides))


def test_context_fields_and_cancel_event() -> None:
    ctx = make_context()
    assert (ctx.id, ctx.kind, ctx.queue, ctx.attempt, ctx.max_attempts) == (
        42,
        "send_welcome",
        "email",
        1,
        5,
    )
    assert isinstance(ctx.cancelled, threading.Event)
    assert not ctx.cancelled.is_set()
    shared = threading.Event()
    assert make_context(cancelled=shared).cancelled is shared
    assert "attempt=1/5" in repr(ctx)


def test_context_logger_binds_the_job(caplog: pytest.LogCaptureFixture) -> None:
    ctx = make_context(attempt=2)
    with caplog.at_level(logging.INFO, logger="pgjobd.job"):
        ctx.logger.info("sent", extra={"user_id": 7})
    (record,) = caplog.records
    assert record.getMessage() == "sent"
    assert (record.job_id, record.kind, record.queue, record.attempt) == (  # type: ignore[attr-defined]
        42,
        "send_welcome",
        "email",
        2,
    )
    assert record.user_id == 7  # type: ignore[attr-defined]
