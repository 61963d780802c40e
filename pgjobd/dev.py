"""`pgjobd dev`: a private PostgreSQL with the pgjobd schema, a daemon serving the
example handlers, and a few jobs flowing, until Ctrl-C.

The data directory persists between runs. A server left running by a killed `pgjobd dev`
is adopted, and stopped like our own on Ctrl-C or SIGTERM. The daemon is a real
`pgjobd run` child process; Ctrl-C drains it before the server stops.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TextIO

import asyncpg

from pgjobd import admin, db
from pgjobd.config import Config
from pgjobd.embedded import Cluster, default_dev_dir, find_binaries
from pgjobd.errors import PgjobdError
from pgjobd.migrate import migrate

SCHEMA = "pgjobd"
# How long the example jobs wait for the daemon to join the fleet (then go in anyway).
DAEMON_JOIN_WAIT_S = 30.0
DATABASE = "pgjobd"
# unique_key makes a restart return the waiting example jobs instead of adding more.
_EXAMPLE_JOBS_SQL = """
SELECT pgjobd.enqueue('hello', '{"name": "world"}'::jsonb, unique_key => 'dev-example-1'),
       pgjobd.enqueue('hello', '{"name": "Ada"}'::jsonb, unique_key => 'dev-example-2'),
       pgjobd.enqueue('hello', '{"name": "later"}'::jsonb, delay => interval '20 seconds',
                      unique_key => 'dev-example-3'),
       pgjobd.enqueue('build_report', '{"scope": "all"}'::jsonb,
                      unique_key => 'dev-example-4'),
       pgjobd.enqueue('flaky_webhook', '{"url": "https://example.invalid/hook",
                                          "event": "signup"}'::jsonb,
                      unique_key => 'dev-example-5')
"""
_DAEMON_CONFIG = """\
# Written by `pgjobd dev` for its daemon; edit config/dev.toml for your own runs.
[database]
schema = "{schema}"

[daemon]
handlers = [{handlers}]
log_format = "text"
drain_timeout = "5s"
metrics_listen = ""

[queues.default]
concurrency = 4
processes = 1
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
    parser.add_argument(
        "--handlers",
        type=Path,
        default=Path("handlers"),
        help="handler directory for the daemon (default: ./handlers, the examples)",
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pgjobd dev",
        description="Run a private PostgreSQL with the pgjobd schema for development.",
    )
    add_arguments(parser)
    return parser.parse_args(argv)


def _say(message: str = "", file: TextIO | None = None) -> None:
    """One line in one write: the daemon's processes share the stream, and print() writes
    the line and its end apart when the stream is unbuffered (PYTHONUNBUFFERED), so a
    worker's log line could land between them (a reader of the ready line then got both)."""
    stream = sys.stdout if file is None else file
    stream.write(f"{message}\n")
    stream.flush()


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
        _say(f"pgjobd dev: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous_sigint)
        signal.signal(signal.SIGTERM, previous_sigterm)


def _start_daemon(cluster: Cluster, handlers: Path) -> subprocess.Popen[bytes] | None:
    """`pgjobd run` on the dev cluster with the example handlers, as a child process."""
    if not handlers.is_dir():
        _say(f"pgjobd dev: no handler directory {handlers}: not starting the daemon "
             "(pass --handlers DIR)")  # fmt: skip
        return None
    config = cluster.data_dir / "pgjobd-dev.toml"
    config.write_text(
        _DAEMON_CONFIG.format(schema=SCHEMA, handlers=f'"{handlers.resolve()}"'), "utf-8"
    )
    env = {**os.environ, "PGJOBD_DSN": cluster.dsn(DATABASE)}
    env.pop("DATABASE_URL", None)
    _say(f"pgjobd dev: starting the daemon: pgjobd run --config {config}")
    # Its own session: a terminal's Ctrl-C reaches only `pgjobd dev`, which then drains
    # the daemon with one SIGTERM (a second signal would make it stop at once).
    return subprocess.Popen(
        [sys.executable, "-m", "pgjobd", "run", "--config", str(config)],
        env=env,
        start_new_session=True,
        preexec_fn=_drain_when_parent_dies,  # noqa: PLW1509 (no threads in `pgjobd dev`)
    )


def _drain_when_parent_dies() -> None:
    """In the daemon child: get SIGTERM (and drain) if `pgjobd dev` is killed."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _run(args: argparse.Namespace) -> int:
    daemon: subprocess.Popen[bytes] | None = None
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
        daemon = _start_daemon(cluster, args.handlers)
        asyncio.run(_enqueue_examples(cluster, daemon))
        _say_ready(cluster)
        while cluster.running and (daemon is None or daemon.poll() is None):
            time.sleep(0.5)
        if not cluster.running:
            _say(f"pgjobd dev: the server stopped; see {cluster.log_path}", file=sys.stderr)
        else:
            _say(f"pgjobd dev: the daemon exited ({daemon.returncode if daemon else '?'})",
                 file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C must not cut the shutdown short and leave a server behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if daemon is not None and daemon.poll() is None:
            _say("pgjobd dev: draining the daemon")
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
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


async def _connect(cluster: Cluster) -> asyncpg.Connection:
    return await asyncpg.connect(
        cluster.dsn(DATABASE), **db.connect_options(Config(), "pgjobd dev")
    )


async def _prepare(cluster: Cluster) -> None:
    if await cluster.ensure_database(DATABASE):
        _say(f"pgjobd dev: created database {DATABASE}")
    conn = await _connect(cluster)
    try:
        applied = await migrate(conn, SCHEMA)
        if applied:
            versions = ", ".join(str(v) for v in applied)
            _say(f"pgjobd dev: schema {SCHEMA} migrated (applied {versions})")
        else:
            _say(f"pgjobd dev: schema {SCHEMA} is up to date")
    finally:
        await conn.close()


async def _enqueue_examples(cluster: Cluster, daemon: subprocess.Popen[bytes] | None) -> None:
    """The example jobs, once the daemon is in the fleet: it joins after declaring its
    handlers' kinds, so the jobs get those kinds' defaults (max_attempts, queue...), as an
    application's enqueue would. Enqueued before, they got the global defaults."""
    conn = await _connect(cluster)
    try:
        deadline = time.monotonic() + DAEMON_JOIN_WAIT_S
        while daemon is not None and daemon.poll() is None and time.monotonic() < deadline:
            members, _ = await admin.fleet(conn, SCHEMA)
            if members:
                break
            await asyncio.sleep(0.1)
        ids = await conn.fetchrow(_EXAMPLE_JOBS_SQL)
        _say(f"pgjobd dev: example jobs enqueued: ids {', '.join(map(str, ids))}")
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
  pgjobd enqueue hello '{{"name": "you"}}'          # watch the daemon's log here
  pgjobd enqueue hello '{{"name": "soon"}}' --delay 5s
  {shlex.quote(psql)} "$PGJOBD_DSN" -c 'table pgjobd.job_history'
  {shlex.quote(psql)} "$PGJOBD_DSN" -c "SELECT pgjobd.enqueue('build_report')"

Press Ctrl-C to drain the daemon and stop the server."""
    )


if __name__ == "__main__":
    sys.exit(main())
