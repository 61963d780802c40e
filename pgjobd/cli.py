"""The `pgjobd` command line.

Exit status: 0 success, 1 operational error (database unreachable, schema mismatch),
2 usage error (bad arguments, a rejected job), 78 configuration error (EX_CONFIG).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any

import anyio
import asyncpg

from pgjobd import __version__, config, daemon, dev, log, migrate, worker
from pgjobd.client import Client
from pgjobd.errors import ConfigError, EnqueueError, PgjobdError, SchemaError
from pgjobd.handlers import load_directories

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_CONFIG = 78

Command = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
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
    p.set_defaults(command=_enqueue)

    p = sub.add_parser("dev", help="a private PostgreSQL, the schema and example jobs")
    dev.add_arguments(p)
    p.set_defaults(command=dev.run)

    # Internal: a worker process of the daemon's supervisor (pgjobd.worker). No help=:
    # argparse lists only subcommands given one (help=SUPPRESS prints "==SUPPRESS==").
    p = sub.add_parser("worker")
    worker.add_arguments(p)
    p.set_defaults(command=worker.command)
    return parser


def _load_config(args: argparse.Namespace) -> config.Config:
    path = config.resolve_config_path(args.config, os.environ)
    loaded = config.load(path)
    return config.apply_overrides(loaded, dsn=args.dsn, schema=args.schema, environ=os.environ)


def _run(coroutine: Callable[[], Coroutine[Any, Any, int]]) -> int:
    result: int = anyio.run(coroutine, backend_options={"use_uvloop": True})
    return result


async def _connect(cfg: config.Config) -> asyncpg.Connection:
    timeout = cfg.database.connect_timeout.total_seconds()
    return await asyncpg.connect(cfg.require_dsn(), timeout=timeout)


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
            if args.dry_run:
                todo = await migrate.pending(conn, schema)
                sys.stdout.write(migrate.dry_run_sql(schema, todo, roles=args.roles))
                return EXIT_OK
            applied = await migrate.migrate(conn, schema, roles=args.roles)
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


def _check_config(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    registry = load_directories(cfg.daemon.handlers)
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
        job_args = json.loads(args.args_json)
    except json.JSONDecodeError as e:
        _fail(f"JSON: not valid JSON: {e}")
        return EXIT_USAGE
    run_at = _parse_time(args.at) if args.at else None
    cfg = _load_config(args)

    async def run() -> int:
        pool = await asyncpg.create_pool(
            cfg.require_dsn(), min_size=1, max_size=1,
            timeout=cfg.database.connect_timeout.total_seconds(),
        )  # fmt: skip
        try:
            client = Client(pool, schema=cfg.database.schema)
            job_id = await client.enqueue(
                args.kind, job_args, queue=args.queue, priority=args.priority,
                delay=args.delay, run_at=run_at, tenant=args.tenant,
                unique_key=args.unique_key, max_attempts=args.max_attempts,
            )  # fmt: skip
        finally:
            await pool.close()
        print(json.dumps({"id": job_id}) if args.json else job_id)
        return EXIT_OK

    return _run(run)


def _parse_time(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise EnqueueError(f"--at: not an ISO 8601 time: {text!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _fail(message: str) -> None:
    print(f"pgjobd: {message}", file=sys.stderr)
