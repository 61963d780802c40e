"""`pgjobd dev`: a private PostgreSQL with the pgjobd schema and a few jobs, until Ctrl-C.

The data directory persists between runs. A server left running by a killed `pgjobd dev`
is adopted, and stopped like our own on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import asyncpg

from pgjobd.embedded import Cluster, default_dev_dir, find_binaries
from pgjobd.errors import PgjobdError
from pgjobd.migrate import migrate

SCHEMA = "pgjobd"
DATABASE = "pgjobd"
# unique_key makes a restart return the waiting example jobs instead of adding more.
_EXAMPLE_JOBS_SQL = """
SELECT pgjobd.enqueue('hello', '{"name": "world"}'::jsonb, unique_key => 'dev-example-1'),
       pgjobd.enqueue('hello', '{"name": "Ada"}'::jsonb, unique_key => 'dev-example-2'),
       pgjobd.enqueue('hello', '{"name": "later"}'::jsonb, delay => interval '1 minute',
                      unique_key => 'dev-example-3')
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `pgjobd dev`, for its own parser and for the CLI's subcommand."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="data directory (default: $PGJOBD_DEV_DIR, $XDG_DATA_HOME/pgjobd/dev "
        "or ~/.local/share/pgjobd/dev)",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="TCP port (default: the last one, or 54329)"
    )
    parser.add_argument(
        "--reset", action="store_true", help="delete the data directory and start afresh"
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pgjobd dev",
        description="Run a private PostgreSQL with the pgjobd schema for development.",
    )
    add_arguments(parser)
    return parser.parse_args(argv)


def _say(message: str = "") -> None:
    print(message, flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    return run(_parse(argv))


def run(args: argparse.Namespace) -> int:
    """`pgjobd dev` with parsed options (see add_arguments)."""
    previous_sigint = signal.signal(signal.SIGINT, _interrupt)
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args)
    except PgjobdError as e:
        print(f"pgjobd dev: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous_sigint)
        signal.signal(signal.SIGTERM, previous_sigterm)


def _run(args: argparse.Namespace) -> int:
    binaries = find_binaries()
    _say(f"pgjobd dev: {binaries.version()} from {binaries.source} ({binaries.bin_dir})")
    data_dir: Path = args.data_dir if args.data_dir is not None else default_dev_dir()
    cluster = Cluster(data_dir, port=args.port, binaries=binaries)
    if args.reset:
        _reset(cluster)
    if cluster.init():
        _say(f"pgjobd dev: created data directory {cluster.data_dir}")
    else:
        _say(f"pgjobd dev: data directory {cluster.data_dir}")
    try:
        cluster.start()
        if cluster.adopted:
            _say(
                f"pgjobd dev: adopted the server an earlier `pgjobd dev` left running "
                f"(pid {cluster.pid}, port {cluster.port})"
            )
        else:
            _say(f"pgjobd dev: server started on 127.0.0.1:{cluster.port} (pid {cluster.pid})")
        asyncio.run(_prepare(cluster))
        _say_ready(cluster)
        while cluster.running:
            time.sleep(0.5)
        print(f"pgjobd dev: the server stopped; see {cluster.log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave a server behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if cluster.running:
            _say("pgjobd dev: stopping the server")
            cluster.stop("fast")
            _say("pgjobd dev: stopped")


def _reset(cluster: Cluster) -> None:
    if not cluster.data_dir.exists():
        return
    if not cluster.is_initialised() and any(cluster.data_dir.iterdir()):
        raise PgjobdError(f"--reset: {cluster.data_dir} is not a PostgreSQL data directory")
    if cluster.adopt():
        cluster.stop("fast")
    shutil.rmtree(cluster.data_dir)
    _say(f"pgjobd dev: deleted {cluster.data_dir}")


async def _prepare(cluster: Cluster) -> None:
    if await cluster.ensure_database(DATABASE):
        _say(f"pgjobd dev: created database {DATABASE}")
    conn = await asyncpg.connect(cluster.dsn(DATABASE))
    try:
        applied = await migrate(conn, SCHEMA)
        if applied:
            versions = ", ".join(str(v) for v in applied)
            _say(f"pgjobd dev: schema {SCHEMA} migrated (applied {versions})")
        else:
            _say(f"pgjobd dev: schema {SCHEMA} is up to date")
        ids = await conn.fetchrow(_EXAMPLE_JOBS_SQL)
        _say(f"pgjobd dev: example jobs of kind 'hello' waiting: ids {', '.join(map(str, ids))}")
    finally:
        await conn.close()


def _say_ready(cluster: Cluster) -> None:
    dsn = cluster.dsn(DATABASE)
    psql = "psql" if shutil.which("psql") else str(cluster.binaries.program("psql"))
    _say(f"pgjobd dev: ready: {dsn}")
    _say(
        f"""
Try, in another terminal:
  export PGJOBD_DSN={shlex.quote(dsn)}
  pgjobd enqueue hello '{{"name": "you"}}'
  pgjobd migrate --dry-run
  {shlex.quote(psql)} "$PGJOBD_DSN" -c 'table pgjobd.job'

Note: the daemon (`pgjobd run`) is not implemented yet, so jobs wait in the table.
Press Ctrl-C to stop the server."""
    )


if __name__ == "__main__":
    sys.exit(main())
