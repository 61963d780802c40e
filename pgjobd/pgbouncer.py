"""A private PgBouncer in front of a PostgreSQL server, for tests, benchmarks and chaos
scenarios: the pooler users run in front of pgjobd, with its stock settings.

    with PgBouncer.start("postgresql://root@127.0.0.1:5432/test") as bouncer:
        bouncer.dsn()    # the same database and user, through the pooler

Only what places it on this machine is configured: where it listens (a free port on
127.0.0.1), which server it fronts, how clients log in (trust, as the test servers do)
and the pool mode (transaction by default: what users run). Everything else —
`ignore_startup_parameters`, `max_prepared_statements`, pool sizes, reset queries — is
PgBouncer's default, so pgjobd meets the pooler an operator installed before it came.

PgBouncer refuses to run as root. As root, it is told to drop to `postgres` (or
`nobody`) by its `user` setting, and its files live in a directory that user can read.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Literal, Self
from urllib.parse import urlsplit, urlunsplit

from pgjobd.embedded import free_port
from pgjobd.errors import PgjobdError

PoolMode = Literal["session", "transaction", "statement"]
_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_UNPRIVILEGED_USERS = ("postgres", "nobody")


class PgBouncerError(PgjobdError):
    """PgBouncer is not installed, or could not be started."""


def find_program() -> str:
    program = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if program is None:
        raise PgBouncerError("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    return program


class PgBouncer:
    """A running PgBouncer; stop() (or the with block's end) ends it and removes its
    files."""

    def __init__(
        self, process: subprocess.Popen[bytes], server_dsn: str, port: int, directory: Path
    ) -> None:
        self.process = process
        self.server_dsn = server_dsn
        self.port = port
        self.directory = directory

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log(self) -> str:
        return (self.directory / "pgbouncer.log").read_text(errors="replace")

    @classmethod
    def start(
        cls, server_dsn: str, *, pool_mode: PoolMode = "transaction", port: int | None = None
    ) -> PgBouncer:
        """A PgBouncer on `port` (else a free port) of 127.0.0.1 in front of the server
        of `server_dsn` (a postgresql:// URL), in `pool_mode`."""
        program = find_program()
        url = urlsplit(server_dsn)
        if url.scheme not in ("postgresql", "postgres") or not url.hostname:
            raise PgBouncerError(
                f"server DSN: expected a postgresql://user@host:port/db URL, got {server_dsn!r}"
            )
        user = url.username or pwd.getpwuid(os.getuid()).pw_name
        directory = Path(tempfile.mkdtemp(prefix="pgjobd-pgbouncer-"))
        run_as = _unprivileged_user() if os.geteuid() == 0 else None
        port = port or free_port()
        lines = [
            "[databases]",
            f"* = host={url.hostname} port={url.port or 5432}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {directory / 'users.txt'}",
            f"pool_mode = {pool_mode}",
        ]
        if run_as is not None:
            lines.append(f"user = {run_as}")
        (directory / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
        (directory / "users.txt").write_text(f'"{user}" ""\n')
        # Readable by the user PgBouncer drops to; it writes nothing here (it logs to
        # stderr, kept in pgbouncer.log by this process).
        directory.chmod(0o755)
        for path in directory.iterdir():
            path.chmod(0o644)
        with (directory / "pgbouncer.log").open("wb") as log:
            process = subprocess.Popen(
                [program, str(directory / "pgbouncer.ini")],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        bouncer = cls(process, server_dsn, port, directory)
        try:
            bouncer._wait_ready()
        except BaseException:
            bouncer.stop()
            raise
        return bouncer

    def dsn(self, database: str | None = None) -> str:
        """The server DSN's user and database (or `database`), through this pooler."""
        url = urlsplit(self.server_dsn)
        netloc = f"{url.username}@" if url.username else ""
        path = f"/{database}" if database is not None else url.path
        return urlunsplit(("postgresql", f"{netloc}127.0.0.1:{self.port}", path, url.query, ""))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise PgBouncerError(
                    f"pgbouncer exited with status {self.process.returncode}:\n{self.log[-2000:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise PgBouncerError(
                        f"pgbouncer did not listen on port {self.port} within "
                        f"{_READY_TIMEOUT_S:.0f}s:\n{self.log[-2000:]}"
                    ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Immediate shutdown (SIGTERM: clients are disconnected), then the files go."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _unprivileged_user() -> str:
    for name in _UNPRIVILEGED_USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise PgBouncerError(
        f"running as root, and none of the users {', '.join(_UNPRIVILEGED_USERS)} exists "
        "for pgbouncer to drop to"
    )
