"""The TOML configuration: where it is found, what it may say, and the DSN overrides.

Typical use (what every command does):

    path = resolve_config_path(args.config, os.environ)
    config = apply_overrides(load(path), dsn=args.dsn, schema=args.schema, environ=os.environ)
    dsn = config.require_dsn()          # only for commands that talk to the database

Every problem is a ConfigError whose message starts with the file and the key path in
TOML terms, e.g. `pgjobd.toml: queues.email.concurrency: expected an integer >= 1, got 0`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from croniter import CroniterError, croniter

from pgjobd.cron_schedule import CatchUp
from pgjobd.duration import EXAMPLES as DURATION_EXAMPLES
from pgjobd.duration import Duration, parse_duration
from pgjobd.errors import ConfigError
from pgjobd.flow import RateLimit, parse_rate_limit
from pgjobd.middleware import name_problem as middleware_name_problem
from pgjobd.names import (
    MAX_TENANT_BYTES,
    kind_name_problem,
    queue_name_problem,
    schema_name_problem,
    text_problem,
)
from pgjobd.protocol import CpuScheduling

DEFAULT_QUEUE = "default"
# Searched in this order when neither --config nor $PGJOBD_CONFIG names a file.
SEARCH_PATHS: tuple[Path, ...] = (Path("pgjobd.toml"), Path("/etc/pgjobd/pgjobd.toml"))
# Contract §6: args whose JSON text is over 64 KiB are refused at enqueue: by the client
# before a round trip, and by the SQL function job_problem (migration 0005) for every
# caller (tests/integration/test_enqueue.py holds the two to the same bound).
MAX_ARGS_BYTES = 64 * 1024
INT32_MAX = 2**31 - 1
# [tenants] weights (the table tenant_weight holds the same bounds).
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 1, 10_000
CRON_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}")
CRON_ALIASES = frozenset(
    {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
)

LogFormat = Literal["json", "text"]
# What sits between the pool's connections and PostgreSQL: "none" (a direct connection),
# or a PgBouncer-style pooler in "session" or "transaction" pool mode.
Pooler = Literal["none", "session", "transaction"]
LogLevel = Literal["debug", "info", "warning", "error"]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


class FieldProblem(ValueError):
    """Raised by a __post_init__ check: `field` is the key it is about, `within` the path
    from there to a nested value (for args)."""

    def __init__(self, field: str, message: str, *, within: Sequence[str | int] = ()) -> None:
        super().__init__(f"{field}: {message}")
        self.steps: tuple[str | int, ...] = (field, *within)
        self.message = message


def session_timeout_problem(value: timedelta) -> str | None:
    """Why PostgreSQL would refuse `value` as a session's statement_timeout or
    idle_in_transaction_session_timeout (whole milliseconds, 1 to 2^31 - 1; 0 would turn
    the limit off, which every pgjobd session must have), or None."""
    ms = int(value.total_seconds() * 1000)
    if ms < 1:
        return f'must be at least "1ms" (every session has a limit), got {value}'
    if ms > INT32_MAX:
        return f"must be at most {INT32_MAX} ms (about 24.8 days, PostgreSQL's limit), got {value}"
    return None


class DatabaseConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    dsn: NonEmptyStr | None = None
    dsn_file: Path | None = None
    # A direct session for the leader's advisory lock when `dsn` goes through a
    # transaction-pooling proxy (PgBouncer), where session locks do not hold.
    leader_dsn: NonEmptyStr | None = None
    # What `dsn` goes through (docs/operations.md, "PgBouncer and other poolers").
    pooler: Pooler = "none"
    schema: str = "pgjobd"
    pool_min: Annotated[int, msgspec.Meta(ge=0, le=1_000)] = 2
    pool_max: Annotated[int, msgspec.Meta(ge=1, le=1_000)] = 10
    statement_timeout: Duration = Duration(seconds=30)
    idle_in_transaction_session_timeout: Duration = Duration(seconds=60)
    connect_timeout: Duration = Duration(seconds=10)
    # How long a starting member waits for the database (or the pooler in front of it)
    # to answer before it exits 1: one restarted while PgBouncer or PostgreSQL restarts
    # waits for it.
    start_wait: Duration = Duration(seconds=30)

    def __post_init__(self) -> None:
        if self.dsn is not None and self.dsn_file is not None:
            raise FieldProblem("dsn_file", "set database.dsn or database.dsn_file, not both")
        problem = schema_name_problem(self.schema)
        if problem:
            raise FieldProblem("schema", problem)
        if self.pool_max < self.pool_min:
            raise FieldProblem(
                "pool_max", f"must be at least pool_min ({self.pool_min}), got {self.pool_max}"
            )
        for name in ("statement_timeout", "idle_in_transaction_session_timeout"):
            if problem := session_timeout_problem(getattr(self, name)):
                raise FieldProblem(name, problem)
        if self.connect_timeout <= Duration(0):
            raise FieldProblem("connect_timeout", 'must be more than "0s"')
        if self.start_wait > MAX_START_WAIT:
            raise FieldProblem(
                "start_wait", f'must be at most "{MAX_START_WAIT}", got "{self.start_wait}"'
            )
        if self.pooler == "transaction" and self.leader_dsn is None:
            raise FieldProblem(
                "leader_dsn",
                'required with pooler = "transaction": the leader\'s advisory lock and the '
                "LISTEN session need a session that lasts, so point leader_dsn straight at "
                "PostgreSQL (or at a session-mode pool)",
            )


class DaemonConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    handlers: tuple[Path, ...] = (Path("handlers"),)
    drain_timeout: Duration = Duration(seconds=30)
    lease: Duration = Duration(seconds=30)
    metrics_listen: str = "127.0.0.1:9464"
    log_format: LogFormat = "json"
    log_level: LogLevel = "info"
    # "module:callable" names, outermost first (pgjobd.middleware), imported by workers.
    middleware: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for index, name in enumerate(self.middleware):
            if problem := middleware_name_problem(name):
                raise FieldProblem("middleware", problem, within=(index,))
        if self.lease < Duration(seconds=1):
            raise FieldProblem("lease", f'must be at least "1s", got "{self.lease}"')
        if self.metrics_listen:
            _parse_listen(self.metrics_listen)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) to serve /metrics on, or None when metrics_listen is ""."""
        return _parse_listen(self.metrics_listen) if self.metrics_listen else None


