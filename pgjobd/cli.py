"""The `pgjobd` command line.

Exit status: 0 success, 1 operational error (database unreachable, schema mismatch),
2 usage error (bad arguments, a rejected job), 78 configuration error (EX_CONFIG).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
import msgspec

from pgjobd import __version__, admin, config, daemon, db, dev, log, migrate
from pgjobd import middleware as pgjobd_middleware
from pgjobd.client import Client
from pgjobd.duration import parse_duration
from pgjobd.errors import ConfigError, EnqueueError, PgjobdError, SchemaError
from pgjobd.handler_loader import check_cron, load_directories
from pgjobd.redact import redact_args

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_CONFIG = 78

Command = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:1]) == ["worker"]:
        # Internal and unlisted: a worker process, as `python -m pgjobd.worker` (what the
        # supervisor runs). Imported only here: the daemon never loads the child's module.
        from pgjobd import worker  # noqa: PLC0415 (see above)

        return worker.command(worker.parse_args(argv[1:]))
    parser = _parser()
    args = parser.parse_args(argv)
    command: Command = args.command
    try:
        return command(args)
    except ConfigError as e:
        _fail(f"configuration error: {e}")
        return EXIT_CONFIG
    except EnqueueError as e:
        _fail(f"rejected: {e}")
        return EXIT_USAGE
    except admin.InvalidInput as e:
        _fail(str(e))
        return EXIT_USAGE
    except (SchemaError, PgjobdError) as e:
        _fail(str(e))
        return EXIT_FAILURE
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
        _fail(f"database error: {type(e).__name__}: {e}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="config file (default: search order)")
    common.add_argument("--dsn", help="PostgreSQL DSN; overrides the config and environment")
    common.add_argument("--schema", help="pgjobd schema name (default: database.schema)")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    parser = argparse.ArgumentParser(prog="pgjobd", description="A job scheduler on PostgreSQL.")
    parser.add_argument("--version", action="version", version=f"pgjobd {__version__}")
    sub = parser.add_subparsers(metavar="COMMAND", required=True)

    p = sub.add_parser("run", parents=[common], help="the daemon: a fleet member")
    p.set_defaults(command=_run_member)

    p = sub.add_parser("migrate", parents=[common], help="create or upgrade the schema")
    p.add_argument("--dry-run", action="store_true", help="print the SQL, change nothing")
    p.add_argument(
        "--roles",
        action="store_true",
        help="also create the least-privilege roles <schema>_producer, _readonly, _admin, _worker",
    )
    p.add_argument(
        "--rls",
        action="store_true",
        help="also turn on row-level security by tenant for producer and readonly logins "
        "(implies --roles)",
    )
    p.add_argument(
        "--status", action="store_true", help="list applied and pending migrations, change nothing"
    )
    p.set_defaults(command=_migrate)

    p = sub.add_parser(
        "check-config", parents=[common], help="validate the config and import the handlers"
    )
    p.set_defaults(command=_check_config)

    p = sub.add_parser("enqueue", parents=[common], help="enqueue one job, print its id")
    p.add_argument("kind")
    p.add_argument("args_json", nargs="?", default="{}", metavar="JSON", help="args object")
    p.add_argument("--queue")
    p.add_argument("--priority", type=int)
    p.add_argument("--delay", help='run after this long, e.g. "10s", "5m"')
    p.add_argument("--at", help="run at this ISO 8601 time (no offset: UTC)")
    p.add_argument("--tenant")
    p.add_argument("--unique-key")
    p.add_argument("--max-attempts", type=int)
    p.add_argument("--group", help="an ordered group: its jobs run one at a time, in order")
    p.set_defaults(command=_enqueue)

    _admin_parsers(sub, common)

    p = sub.add_parser("web", parents=[common], help="the web console and its JSON API")
    p.add_argument("--listen", metavar="HOST:PORT", help="default: [web] listen, 127.0.0.1:9470")
    p.set_defaults(command=_web)

    p = sub.add_parser("dev", help="a private PostgreSQL, the schema and example jobs")
    dev.add_arguments(p)
    p.set_defaults(command=dev.run)

    return parser


def _load_config(args: argparse.Namespace) -> config.Config:
    path = config.resolve_config_path(args.config, os.environ)
    loaded = config.load(path)
    return config.apply_overrides(loaded, dsn=args.dsn, schema=args.schema, environ=os.environ)


def _run(coroutine: Callable[[], Coroutine[Any, Any, int]]) -> int:
    result: int = anyio.run(coroutine, backend_options={"use_uvloop": True})
    return result


async def _connect(cfg: config.Config) -> asyncpg.Connection:
    """migrate's session: its advisory lock and DDL need one that lasts (through a
    transaction pooler, database.leader_dsn), and its statements set their own
    statement_timeout, which no client-side limit may cut short."""
    return await db.connect(cfg, "pgjobd cli", session=True, bounded=False)


async def _cli_pool(cfg: config.Config) -> asyncpg.Pool:
    """The one-connection pool of a CLI command, with the configured timeouts."""
    return await db.create_pool(cfg, max_size=1, application_name="pgjobd cli")


def _run_member(args: argparse.Namespace) -> int:
    # Until the daemon listens for it, a SIGHUP must not end the process (its default).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    cfg = _load_config(args)
    cfg.require_dsn()
    log.setup(cfg.daemon.log_format, cfg.daemon.log_level)
    member = daemon.Member(cfg, reload_config=lambda: _load_config(args))
    try:
        return _run(lambda: _serve(member))
    except BaseExceptionGroup as group:
        raise daemon.most_telling(group) from None


async def _serve(member: daemon.Member) -> int:
    await member.run()
    return EXIT_OK


def _migrate(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    schema = cfg.database.schema

    async def run() -> int:
        conn = await _connect(cfg)
        try:
            if args.status:
                return _print_migration_status(args, schema, await migrate.status(conn, schema))
            if args.dry_run:
                todo = await migrate.pending(conn, schema)
                (await migrate.verify(conn, schema)).raise_for_migrate()
                sys.stdout.write(migrate.dry_run_sql(schema, todo, roles=args.roles, rls=args.rls))
                return EXIT_OK
            applied = await migrate.migrate(conn, schema, roles=args.roles, rls=args.rls)
            version = await migrate.check_schema(conn, schema)
        finally:
            await conn.close()
        if args.json:
            print(json.dumps({"schema": schema, "applied": applied, "version": version}))
        elif applied:
            done = ", ".join(f"{v:04d}" for v in applied)
            print(f"schema {schema}: applied {done}; now at version {version}")
        else:
            print(f"schema {schema}: up to date (version {version})")
        return EXIT_OK

    return _run(run)


def _print_migration_status(
    args: argparse.Namespace, schema: str, states: list[migrate.MigrationState]
) -> int:
    pending = [s for s in states if s.applied_at is None]
    if args.json:
        _print_json({
            "schema": schema,
            "applied": [{"version": s.version, "name": s.name, "applied_at": s.applied_at}
                        for s in states if s.applied_at is not None],
            "pending": [{"version": s.version, "name": s.name} for s in pending],
        })  # fmt: skip
        return EXIT_OK
    rows = [
        [f"{s.version:04d}", s.name, _time(s.applied_at) if s.applied_at else "pending"]
        for s in states
    ]
    _table(["VERSION", "NAME", "APPLIED AT"], rows)
    print(f"schema {schema}: {len(states) - len(pending)} applied, {len(pending)} pending")
    return EXIT_OK


def _check_config(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    registry = load_directories(cfg.daemon.handlers)
    pgjobd_middleware.load(cfg.daemon.middleware)
    check_cron(cfg, registry)
    kinds = {
        spec.kind: {"queue": spec.queue or config.DEFAULT_QUEUE, "source": spec.source}
        for spec in registry.values()
    }
    undeclared = sorted(
        {info["queue"] for info in kinds.values()} - set(cfg.queues)
    )  # jobs there wait until some member serves that queue
    source = str(cfg.source) if cfg.source else None
    queues = sorted(cfg.queues)
    directories = [str(d) for d in cfg.daemon.handlers]
    if args.json:
        summary = {
            "config": source, "schema": cfg.database.schema, "dsn_source": cfg.dsn_source,
            "queues": queues, "cron": [entry.name for entry in cfg.cron],
            "handlers": directories, "kinds": kinds, "unserved_queues": undeclared,
        }  # fmt: skip
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    print(f"config: {source or 'none found, built-in defaults'}: OK")
    print(f"schema: {cfg.database.schema}; DSN from: {cfg.dsn_source or 'not set'}")
    print(f"queues: {', '.join(queues)}")
    print(f"handlers: {len(kinds)} kinds from {', '.join(directories)}")
    for kind, info in sorted(kinds.items()):
        print(f"  {kind:30} queue {info['queue']:15} {info['source']}")
    if undeclared:
        print(f"warning: no [queues.*] table for {', '.join(undeclared)}: jobs there wait")
    return EXIT_OK


def _enqueue(args: argparse.Namespace) -> int:
    try:
        job_args = json.loads(args.args_json, parse_constant=_not_json, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        _fail(f"JSON: not valid JSON: {e}")
        return EXIT_USAGE
    except ValueError as e:  # _not_json, _finite_float, an integer of too many digits
        _fail(f"JSON: {e}")
        return EXIT_USAGE
    except RecursionError:
        _fail("JSON: nested too deeply")
        return EXIT_USAGE
    run_at = _parse_time(args.at) if args.at else None
    cfg = _load_config(args)

    async def run() -> int:
        pool = await _cli_pool(cfg)
        try:
            client = Client(pool, schema=cfg.database.schema)
            job_id = await client.enqueue(
                args.kind, job_args, queue=args.queue, priority=args.priority,
                delay=args.delay, run_at=run_at, tenant=args.tenant,
                unique_key=args.unique_key, max_attempts=args.max_attempts, group=args.group,
            )  # fmt: skip
        finally:
            await pool.close()
        print(json.dumps({"id": job_id}) if args.json else job_id)
        return EXIT_OK

    return _run(run)


def _web(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    if args.listen is not None:
        try:
            cfg = msgspec.structs.replace(
                cfg, web=msgspec.structs.replace(cfg.web, listen=args.listen)
            )
        except config.FieldProblem as e:
            raise ConfigError(f"--listen: {e.message}") from None
    host, port = cfg.web.address
    cfg.require_dsn()
    log.setup(cfg.daemon.log_format, cfg.daemon.log_level)
    try:
        from pgjobd.web import serve  # noqa: PLC0415 (the optional extra, only here)
    except ImportError as e:
        raise PgjobdError(
            f"pgjobd web needs the web extra (pip install 'pgjobd[web]'): {e}"
        ) from None
    serve.run(cfg, host, port)
    return EXIT_OK


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON (JSON numbers are finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _parse_time(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise EnqueueError(f"--at: not an ISO 8601 time: {text!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _fail(message: str) -> None:
    print(f"pgjobd: {message}", file=sys.stderr)


# -- admin commands (pgjobd.admin; JSON shapes in docs/cli.md) ---------------------------

AdminAction = Callable[[argparse.Namespace, asyncpg.Pool, str], Coroutine[Any, Any, int]]


def _admin_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common], help="members, leader and queues")
    p.set_defaults(command=_admin(_status))

    jobs = sub.add_parser("jobs", help="inspect and act on jobs").add_subparsers(
        metavar="ACTION", required=True
    )
    p = jobs.add_parser("list", parents=[common], help="jobs, newest first")
    p.add_argument("--state", action="append", choices=admin.STATES, help="repeatable")
    p.add_argument("--queue")
    p.add_argument("--kind")
    p.add_argument("--tenant")
    p.add_argument("--limit", type=int, default=admin.DEFAULT_LIMIT)
    p.add_argument("--before", type=int, metavar="ID", help="only jobs older than this id")
    p.set_defaults(command=_admin(_jobs_list))
    p = jobs.add_parser("show", parents=[common], help="one job, live or finished")
    p.add_argument("id", type=int)
    p.set_defaults(command=_admin(_jobs_show))
    p = jobs.add_parser("retry", parents=[common], help="run jobs again now")
    p.add_argument("ids", type=int, nargs="+", metavar="ID")
    p.set_defaults(command=_admin(_jobs_retry))
    p = jobs.add_parser("cancel", parents=[common], help="cancel pending or running jobs")
    p.add_argument("ids", type=int, nargs="+", metavar="ID")
    p.set_defaults(command=_admin(_jobs_cancel))

    queues = sub.add_parser("queues", help="pause or resume queues").add_subparsers(
        metavar="ACTION", required=True
    )
    for name, paused in (("pause", True), ("resume", False)):
        what = "stop" if paused else "restart"
        p = queues.add_parser(name, parents=[common], help=f"{what} claiming, fleet-wide")
        p.add_argument("queue")
        p.set_defaults(command=_admin(_queues_set), paused=paused)

    dlq = sub.add_parser("dlq", help="dead jobs: look and put back").add_subparsers(
        metavar="ACTION", required=True
    )
    for name in ("list", "redrive"):
        verb = "list" if name == "list" else "retry every matching"
        p = dlq.add_parser(name, parents=[common], help=f"{verb} dead jobs")
        p.add_argument("--kind")
        p.add_argument("--queue")
        p.add_argument("--since", type=_since, help='dead since: "2h" ago, or an ISO 8601 time')
        p.add_argument("--fingerprint", help="only jobs whose last error has this fingerprint")
        if name == "list":
            p.add_argument("--limit", type=int, default=admin.DEFAULT_LIMIT)
        p.set_defaults(command=_admin(_dlq_list if name == "list" else _dlq_redrive))

    p = sub.add_parser(
        "scrub", parents=[common], help="overwrite the payloads and errors of finished jobs"
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tenant", help="the jobs of this tenant")
    which.add_argument("--kind", help="the jobs of this kind")
    p.add_argument("--before", type=_since, help='finished before: "30d" ago, or an ISO 8601 time')
    p.set_defaults(command=_admin(_scrub))

    cron = sub.add_parser("cron", help="schedules and their next run").add_subparsers(
        metavar="ACTION", required=True
    )
    p = cron.add_parser("list", parents=[common], help="every schedule and its next run")
    p.set_defaults(command=_admin(_cron_list))
    p = cron.add_parser("trigger", parents=[common], help="enqueue one job of a schedule now")
    p.add_argument("name")
    p.set_defaults(command=_admin(_cron_trigger))


def _since(text: str) -> datetime | timedelta:
    try:
        return parse_duration(text)
    except ValueError:
        pass
    try:
        return _parse_time(text)
    except EnqueueError:
        raise argparse.ArgumentTypeError(
            f'expected a duration ("30m", "2h", "7d") or an ISO 8601 time, got {text!r}'
        ) from None


def _admin(action: AdminAction) -> Command:
    """A command run on a one-connection pool after checking the schema's version."""

    def command(args: argparse.Namespace) -> int:
        cfg = _load_config(args)

        async def run() -> int:
            pool = await _cli_pool(cfg)
            try:
                async with pool.acquire() as conn:
                    await migrate.check_schema(conn, cfg.database.schema)
                return await action(args, pool, cfg.database.schema)
            finally:
                await pool.close()

        return _run(run)

    return command


