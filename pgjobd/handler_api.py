"""The handler API: the `job` decorator, the context a job runs with, and its outcomes."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import typing
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar, overload

import msgspec

from pgjobd.duration import to_timedelta
from pgjobd.errors import PgjobdError
from pgjobd.flow import (
    BREAKER_COOLDOWN_MIN_S,
    BREAKER_COOLDOWN_S,
    BREAKER_SPAN_MAX_S,
    RateLimit,
    parse_circuit_breaker,
    parse_rate_limit,
)
from pgjobd.names import kind_name_problem, queue_name_problem
from pgjobd.redact import check_fields

HANDLER_ATTRIBUTE = "__pgjobd_handler__"

F = TypeVar("F", bound=Callable[..., Any])

DurationLike = str | int | float | timedelta
# The args key that says which version of a handler's args a payload is (absent: 1).
# Stamped by a client that knows the handler; SQL producers write it themselves.
VERSION_KEY = "pgjobd:version"
Upgrader = Callable[[dict[str, Any]], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class HandlerSpec:
    """A handler as the `job` decorator registered it. None means "the queue's default"."""

    kind: str
    function: Callable[..., Any]
    args_type: Any
    queue: str | None
    max_attempts: int | None
    timeout_s: float | None
    priority: int | None
    discard_on: tuple[type[BaseException], ...]
    is_async: bool
    takes_ctx: bool
    source: str
    # Fleet-wide limits of the kind (contract §9), None: no limit.
    global_concurrency: int | None = None
    rate_limit: RateLimit | None = None
    # The kind's circuit breaker: so many failed attempts in the window open it for
    # breaker_cooldown_s (flow.parse_circuit_breaker). None: none.
    circuit_breaker: RateLimit | None = None
    breaker_cooldown_s: float | None = None
    redact: tuple[str, ...] = ()  # args fields kept out of logs and errors (redact.py)
    # The version of the args it expects, and how to upgrade older payloads: upgraders[v]
    # turns version v's args into version v + 1's.
    args_version: int = 1
    upgraders: Mapping[int, Upgrader] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """The function's dotted name, for messages."""
        return f"{self.function.__module__}.{self.function.__qualname__}"


def handler_spec(obj: object) -> HandlerSpec | None:
    """The spec the `job` decorator attached to obj, or None if it is not a handler."""
    spec = getattr(obj, HANDLER_ATTRIBUTE, None)
    return spec if isinstance(spec, HandlerSpec) else None


@overload
def job(function: F, /) -> F: ...


@overload
def job(
    *,
    kind: str | None = None,
    queue: str | None = None,
    max_attempts: int | None = None,
    timeout: DurationLike | None = None,
    priority: int | None = None,
    discard_on: type[BaseException] | tuple[type[BaseException], ...] = (),
    global_concurrency: int | None = None,
    rate_limit: str | None = None,
    circuit_breaker: str | None = None,
    breaker_cooldown: DurationLike | None = None,
    redact: Sequence[str] = (),
    args_version: int = 1,
    upgraders: Mapping[int, Upgrader] | None = None,
) -> Callable[[F], F]: ...


def job(
    function: F | None = None,
    /,
    *,
    kind: str | None = None,
    queue: str | None = None,
    max_attempts: int | None = None,
    timeout: DurationLike | None = None,
    priority: int | None = None,
    discard_on: type[BaseException] | tuple[type[BaseException], ...] = (),
    global_concurrency: int | None = None,
    rate_limit: str | None = None,
    circuit_breaker: str | None = None,
    breaker_cooldown: DurationLike | None = None,
    redact: Sequence[str] = (),
    args_version: int = 1,
    upgraders: Mapping[int, Upgrader] | None = None,
) -> F | Callable[[F], F]:
    """Register a function as the handler of a job kind (its name unless `kind` is given).

    Usable bare (`@job`) or with options. The function is returned unchanged, so it can
    still be called directly; its spec is attached as `__pgjobd_handler__`.
    `args_version`: the version of the args it expects; `upgraders[v]` turns version
    v's args (a dict) into version v + 1's, and runs before conversion. A payload newer
    than `args_version` is given back for a member that knows it (a rolling deploy).
    """

    def register(fn: F) -> F:
        spec = _build_spec(
            fn,
            kind=kind,
            queue=queue,
            max_attempts=max_attempts,
            timeout=timeout,
            priority=priority,
            discard_on=discard_on,
            global_concurrency=global_concurrency,
            rate_limit=rate_limit,
            circuit_breaker=circuit_breaker,
            breaker_cooldown=breaker_cooldown,
            redact=redact,
            args_version=args_version,
            upgraders=upgraders or {},
        )
        setattr(fn, HANDLER_ATTRIBUTE, spec)
        return fn

    if function is None:
        return register
    return register(function)


