"""Every bench script runs at its smallest sizes and prints the figures it exists for.

Benchmarks live in bench/, outside the suite: they take minutes, print figures and check
no thresholds. Nothing ran them in CI, so a change could break one unnoticed until the
next measurement (bench/flow.py's claim part stopped at its first claim for weeks once
job_claim took a cursor). This smoke keeps them runnable: each entry point in bench/ runs
as its own process, as a person would run it, with sizes that take seconds, in a database
of its own on the session's server (the benches' fixed schema names then never meet a
real run's). It passes when the script exits 0 and its summary lines are printed with
numbers in them. The figures themselves mean nothing at these sizes: nothing is checked
against a target.

`test_every_entry_point_is_smoked` fails when bench/ gains a script this list lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from pgjobd.pgbouncer import PgBouncerError, find_program

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
NUMBER = r"(\d[\d,]*(?:\.\d+)?)"  # a figure as the benches print it: 1,234 or 0.87


@dataclass(frozen=True)
class Bench:
    script: str
    args: tuple[str, ...]
    # Lines (re.MULTILINE) the output must hold; NUMBER groups must read as numbers > 0.
    figures: tuple[str, ...]
    dsn: bool = True  # takes --dsn
    timeout_s: float = 90.0
    needs_pgbouncer: bool = False


BENCHES = [
    Bench("complete_cpu.py", ("--reps", "1", "--jobs", "200"),
          (rf"^now +{NUMBER} ms backend CPU per 50-job call",
           rf"^now / before issue 11: median {NUMBER}$",
           rf"^now / job_finish's rows: median {NUMBER}$")),
    # The baseline is the default commit (exported with git archive): both trees drain.
    # With --floor: bench/floor_chain.py drains too (it runs under this and throughput.py).
    Bench("cpu_per_job.py", ("--reps", "1", "--n", "1000", "--round", "1:20:all", "--floor"),
          (rf"^  total +baseline +{NUMBER} +this +{NUMBER} +ratio +{NUMBER}$",
           rf"^  total ratio per rep: {NUMBER} \(target",
           rf"this / baseline per rep: {NUMBER}; median {NUMBER}$",
           rf"^  total +floor +{NUMBER} +this / floor +{NUMBER} +floor / baseline +{NUMBER}$",
           rf"^  jobs/s floor / this per rep: {NUMBER}; median {NUMBER}$")),
    Bench("enqueue.py", ("--reps", "1", "--n", "200", "--single-n", "20"),
          (rf"^pgjobd enqueue_many, COPY path +200 +{NUMBER} \(",
           rf"^… into the hot table less its guards +200 +{NUMBER} \(",
           rf"^SQL bench_enqueue\.enqueue\(\) ×N, 1 statement +200 +{NUMBER} \(",
           rf"^targets: enqueue_many \(COPY path\) ≥ 100,000 jobs/s: \w+ \(median {NUMBER}\)",
           r"^statements, many_copy: \d+ per run")),
    Bench("failover.py", ("--kills", "1", "--lease", "1s", "--members", "2", "--rate", "4",
                          "--seed", "1"),
          (rf"^new leader +1 +{NUMBER} +{NUMBER} ",
           rf"^orphaned jobs: {NUMBER} ",
           rf"^orphans running again \(per job\) +\d+ +{NUMBER} +{NUMBER} ",
           rf"^enqueued {NUMBER} jobs$")),
    Bench("fair_claim_parts.py", ("--reps", "1", "--n", "500"),
          tuple(rf"^{variant} +{NUMBER} +{NUMBER} +{NUMBER}$"
                for variant in ("fair", "no_fill", "no_scan", "neither", "tenants"))),
    Bench("fanin.py", ("--reps", "1", "--n", "100"),
          (rf"^drain alone: +{NUMBER} jobs/s$",
           rf"^ratio fan-in/alone: median {NUMBER} ",
           rf"^last child -> callback claimed: median {NUMBER} ms",
           rf"^last child -> callback started: median {NUMBER} ms")),
    Bench("finish_cost.py", ("--reps", "1", "--jobs", "200"),
          tuple(rf"{pair} median {NUMBER} " for pair in (
              "lifecycle/0006", "web_console/lifecycle", "web_console/web_console_no_dead_idx",
              "job_move/web_console"))),
    # Its three parts; the drain part in its four setups, so every member config it
    # writes is started once.
    Bench("flow.py", ("--reps", "1", "--parts", "claim,drain,flood", "--n", "500",
                      "--drain-n", "200", "--flood-n", "300", "--probes", "1"),
          (*(rf"^{mode} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}$"
             for mode in ("baseline", "unlimited", "limited", "every_limit", "tenants",
                          "fair")),
           rf"^  global_50 / per_member_25x2: {NUMBER} ",
           rf"^  fair_100 / tenants_100: {NUMBER} ",
           rf"^flood: 1 single jobs .* wait median {NUMBER} ms")),
    # One drain free, the three a hold always has, one after the release; the plans.
    Bench("horizon.py", ("--reps", "1", "--rounds", "1:20:all", "--n", "200", "--free", "1",
                         "--hold", "0", "--recover", "0.1", "--explain"),
          (rf"^p1 c20 all: free {NUMBER} jobs/s; held/free {NUMBER} ",
           rf"best within 0\.1 s {NUMBER}; most dead tuples {NUMBER};",
           rf"^-- job_claim \(p1 c20 all, held \d+ s\): {NUMBER} buffers$",
           r"^  held >= 0\.8 of free: (met|MISSED); claim p99 < 50 ms: (met|MISSED)")),
    Bench("pooler.py", ("--reps", "1", "--n", "200", "--single-n", "20"),
          (rf"^enqueue +{NUMBER}/s +{NUMBER}/s +{NUMBER}/s +direct_nocache {NUMBER}, "
           rf"pgbouncer {NUMBER}$",
           rf"^drain +{NUMBER}/s +- +{NUMBER}/s +pgbouncer {NUMBER}$"),
          needs_pgbouncer=True),
    Bench("scale.py", ("--reps", "1", "--n", "200", "--future", "1000", "--history", "6000",
                       "--round", "1:20:all"),
          (rf"big/empty per rep {NUMBER}$",
           rf"^  claim of {NUMBER} rows touched {NUMBER} buffers \(bound 1250",
           r"^-- job_promote_due on bench_scale_big: \d+ buffers")),
    # --ci: nothing lost or doubled (chaos smoke runs it for 2 minutes on a private
    # cluster); 10 s of soak, the scheduled jobs 5 s ahead.
    Bench("soak.py", ("--minutes", "0.1", "--capacity-n", "1000", "--load", "0.02",
                      "--ahead-s", "5", "--ci"),
          (rf"^capacity {NUMBER} jobs/s; enqueued at {NUMBER}/s for 0\.1 min: {NUMBER} jobs$",
           rf"^throughput, first \d+ s {NUMBER}/s, last \d+ s {NUMBER}/s: ratio {NUMBER} ",
           r"^lost or wrong: none$",
           r"^--ci bounds: held$")),
    # Its own part only: the peers (--peers) are other job queues in virtualenvs of
    # their own (../shared/bench/peers), which CI does not have.
    Bench("throughput.py", ("--reps", "1", "--n", "200", "--rounds", "1:20:all,1:20:all:other",
                            "--trickle", "10", "--peers", "", "--floor",
                            "--floor-variant", "eager=--claimers 3 --share 20 --window-ms 0",
                            "--trickle-round", "1:50:all:other"),
          (rf"^drain p1 c20 all +{NUMBER} ",
           rf"^drain p1 c20 all other +{NUMBER} ",
           rf"^floor p1 c20 all +{NUMBER} .* pgjobd {NUMBER} of it$",
           rf"^floor p1 c20 all \[eager\] +{NUMBER} .* pgjobd {NUMBER} of it$",
           rf"^  server time, ms per 1,000 jobs \(first run; [^)]*\): .* {NUMBER}",
           rf"^raw lifecycle, 2 loops × 50, all +{NUMBER}$",
           rf"^trickle p50 / p99 / max ms +{NUMBER} / {NUMBER} / {NUMBER} ",
           rf"^    after the enqueue p50 / p99 +{NUMBER}.* / {NUMBER}",
           r"^the same with bench/floor_chain\.py in the member's place:$",
           rf"^a bare round trip p50 / p99 +{NUMBER}.* / {NUMBER}.*trickle's spacing\)$",
           r"^targets \(issue 17\):$")),
    Bench("pool_warm.py", ("--reps", "1"),
          (rf"^first claim path read, claim and completion on a cold connection: median "
           rf"{NUMBER} ms",
           rf"^first claim path read, claim and completion on a warmed connection: median "
           rf"{NUMBER} ms",
           rf"^cold / warmed: {NUMBER}$")),
    Bench("web.py", ("--history", "1000", "--live", "100", "--requests", "1",
                     "--drain-jobs", "100", "--rounds", "1", "--refresh-s", "0.5"),
          (rf"^  overview / +server p50 +{NUMBER} ms",
           rf"^  api dead groups 24 h +server p50 +{NUMBER} ms",
           rf"^  /jobs page 1 median {NUMBER} ms, page 100 median {NUMBER} ms: ratio {NUMBER}",
           rf"^  median ratio {NUMBER} ")),
    Bench("worker_boot.py", ("--reps", "1", "--handler-dir", str(REPO / "handlers")),
          (rf"^python -m pgjobd\.worker: to Ready median {NUMBER} ms .* VmRSS at Ready "
           rf"median {NUMBER} MiB .* {NUMBER} modules imported",),
          dsn=False),
]  # fmt: skip


# Programs that a bench runs, smoked through it: script -> the bench that runs it.
HELPER_PROGRAMS = {"floor_chain.py": "cpu_per_job.py and throughput.py (--floor)"}


def entry_points() -> set[str]:
    """The scripts of bench/ that run as programs (the rest are their helper modules),
    less the helper programs a bench runs."""
    return {
        path.name for path in BENCH.glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text() and path.name not in HELPER_PROGRAMS
    }  # fmt: skip


def test_every_entry_point_is_smoked() -> None:
    assert entry_points() == {bench.script for bench in BENCHES}


@contextlib.contextmanager
def own_database(dsn: str) -> Iterator[str]:
    """A database created for one bench on dsn's server, dropped afterwards (with any
    session a killed run left in it)."""
    name = f"bench_smoke_{uuid.uuid4().hex[:12]}"

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f"CREATE DATABASE {name}"))
    try:
        yield urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))
    finally:
        asyncio.run(run(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


def run_script(bench: Bench, extra: list[str], tmpdir: Path) -> subprocess.CompletedProcess[str]:
    """bench/<script> as its own process group, its temporary files under tmpdir: on a
    timeout the whole group (the members it started) is killed, not only the script."""
    env = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    env["TMPDIR"] = str(tmpdir)
    command = [sys.executable, str(BENCH / bench.script), *bench.args, *extra]
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"{bench.script} ran over {bench.timeout_s:g} s:\n{stdout[-3000:]}\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.mark.parametrize("bench", BENCHES, ids=lambda bench: bench.script.removesuffix(".py"))
def test_bench_runs_and_prints_its_figures(bench: Bench, dsn: str, tmp_path: Path) -> None:
    """...and leaves no temporary file behind (bench/web.py left a directory a run)."""
    if bench.needs_pgbouncer:
        try:
            find_program()
        except PgBouncerError as e:
            pytest.skip(f"{bench.script} starts a private PgBouncer: {e}")
    with contextlib.ExitStack() as stack:
        extra = ["--dsn", stack.enter_context(own_database(dsn))] if bench.dsn else []
        done = run_script(bench, extra, tmp_path)

    output = f"exit {done.returncode}\n-- stdout:\n{done.stdout}\n-- stderr:\n{done.stderr[-5000:]}"
    assert done.returncode == 0, output
    for pattern in bench.figures:
        found = re.search(pattern, done.stdout, re.MULTILINE)
        assert found, f"no line matching {pattern!r}:\n{output}"
        for figure in found.groups():
            if figure is not None and figure[0].isdigit():
                assert float(figure.replace(",", "")) > 0, (pattern, found.group(0))
    assert list(tmp_path.iterdir()) == [], "left behind in its temporary directory"