def _print_json(value: object) -> None:
    print(msgspec.json.encode(value).decode())


async def _status(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    status = await admin.status(pool, schema)
    if args.json:
        _print_json(status)
        return EXIT_OK
    leader = status.leader
    led = f"leader {leader.member} (term {leader.term})" if leader else "no leader"
    print(f"members: {len(status.members)} live; {led}")
    rows = [
        [m.id, m.host, str(m.pid), m.version, "yes" if m.leader else "", _age(m.uptime_s),
         _time(m.heartbeat_at), ",".join(m.queues)]
        for m in status.members
    ]  # fmt: skip
    headers = ["MEMBER", "HOST", "PID", "VERSION", "LEADER", "UPTIME", "HEARTBEAT", "QUEUES"]
    _table(headers, rows)
    print()
    print(f"queues: {len(status.queues)}")
    rows = [
        [name, str(s.available), str(s.scheduled), str(s.running), str(s.retryable),
         str(s.blocked), str(s.dead_last_hour), _age(s.oldest_available_age_s),
         f"{s.throughput_per_s:.2f}", "PAUSED" if s.paused else "", _limits(s.limited)]
        for name, s in status.queues.items()
    ]  # fmt: skip
    headers = ["QUEUE", "AVAILABLE", "SCHEDULED", "RUNNING", "RETRYABLE", "BLOCKED", "DEAD/1H",
               "OLDEST", "JOBS/S", "PAUSED", "LIMITS"]  # fmt: skip
    _table(headers, rows)
    if status.breakers:
        not_closed = sum(1 for b in status.breakers.values() if b.state != "closed")
        print()
        print(f"circuit breakers: {len(status.breakers)}, {not_closed} not closed")
        rows = [
            [kind, b.state.replace("_", "-").upper(), _time(b.since), b.circuit_breaker,
             _age(b.cooldown_s), "" if b.probe is None else str(b.probe)]
            for kind, b in status.breakers.items()
        ]  # fmt: skip
        _table(["KIND", "STATE", "SINCE", "OPENS AT", "COOL-DOWN", "PROBE"], rows)
    return EXIT_OK


def _limits(limits: admin.QueueLimits) -> str:
    parts = []
    if limits.global_concurrency is not None:
        parts.append(f"running {limits.running}/{limits.global_concurrency}")
    if limits.rate_limit is not None:
        parts.append(f"rate {limits.rate_limit}")
    if limits.max_depth is not None:
        parts.append(f"max_depth {limits.max_depth}")
    if limits.tenant_concurrency is not None:
        parts.append(f"per tenant {limits.tenant_concurrency}")
    if limits.fair:
        parts.append("fair")
    return ", ".join(parts)


async def _jobs_list(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    jobs = await admin.list_jobs(
        pool, schema, states=args.state, queue=args.queue, kind=args.kind, limit=args.limit,
        tenant=args.tenant, before=args.before,
    )  # fmt: skip
    if args.json:
        _print_json({"jobs": jobs})
        return EXIT_OK
    rows = [
        [str(j.id), j.state + (" (cancel requested)" if j.cancel_requested else ""), j.queue,
         j.kind, f"{j.attempt}/{j.max_attempts}", _time(j.finished_at or j.run_at),
         j.reason or "", _short(j.last_error)]
        for j in jobs
    ]  # fmt: skip
    _table(["ID", "STATE", "QUEUE", "KIND", "ATTEMPT", "RUN/FINISHED AT", "REASON", "LAST ERROR"],
           rows)  # fmt: skip
    return EXIT_OK


async def _jobs_show(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    info = await Client(pool, schema=schema).job(args.id)
    if info is None:
        raise admin.UnknownJobs([args.id])
    secret = await admin.redacted_fields(pool, schema, info.kind)
    info = msgspec.structs.replace(info, args=redact_args(info.args, secret))
    if args.json:
        _print_json(info)
        return EXIT_OK
    fields = msgspec.structs.asdict(info)
    errors = fields.pop("errors")
    for name, value in fields.items():
        if name in ("args", "result"):
            shown = json.dumps(value)
        elif isinstance(value, list):
            shown = ", ".join(map(str, value)) or "-"
        else:
            shown = _time(value)
        print(f"{name + ':':14} {shown}")
    print(f"{'errors:':14} {len(errors)}")
    for error in errors:
        print(f"  attempt {error.attempt} at {_time(error.at)}: {error.error}")
    return EXIT_OK


async def _jobs_retry(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    done = await admin.retry_jobs(pool, schema, args.ids, user=admin.os_user())
    return _print_job_outcomes(args, done)


async def _jobs_cancel(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    done = await admin.cancel_jobs(pool, schema, args.ids, user=admin.os_user())
    return _print_job_outcomes(args, done)


def _print_job_outcomes(args: argparse.Namespace, done: admin.JobsAction) -> int:
    if args.json:
        _print_json(done)
        return EXIT_OK
    for job in done.jobs:
        print(f"job {job.id}: {job.outcome.replace('_', ' ')} (was {job.state})")
    return EXIT_OK


async def _queues_set(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    done = await admin.set_paused(pool, schema, args.queue, args.paused, user=admin.os_user())
    if args.json:
        _print_json(done)
        return EXIT_OK
    state = "paused" if done.paused else "resumed"
    print(f"queue {done.queue}: {state}" + ("" if done.changed else " (it already was)"))
    return EXIT_OK


async def _dlq_list(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    jobs = await admin.list_dead(
        pool, schema, kind=args.kind, queue=args.queue, since=args.since, limit=args.limit,
        fingerprint=args.fingerprint,
    )  # fmt: skip
    groups = await admin.group_dead(pool, schema, kind=args.kind, queue=args.queue,
                                    since=args.since)  # fmt: skip
    if args.fingerprint is not None:
        groups = [g for g in groups if g.fingerprint == args.fingerprint]
    if args.json:
        _print_json({"groups": groups, "jobs": jobs})
        return EXIT_OK
    rows = [
        [g.fingerprint or "-", str(g.count), g.reason or "", ",".join(g.kinds),
         _time(g.last_dead_at), _short(g.last_error)]
        for g in groups
    ]  # fmt: skip
    _table(["FINGERPRINT", "COUNT", "REASON", "KINDS", "LAST DEAD AT", "LAST ERROR"], rows)
    print()
    rows = [
        [str(j.id), j.queue, j.kind, f"{j.attempt}/{j.max_attempts}", j.reason or "",
         j.fingerprint or "-", _time(j.finished_at), _short(j.last_error)]
        for j in jobs
    ]  # fmt: skip
    _table(["ID", "QUEUE", "KIND", "ATTEMPT", "REASON", "FINGERPRINT", "DEAD AT", "LAST ERROR"],
           rows)  # fmt: skip
    return EXIT_OK


async def _dlq_redrive(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    done = await admin.redrive(
        pool, schema, kind=args.kind, queue=args.queue, since=args.since, user=admin.os_user(),
        fingerprint=args.fingerprint,
    )  # fmt: skip
    if args.json:
        _print_json(done)
        return EXIT_OK
    print(f"redrove {len(done.ids)} dead job(s)" + (f": {_ids(done.ids)}" if done.ids else ""))
    if done.blocked:
        print(f"left dead, a live job holds their unique_key: {_ids(done.blocked)}")
    return EXIT_OK


async def _scrub(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    done = await admin.scrub(
        pool, schema, tenant=args.tenant, kind=args.kind, before=args.before,
        user=admin.os_user(),
    )  # fmt: skip
    if args.json:
        _print_json(done)
        return EXIT_OK
    print(f"scrubbed {len(done.ids)} finished job(s) and {done.attempts} attempt(s)")
    return EXIT_OK


async def _cron_list(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    entries = await admin.list_cron(pool, schema)
    if args.json:
        _print_json({"schedules": entries})
        return EXIT_OK
    rows = [
        [e.name, e.schedule, e.timezone, e.kind, e.queue or "", e.catch_up,
         "yes" if e.enabled else "no", e.source, _time(e.last_slot),
         e.error or _time(e.next_run)]
        for e in entries
    ]  # fmt: skip
    _table(["NAME", "SCHEDULE", "TIMEZONE", "KIND", "QUEUE", "CATCH-UP", "ENABLED", "SOURCE",
            "LAST SLOT", "NEXT RUN"], rows)  # fmt: skip
    return EXIT_OK


async def _cron_trigger(args: argparse.Namespace, pool: asyncpg.Pool, schema: str) -> int:
    done = await admin.trigger_cron(pool, schema, args.name, user=admin.os_user())
    if args.json:
        _print_json(done)
    else:
        print(done.id)
    return EXIT_OK


def _table(headers: list[str], rows: list[list[str]]) -> None:
    """Aligned columns, two spaces apart; '(none)' for no rows."""
    if not rows:
        print("(none)")
        return
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{whole}s"
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n][:2]
    return "".join(shown)


def _time(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return str(value)


def _short(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    line = text.splitlines()[0] if text.strip() else text
    return line if len(line) <= width else line[: width - 1] + "…"


def _ids(ids: list[int]) -> str:
    return ", ".join(str(i) for i in ids)