def _build_spec(
    fn: Callable[..., Any],
    *,
    kind: str | None,
    queue: str | None,
    max_attempts: int | None,
    timeout: DurationLike | None,
    priority: int | None,
    discard_on: type[BaseException] | tuple[type[BaseException], ...],
    global_concurrency: int | None = None,
    rate_limit: str | None = None,
    circuit_breaker: str | None = None,
    breaker_cooldown: DurationLike | None = None,
    redact: Sequence[str] = (),
    args_version: int = 1,
    upgraders: Mapping[int, Upgrader] | None = None,
) -> HandlerSpec:
    if not inspect.isfunction(fn):
        raise TypeError(f"@job decorates functions, not {fn!r}")
    where = f"@job on {fn.__module__}.{fn.__qualname__}"
    if handler_spec(fn) is not None:
        raise TypeError(f"{where}: the function is already a handler")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"{where}: a handler returns its result; it cannot be a generator")

    kind = fn.__name__ if kind is None else kind
    if not isinstance(kind, str):
        raise TypeError(f"{where}: kind must be a str, not {kind!r}")
    if problem := kind_name_problem(kind):
        raise ValueError(f"{where}: {problem}")
    if queue is not None and not isinstance(queue, str):
        raise TypeError(f"{where}: queue must be a str, not {queue!r}")
    if queue is not None and (problem := queue_name_problem(queue)):
        raise ValueError(f"{where}: {problem}")
    if max_attempts is not None and (not _is_int(max_attempts) or max_attempts < 1):
        raise ValueError(f"{where}: max_attempts must be an int >= 1, not {max_attempts!r}")
    if priority is not None and not _is_int(priority):
        raise ValueError(f"{where}: priority must be an int, not {priority!r}")
    timeout_s = None
    if timeout is not None:
        try:
            timeout_s = to_seconds(timeout)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: timeout: {e}") from None
        if timeout_s <= 0:
            raise ValueError(f"{where}: timeout must be more than 0, not {timeout!r}")
    if global_concurrency is not None and not (
        _is_int(global_concurrency) and 1 <= global_concurrency <= 2**31 - 1
    ):
        raise ValueError(
            f"{where}: global_concurrency must be an int >= 1, not {global_concurrency!r}"
        )
    rate = None
    if rate_limit is not None:
        try:
            rate = parse_rate_limit(rate_limit)
        except ValueError as e:
            raise ValueError(f"{where}: rate_limit: {e}") from None
    breaker, cooldown_s = _breaker(f"{where} (kind {kind})", circuit_breaker, breaker_cooldown)
    discard_on = discard_on if isinstance(discard_on, tuple) else (discard_on,)
    for exc_type in discard_on:
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            raise TypeError(f"{where}: discard_on takes exception classes, not {exc_type!r}")

    if not _is_int(args_version) or args_version < 1:
        raise ValueError(f"{where}: args_version must be an int >= 1, not {args_version!r}")
    upgraders = dict(upgraders or {})
    for version, upgrade in upgraders.items():
        if not _is_int(version) or not 1 <= version < args_version:
            raise ValueError(f"{where}: upgraders are keyed by the version they upgrade "
                             f"from, 1 to {args_version - 1}, not {version!r}")  # fmt: skip
        if not callable(upgrade):
            raise TypeError(f"{where}: the upgrader from version {version} is not callable")

    args_type, takes_ctx = _inspect_parameters(fn, where)
    return HandlerSpec(
        kind=kind,
        function=fn,
        args_type=args_type,
        queue=queue,
        max_attempts=max_attempts,
        timeout_s=timeout_s,
        priority=priority,
        discard_on=discard_on,
        is_async=inspect.iscoroutinefunction(fn),
        takes_ctx=takes_ctx,
        source=inspect.unwrap(fn).__code__.co_filename,
        global_concurrency=global_concurrency,
        rate_limit=rate,
        circuit_breaker=breaker,
        breaker_cooldown_s=cooldown_s,
        redact=check_fields(redact, where),
        args_version=args_version,
        upgraders=upgraders,
    )