def _parse_listen(listen: str, field: str = "metrics_listen") -> tuple[str, int]:
    # An empty host ("":9464") listens on every interface; IPv6 hosts go in brackets.
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})", listen) or re.fullmatch(
        r"([^:\[\]\s]*):(\d{1,5})", listen
    )
    if match is None:
        none = ', or "" for no metrics server' if field == "metrics_listen" else ""
        raise FieldProblem(
            field,
            f'expected "host:port" (like "127.0.0.1:9464" or "[::1]:9464"){none}, '
            f"got {_quote(listen)}",
        )
    host, port = match.group(1), int(match.group(2))
    if port > 65535:
        raise FieldProblem(field, f"port must be 0-65535, got {port}")
    return host, port


_SIZE = re.compile(r"(\d+)\s*(kB|MB|GB)")
_SIZE_UNITS = {"kB": 1024, "MB": 1024**2, "GB": 1024**3}


def parse_size(text: str) -> int:
    """Bytes in a size like "512MB" (kB, MB, GB are powers of 1024, as in PostgreSQL);
    "" and "0" mean no limit (0)."""
    if text in ("", "0"):
        return 0
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f'expected a size like "512MB" or "2GB" (kB, MB, GB), got {text!r}')
    return int(match[1]) * _SIZE_UNITS[match[2]]


MAX_START_WAIT = Duration(hours=1)
MIN_PRIORITY_AGING = Duration(seconds=1)
MAX_PRIORITY_AGING = Duration(days=1)


class QueueConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 20
    processes: Annotated[int, msgspec.Meta(ge=1, le=1_000)] = 2
    timeout: Duration = Duration(minutes=5)
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] = 20
    backoff_base: Duration = Duration(seconds=1)
    backoff_max: Duration = Duration(hours=1)
    max_crashes: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] = 3
    history: Literal["all", "failures", "none"] = "all"
    # Priority aging (the leader's priority_ager role): every this long, the oldest
    # waiting jobs of each priority below the queue's top one move up one step, so a
    # steady stream of high-priority jobs cannot starve the rest. None: off.
    priority_aging: Duration | None = None
    # A worker process that ran this many jobs (0: no limit), or grew past this much
    # resident memory ("" or "0": no limit), finishes its jobs and is replaced.
    max_jobs_per_process: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] = 0
    max_rss: str = ""
    # The worker processes' Linux scheduling policy (systemd's CPUSchedulingPolicy=
    # names): "batch" keeps a worker woken by a hand-over from preempting the supervisor
    # that is still handing over (docs/decisions.md, "Workers run as batch work").
    cpu_scheduling: CpuScheduling = "batch"
    # Fleet-wide flow control (contract §9), stored in the queue table when a member
    # starts or reloads: the last writer wins. None: no limit.
    global_concurrency: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] | None = None
    rate_limit: str | None = None  # "N/DURATION"
    max_depth: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] | None = None
    # Running jobs per tenant in this queue, whole fleet; `fair`: the queue's starts are
    # shared across its waiting tenants by their [tenants] weight.
    tenant_concurrency: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] | None = None
    fair: bool = False

    @property
    def max_rss_bytes(self) -> int:
        return parse_size(self.max_rss)

    @property
    def rate(self) -> RateLimit | None:
        return None if self.rate_limit is None else parse_rate_limit(self.rate_limit)

    def __post_init__(self) -> None:
        try:
            parse_size(self.max_rss)
        except ValueError as e:
            raise FieldProblem("max_rss", str(e)) from None
        if self.priority_aging is not None and not (
            MIN_PRIORITY_AGING <= self.priority_aging <= MAX_PRIORITY_AGING
        ):
            raise FieldProblem(
                "priority_aging",
                f'must be from "{MIN_PRIORITY_AGING}" to "{MAX_PRIORITY_AGING}", '
                f'got "{self.priority_aging}"',
            )
        if self.rate_limit is not None:
            try:
                parse_rate_limit(self.rate_limit)
            except ValueError as e:
                raise FieldProblem("rate_limit", str(e)) from None
        if self.processes > self.concurrency:
            raise FieldProblem(
                "processes",
                f"must not exceed concurrency ({self.concurrency}), got {self.processes}: "
                "each worker process needs at least one job slot",
            )
        if self.timeout <= Duration(0):
            raise FieldProblem("timeout", 'must be more than "0s"')
        if self.backoff_max < self.backoff_base:
            raise FieldProblem(
                "backoff_max",
                f'must be at least backoff_base ("{self.backoff_base}"), got "{self.backoff_max}"',
            )


class CronEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str
    schedule: str
    kind: str
    timezone: str = "UTC"
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    queue: str | None = None
    catch_up: CatchUp = "latest"
    # With catch_up = "all": at most this many missed slots are enqueued, the latest ones.
    catch_up_limit: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100

    def __post_init__(self) -> None:
        if not CRON_NAME.fullmatch(self.name):
            raise FieldProblem(
                "name",
                f"invalid cron name {_quote(self.name)}: expected 1-128 characters of "
                "letters, digits, '_', '.', ':' and '-', starting with a letter, digit or '_'",
            )
        _check_schedule(self.schedule)
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            raise FieldProblem(
                "timezone",
                f'unknown time zone {_quote(self.timezone)}: expected an IANA name like "UTC" '
                'or "Europe/Berlin"',
            ) from None
        problem = kind_name_problem(self.kind)
        if problem:
            raise FieldProblem("kind", problem)
        if self.queue is not None:
            problem = queue_name_problem(self.queue)
            if problem:
                raise FieldProblem("queue", problem)
        _check_json_args(self.args)

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


