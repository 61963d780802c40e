"""bench/throughput.py runs a peer's harness with pgjobd's trickle (its length and rate),
so that the two trickles' p99s are of as many jobs. CI has no peers' virtualenvs: a
stand-in "python" records the command it was given."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def throughput(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    import throughput  # noqa: PLC0415  (bench/ is a directory of scripts, not a package)

    peers, harness = tmp_path / "peers", tmp_path / "harness"
    (peers / "stand_in" / "bin").mkdir(parents=True)
    harness.mkdir()
    (harness / "bench_stand_in.py").write_text("")
    python = peers / "stand_in" / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "argv"}\n')
    python.chmod(0o755)
    monkeypatch.setattr(throughput, "PEERS_DIR", peers)
    monkeypatch.setattr(throughput, "PEERS_HARNESS", harness)
    return throughput


@pytest.mark.parametrize(("trickle", "rate"), [(1000, 100.0), (50, 25.0), (0, 100.0)])
def test_a_peer_runs_the_trickle_pgjobd_runs(
    throughput: ModuleType, tmp_path: Path, trickle: int, rate: float
) -> None:
    throughput.run_peer("stand_in", 1, 2000, tmp_path / "out.jsonl",
                        "postgresql://root@127.0.0.1:5432/test",
                        trickle=trickle, trickle_rate=rate)  # fmt: skip
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("--trickle") + 1] == str(trickle)
    assert float(argv[argv.index("--trickle-rate") + 1]) == rate
    assert argv[argv.index("--n") + 1] == "2000"
    assert "--fresh-db" in argv  # (the first rep)


def test_a_member_started_by_the_bench_imports_what_pythonpath_names(
    throughput: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Started from the repository's root, `python -m pgjobd` would import the
    repository's pgjobd first, whatever PYTHONPATH names (an A/B of two trees)."""
    other = tmp_path / "other_tree" / "pgjobd"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "__main__.py").write_text("import pgjobd, sys\nprint(pgjobd.__file__)\nsys.exit(0)\n")
    monkeypatch.chdir(BENCH.parent)
    monkeypatch.setenv("PYTHONPATH", str(other.parent))
    rundir = tmp_path / "run"
    rundir.mkdir()
    member = throughput.Member("postgresql://nowhere/none", rundir, throughput.TRICKLE_ROUND)
    assert member.process.wait(30) == 0
    member.log.close()
    assert (rundir / "member.log").read_text().strip() == str(other / "__init__.py")
    assert f"PYTHONPATH={other.parent}" in throughput.code_state()