def _breaker(
    where: str, circuit_breaker: object, cooldown: object
) -> tuple[RateLimit | None, float | None]:
    """The failures "N/DURATION" and the cool-down (s) of a kind's circuit breaker."""
    if circuit_breaker is None:
        if cooldown is not None:
            raise ValueError(f"{where}: breaker_cooldown needs a circuit_breaker "
                             f'(like circuit_breaker="5/1m")')  # fmt: skip
        return None, None
    try:
        breaker = parse_circuit_breaker(circuit_breaker)
    except ValueError as e:
        raise ValueError(f"{where}: circuit_breaker: {e}") from None
    if cooldown is None:
        return breaker, BREAKER_COOLDOWN_S
    try:
        cooldown_s = to_seconds(cooldown)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: breaker_cooldown: {e}") from None
    if not BREAKER_COOLDOWN_MIN_S <= cooldown_s <= BREAKER_SPAN_MAX_S:
        raise ValueError(f'{where}: breaker_cooldown must be from "1s" to "1d", not {cooldown!r}')
    return breaker, cooldown_s


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _inspect_parameters(fn: Callable[..., Any], where: str) -> tuple[Any, bool]:
    """The args type (the first parameter's annotation) and whether fn takes a ctx."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    if not positional:
        raise TypeError(f"{where}: a handler takes the job's args as its first parameter")
    takes_ctx = len(positional) >= 2
    # The worker calls fn(args) or fn(args, ctx); anything else must have a default.
    for extra in params[2 if takes_ctx else 1 :]:
        required = extra.default is inspect.Parameter.empty
        if required and extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD):
            raise TypeError(
                f"{where}: a handler takes (args) or (args, ctx); "
                f"parameter {extra.name!r} needs a default"
            )
    try:
        # Resolves string annotations (`from __future__ import annotations`).
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise TypeError(f"{where}: cannot resolve its annotations: {e}") from None
    annotation = hints.get(positional[0].name, dict[str, Any])
    return _checked_args_type(annotation, where), takes_ctx


def _checked_args_type(annotation: Any, where: str) -> Any:
    """Args are a JSON object, so the args type must be something a JSON object becomes."""
    if annotation is Any or annotation is dict:
        return dict[str, Any]
    if typing.get_origin(annotation) is dict:
        key_type = typing.get_args(annotation)[0]
        if key_type in (str, Any):
            return annotation
    elif isinstance(annotation, type) and (
        issubclass(annotation, msgspec.Struct)
        or dataclasses.is_dataclass(annotation)
        or typing.is_typeddict(annotation)
    ):
        return annotation
    raise TypeError(
        f"{where}: the first parameter's annotation {_type_name(annotation)} is not an args "
        "type: use a msgspec.Struct, a dataclass, a TypedDict or dict[str, ...]"
    )


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__qualname__
    return repr(tp).replace("typing.", "")


def to_seconds(value: DurationLike) -> float:
    """A duration string ("30s"), a number of seconds or a timedelta, as seconds (>= 0)."""
    seconds = to_timedelta(value).total_seconds()
    if seconds < 0:
        raise ValueError(f"expected a duration that is not negative, got {value!r}")
    return seconds


class ArgsError(PgjobdError, ValueError):
    """A job's args do not convert to its handler's args type.

    The client reports it as an EnqueueError; the worker marks the job dead (invalid_args).
    """

    def __init__(self, kind: str, type_name: str, detail: str) -> None:
        super().__init__(f"args for kind {kind!r} do not match {type_name}: {detail}")
        self.kind = kind
        self.type_name = type_name
        self.detail = detail


def validate_args(spec: HandlerSpec, args: Mapping[str, Any]) -> object:
    """Convert JSON-decoded args into the handler's args type, or raise ArgsError.

    Conversion is strict, as decoding the JSON text straight into the type would be:
    "7" does not become 7, but an ISO 8601 string does become a datetime.
    """
    try:
        return msgspec.convert(args, spec.args_type)
    except msgspec.ValidationError as e:
        raise ArgsError(spec.kind, _type_name(spec.args_type), str(e)) from None


class NewerArgs(PgjobdError):
    """A payload of a newer args version than the handler knows: given back, so that a
    member running the newer handler takes it."""

    def __init__(self, kind: str, version: int, known: int) -> None:
        super().__init__(f"args of kind {kind!r} are version {version}, newer than this "
                         f"handler's {known}: given back for a member that knows it")  # fmt: skip
        self.version = version


def upgraded(spec: HandlerSpec, args: dict[str, Any]) -> dict[str, Any]:
    """The args at the handler's version: the version key removed, older payloads run
    through the upgraders. NewerArgs for a payload newer than the handler; ArgsError for
    a version that is not an int >= 1, or one with no upgrader."""
    version = args.pop(VERSION_KEY, 1)
    if not _is_int(version) or version < 1:
        raise ArgsError(spec.kind, _type_name(spec.args_type),
                        f"{VERSION_KEY} must be an int >= 1, got {version!r}")  # fmt: skip
    if version > spec.args_version:
        raise NewerArgs(spec.kind, version, spec.args_version)
    while version < spec.args_version:
        upgrade = spec.upgraders.get(version)
        if upgrade is None:
            raise ArgsError(spec.kind, _type_name(spec.args_type),
                            f"no upgrader from args version {version}")  # fmt: skip
        args = upgrade(args)
        if not isinstance(args, dict):
            raise TypeError(f"the upgrader of {spec.kind!r} from version {version} "
                            f"returned {type(args).__name__}, not a dict")  # fmt: skip
        version += 1
    return args


class JobOutcome(Exception):
    """Base of the exceptions a handler raises to choose what happens to its job."""


class Retry(JobOutcome):
    """Fail this attempt and run the job again `after` from now (or after the usual backoff).

    The attempt counts towards max_attempts.
    """

    def __init__(self, after: DurationLike | None = None) -> None:
        self.after_s = None if after is None else to_seconds(after)
        super().__init__(f"retry after {self.after_s}s" if after is not None else "retry")


class Snooze(JobOutcome):
    """Put the job back to run `after` from now; the attempt is not counted."""

    def __init__(self, after: DurationLike) -> None:
        self.after_s = to_seconds(after)
        super().__init__(f"snooze for {self.after_s}s")


class Discard(JobOutcome):
    """Give up on the job now: it goes to dead with no more attempts."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        super().__init__(reason)