def _check_schedule(schedule: str) -> None:
    fields = schedule.split()
    is_alias = len(fields) == 1 and fields[0] in CRON_ALIASES
    if not is_alias and len(fields) != 5:
        raise FieldProblem(
            "schedule",
            "expected 5 fields (minute hour day-of-month month day-of-week) or one of "
            f"{', '.join(sorted(CRON_ALIASES))}, got {_quote(schedule)}",
        )
    try:
        croniter(schedule, datetime(2000, 1, 1, tzinfo=UTC)).get_next(datetime)
    except CroniterError as error:
        reason = "it never fires" if "find next date" in str(error) else str(error)
        raise FieldProblem(
            "schedule", f"invalid cron schedule {_quote(schedule)}: {reason}"
        ) from None


def _check_json_args(args: dict[str, Any]) -> None:
    def walk(value: Any, within: tuple[str | int, ...]) -> None:
        if isinstance(value, datetime | date | time):
            raise FieldProblem(
                "args", "TOML dates and times are not JSON; write it as a string", within=within
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise FieldProblem("args", f"{value} is not a JSON number", within=within)
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, (*within, key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, (*within, index))

    walk(args, ())
    size = len(msgspec.json.encode(args))
    if size > MAX_ARGS_BYTES:
        raise FieldProblem("args", f"JSON text is {size} bytes, more than {MAX_ARGS_BYTES}")


def _default_queues() -> dict[str, QueueConfig]:
    return {DEFAULT_QUEUE: QueueConfig()}


class RetentionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Whole days of job_history / job_attempt partitions to keep; older ones are dropped.
    history: Duration = Duration(days=7)

    def __post_init__(self) -> None:
        if self.history < Duration(days=1):
            raise FieldProblem("history", 'must be at least "1d": partitions are whole days')


class WebConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`pgjobd web`: where the console listens, and the file holding the bearer token
    that allows actions (read when the console starts; none: the console is read-only)."""

    listen: str = "127.0.0.1:9470"
    admin_token_file: Path | None = None
    # How often the pages' live regions are read again.
    refresh: Duration = Duration(seconds=5)

    def __post_init__(self) -> None:
        _parse_listen(self.listen, "listen")
        if self.refresh < Duration(seconds=1):
            raise FieldProblem("refresh", f'must be at least "1s", got "{self.refresh}"')

    @property
    def address(self) -> tuple[str, int]:
        return _parse_listen(self.listen, "listen")


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A whole configuration, with relative paths resolved against the file's directory.

    `queues` always holds "default" (jobs of kinds nobody declared go there), configured
    or not. `dsn` is the DSN to connect with once dsn_file is read and apply_overrides
    has run; `dsn_source` says where it came from ("--dsn", "$PGJOBD_DSN", ...).
    """

    database: DatabaseConfig = msgspec.field(default_factory=DatabaseConfig)
    daemon: DaemonConfig = msgspec.field(default_factory=DaemonConfig)
    queues: dict[str, QueueConfig] = msgspec.field(default_factory=_default_queues)
    cron: tuple[CronEntry, ...] = ()
    retention: RetentionConfig = msgspec.field(default_factory=RetentionConfig)
    web: WebConfig = msgspec.field(default_factory=WebConfig)
    # [tenants]: weights for fair queues (an unlisted tenant weighs 1); None: no table.
    tenants: dict[str, int] | None = None
    source: Path | None = None
    dsn: str | None = None
    dsn_source: str | None = None

    def require_dsn(self) -> str:
        if self.dsn is None:
            where = f"in {self.source}" if self.source else "in a config file"
            raise ConfigError(
                "no database DSN: pass --dsn, set $PGJOBD_DSN or $DATABASE_URL, or set "
                f"database.dsn or database.dsn_file {where}"
            )
        return self.dsn

    def require_leader_dsn(self) -> str:
        """The DSN for the sessions that must not go through a transaction pooler (the
        leader's lock, LISTEN): database.leader_dsn, else the main DSN."""
        return self.database.leader_dsn or self.require_dsn()


def resolve_config_path(
    explicit: str | None,
    environ: Mapping[str, str],
    *,
    search: Sequence[Path] = SEARCH_PATHS,
) -> Path | None:
    """The config file to read: --config, $PGJOBD_CONFIG, then the first of `search` that
    exists; None when there is none (the built-in defaults apply).

    A file named by --config or $PGJOBD_CONFIG is returned even if missing, so that
    load() reports it rather than silently running on defaults.
    """
    if explicit is not None:
        return Path(explicit)
    from_environ = environ.get("PGJOBD_CONFIG")
    if from_environ:
        return Path(from_environ)
    for candidate in search:
        if candidate.is_file():
            return candidate
    return None


def load(path: Path | str | None) -> Config:
    """Read and check a config file; None gives the defaults (paths relative to the cwd)."""
    if path is None:
        return _resolve_paths(Config(), Path.cwd())
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{path}: cannot read config file: {_os_reason(error)}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: cannot read config file: not UTF-8 ({error})") from None
    return loads(text, path)


def loads(text: str, path: Path) -> Config:
    """Check TOML text as if read from `path` (named in errors; relative paths start there)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    return _Reader(path).config(data)


def apply_overrides(
    config: Config,
    *,
    dsn: str | None = None,
    schema: str | None = None,
    environ: Mapping[str, str],
) -> Config:
    """Apply the DSN precedence --dsn > $PGJOBD_DSN > $DATABASE_URL > the file, and --schema.

    Empty environment variables count as unset.
    """
    if dsn is not None and not dsn:
        raise ConfigError("--dsn: must not be empty")
    chosen, source = config.dsn, config.dsn_source
    for value, name in (
        (environ.get("DATABASE_URL"), "$DATABASE_URL"),
        (environ.get("PGJOBD_DSN"), "$PGJOBD_DSN"),
        (dsn, "--dsn"),
    ):
        if value:
            chosen, source = value, name
    database = config.database
    if schema is not None:
        problem = schema_name_problem(schema)
        if problem:
            raise ConfigError(f"--schema: {problem}")
        database = msgspec.structs.replace(database, schema=schema)
    return msgspec.structs.replace(config, database=database, dsn=chosen, dsn_source=source)


def _resolve_paths(config: Config, base: Path) -> Config:
    def resolved(path: Path) -> Path:
        # normpath folds "config/../handlers" lexically, without following symlinks.
        return Path(os.path.normpath(base / path))

    daemon = msgspec.structs.replace(
        config.daemon, handlers=tuple(resolved(path) for path in config.daemon.handlers)
    )
    database = config.database
    if database.dsn_file is not None:
        database = msgspec.structs.replace(database, dsn_file=resolved(database.dsn_file))
    web = config.web
    if web.admin_token_file is not None:
        web = msgspec.structs.replace(web, admin_token_file=resolved(web.admin_token_file))
    return msgspec.structs.replace(config, daemon=daemon, database=database, web=web)


_SectionT = TypeVar("_SectionT")
_MISSING = object()


class _Reader:
    """Turns the dict tomllib gives into a Config, one table at a time so that every
    error can name its TOML key path (msgspec writes dict keys as `[...]`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {where}: {message}")

    def config(self, data: dict[str, Any]) -> Config:
        known = ("cron", "daemon", "database", "queues", "retention", "tenants", "web")
        for key in data:
            if key not in known:
                raise self.fail(_toml_key(key), _unknown_key_message(key, known))
        database = self.convert(data.get("database", {}), DatabaseConfig, "database")
        daemon = self.convert(data.get("daemon", {}), DaemonConfig, "daemon")
        config = Config(
            database=database,
            daemon=daemon,
            queues=self.queues(data.get("queues", {})),
            cron=self.cron(data.get("cron", [])),
            retention=self.convert(data.get("retention", {}), RetentionConfig, "retention"),
            web=self.convert(data.get("web", {}), WebConfig, "web"),
            tenants=self.tenants(data.get("tenants")),
            source=self.path,
        )
        config = _resolve_paths(config, self.path.absolute().parent)
        if config.database.dsn_file is not None:
            return msgspec.structs.replace(
                config,
                dsn=self.read_dsn_file(config.database.dsn_file),
                dsn_source="database.dsn_file",
            )
        if config.database.dsn is not None:
            return msgspec.structs.replace(
                config, dsn=config.database.dsn, dsn_source="database.dsn"
            )
        return config

    def queues(self, tables: Any) -> dict[str, QueueConfig]:
        if not isinstance(tables, dict):
            raise self.fail(
                "queues", f"expected a table of queue tables, got {_describe_value(tables)}"
            )
        queues = _default_queues()
        for name, table in tables.items():
            where = f"queues.{_toml_key(name)}"
            problem = queue_name_problem(name)
            if problem:
                raise self.fail(where, problem)
            queues[name] = self.convert(table, QueueConfig, where)
        return queues

    def tenants(self, table: Any) -> dict[str, int] | None:
        if table is None:
            return None
        if not isinstance(table, dict):
            raise self.fail(
                "tenants", f"expected a table of tenant weights, got {_describe_value(table)}"
            )
        weights: dict[str, int] = {}
        for tenant, weight in table.items():
            where = f"tenants.{_toml_key(tenant)}"
            # "" names the jobs without a tenant (contract §9).
            problem = tenant and text_problem("a tenant", tenant, MAX_TENANT_BYTES)
            if problem:
                raise self.fail(where, problem)
            if isinstance(weight, bool) or not isinstance(weight, int):
                raise self.fail(where, f"expected an integer weight, got {_describe_value(weight)}")
            if not MIN_TENANT_WEIGHT <= weight <= MAX_TENANT_WEIGHT:
                raise self.fail(
                    where,
                    f"expected an integer >= {MIN_TENANT_WEIGHT} and <= {MAX_TENANT_WEIGHT}, "
                    f"got {weight}",
                )
            weights[tenant] = weight
        return weights

    def cron(self, entries: Any) -> tuple[CronEntry, ...]:
        if not isinstance(entries, list):
            raise self.fail(
                "cron",
                f"expected an array of tables (write [[cron]]), got {_describe_value(entries)}",
            )
        first_index: dict[str, int] = {}
        result: list[CronEntry] = []
        for index, raw in enumerate(entries):
            where = f"cron[{index}]"
            if isinstance(raw, dict) and isinstance(raw.get("name"), str):
                where += f" (name {_quote(raw['name'])})"
            entry = self.convert(raw, CronEntry, where)
            if entry.name in first_index:
                raise self.fail(
                    f"{where}.name",
                    f"duplicate cron name, already used by cron[{first_index[entry.name]}]",
                )
            first_index[entry.name] = index
            result.append(entry)
        return tuple(result)

    def convert(self, raw: Any, type_: type[_SectionT], where: str) -> _SectionT:
        try:
            return msgspec.convert(raw, type_, dec_hook=_decode_custom)
        except msgspec.ValidationError as error:
            location, message = _explain(error, raw, type_)
            raise self.fail(where + location, message) from None

    def read_dsn_file(self, dsn_file: Path) -> str:
        try:
            dsn = dsn_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise self.fail(
                "database.dsn_file", f"cannot read {dsn_file}: {_os_reason(error)}"
            ) from None
        except UnicodeDecodeError:
            raise self.fail("database.dsn_file", f"cannot read {dsn_file}: not UTF-8") from None
        if not dsn:
            raise self.fail("database.dsn_file", f"{dsn_file} is empty")
        return dsn


def _decode_custom(type_: type, value: Any) -> Any:
    if type_ is Duration:
        if isinstance(value, str):
            return parse_duration(value)
        raise TypeError(
            f"expected a duration string like {DURATION_EXAMPLES}, got {_describe_value(value)}"
        )
    if type_ is Path:
        if isinstance(value, str) and value:
            return Path(value)
        raise TypeError(f"expected a non-empty path string, got {_describe_value(value)}")
    raise TypeError(f"no decoder for {type_!r}")


_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_MSGSPEC_TYPES = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "object": "a table",
    "array": "an array",
    "datetime": "a date-time",
    "date": "a date",
    "time": "a time",
}


def _explain(error: msgspec.ValidationError, raw: Any, type_: type) -> tuple[str, str]:
    """(key path suffix, message) in TOML terms for a msgspec ValidationError."""
    text = str(error)
    match = re.fullmatch(r"(?s)(.*) - at `\$(.*)`", text)
    message, route = (match.group(1), match.group(2)) if match else (text, "")
    steps: list[str | int] = []
    for key, index in _PATH_STEP.findall(route):
        steps.append(key if key else int(index) if index.isdigit() else -1)

    cause = error.__cause__
    if isinstance(cause, FieldProblem):
        steps.extend(cause.steps)
        return _render_steps(steps), cause.message
    if isinstance(cause, ValueError | TypeError):
        return _render_steps(steps), str(cause)

    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", message)
    if unknown:
        known = _field_names(type_, steps)
        steps.append(unknown.group(1))
        return _render_steps(steps), _unknown_key_message(unknown.group(1), known)
    missing = re.fullmatch(r"Object missing required field `(.*)`", message)
    if missing:
        steps.append(missing.group(1))
        return _render_steps(steps), "missing (this key is required)"

    value = _value_at(raw, steps)
    if message.startswith("Invalid enum value"):
        choices = ", ".join(_quote(str(choice)) for choice in _literal_choices(type_, steps))
        return _render_steps(steps), f"expected one of {choices}, got {_describe_value(value)}"
    expected = re.fullmatch(r"Expected `([^`]*)`(.*?)(, got `[^`]*`)?", message)
    if expected:
        wanted, constraint, wrong_type = expected.groups()
        words = " or ".join(
            _MSGSPEC_TYPES.get(name, name) for name in wanted.split(" | ") if name != "null"
        )
        described = f"{words}{constraint}".replace("a string of length >= 1", "a non-empty string")
        if value is _MISSING:
            return _render_steps(steps), f"expected {described}"
        got = _describe_value(value) if wrong_type else _toml_value(value)
        return _render_steps(steps), f"expected {described}, got {got}"
    return _render_steps(steps), message


def _render_steps(steps: Sequence[str | int]) -> str:
    rendered = ""
    for step in steps:
        if isinstance(step, int):
            rendered += f"[{step}]" if step >= 0 else "[...]"
        else:
            rendered += f".{_toml_key(step)}"
    return rendered


def _value_at(raw: Any, steps: Sequence[str | int]) -> Any:
    value = raw
    for step in steps:
        if step == -1:  # msgspec's "[...]", a dict key it does not name
            return _MISSING
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return value


def _type_at(type_: type, steps: Sequence[str | int]) -> msgspec.inspect.Type | None:
    info: msgspec.inspect.Type = msgspec.inspect.type_info(type_)
    for step in steps:
        if isinstance(info, msgspec.inspect.UnionType):
            containers = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            info = containers[0]
        if isinstance(info, msgspec.inspect.StructType) and isinstance(step, str):
            fields = {field.encode_name: field.type for field in info.fields}
            if step not in fields:
                return None
            info = fields[step]
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        elif isinstance(info, msgspec.inspect.ListType | msgspec.inspect.VarTupleType):
            info = info.item_type
        else:
            return None
    return info


def _field_names(type_: type, steps: Sequence[str | int]) -> tuple[str, ...]:
    info = _type_at(type_, steps)
    if isinstance(info, msgspec.inspect.StructType):
        return tuple(field.encode_name for field in info.fields)
    return ()


def _literal_choices(type_: type, steps: Sequence[str | int]) -> tuple[object, ...]:
    info = _type_at(type_, steps)
    if isinstance(info, msgspec.inspect.LiteralType):
        return info.values
    return ()


def _unknown_key_message(key: str, known: Sequence[str]) -> str:
    message = "unknown key"
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        message += f" (did you mean {close[0]}?)"
    if known:
        message += f"; expected one of: {', '.join(sorted(known))}"
    return message


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _quote(key)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return _quote(value)
    if isinstance(value, int | float):
        return str(value)
    return _describe_value(value)


def _describe_value(value: Any) -> str:
    """A TOML value as an error message shows it: its kind, and the value if short."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a float ({value})"
    if isinstance(value, str):
        return f"a string ({_quote(value)})"
    if isinstance(value, datetime):
        return f"a date-time ({value.isoformat()})"
    if isinstance(value, date):
        return f"a date ({value.isoformat()})"
    if isinstance(value, time):
        return f"a time ({value.isoformat()})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _os_reason(error: OSError) -> str:
    return error.strerror or str(error)