class JobLogger(logging.LoggerAdapter[logging.Logger]):
    """Adds the job's fields to each record, keeping any `extra` the handler passes too."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


class ResultsUnavailable(PgjobdError):
    """ctx.results() could not be read (the member could not reach the database)."""


class BatchCounts(NamedTuple):
    """How the jobs a batch callback waited for ended (`JobContext.batch`)."""

    completed: int
    failed: int  # dead or cancelled


class JobContext:
    """What a running job knows about itself; the optional second handler parameter.

    `cancelled` is a threading.Event so that both thread (def) and async handlers can
    check it: it is set when the job is cancelled or its lease is lost.
    `dependencies`: the ids it waited for (depends_on, then after); `await results()`
    gives their results, `{id: result}` (None for one that returned nothing; an id
    whose queue keeps no final records is missing). `batch`: for a job that waited
    with `after` (a batch's callback), how those jobs ended; else None.
    """

    __slots__ = (
        "_results",
        "attempt",
        "batch",
        "cancelled",
        "dependencies",
        "enqueued_at",
        "id",
        "kind",
        "logger",
        "max_attempts",
        "queue",
        "scheduled_at",
        "tenant",
    )

    def __init__(
        self,
        *,
        id: int,
        kind: str,
        queue: str,
        attempt: int,
        max_attempts: int,
        tenant: str | None,
        enqueued_at: datetime,
        scheduled_at: datetime,
        cancelled: threading.Event | None = None,
        logger: logging.Logger | None = None,
        dependencies: Sequence[int] = (),
        results: Mapping[int, Any] | Callable[[], Awaitable[Mapping[int, Any]]] | None = None,
        batch: BatchCounts | None = None,
    ) -> None:
        self.id = id
        self.dependencies = list(dependencies)
        # The results, or how to read them (once, when first asked for).
        self._results = results
        self.batch = batch
        self.kind = kind
        self.queue = queue
        self.attempt = attempt
        self.max_attempts = max_attempts
        self.tenant = tenant
        self.enqueued_at = enqueued_at
        self.scheduled_at = scheduled_at
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self.logger = JobLogger(
            logger or logging.getLogger("pgjobd.job"),
            {"job_id": id, "kind": kind, "queue": queue, "attempt": attempt},
        )

    async def results(self) -> dict[int, Any]:
        """The results of the jobs it waited for, `{id: result}`. In a worker they are
        read when first asked for, by the member (the worker has no database session):
        a job that never asks costs nothing."""
        if callable(self._results):
            self._results = await self._results()
        return dict(self._results or {})

    def __repr__(self) -> str:
        return (
            f"JobContext(id={self.id}, kind={self.kind!r}, queue={self.queue!r}, "
            f"attempt={self.attempt}/{self.max_attempts})"
        )
