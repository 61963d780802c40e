"""The previous release (tag v0.1.0), installed once into a virtualenv of its own, for
the upgrade rehearsal. The install is cached under .cache/releases/<commit>/ in the
repository (PGJOBD_RELEASE_CACHE overrides it), keyed by the commit, so a CI run pays
for it once however many times the suite runs."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREVIOUS_TAG = "v0.1.0"
# The tag's commit, for clones that fetched no tags.
PREVIOUS_COMMIT = "aa5b025739a3e015f658036ee6cfa238851a863a"


class Unavailable(Exception):
    """The previous release cannot be installed here (not a git checkout, no commit)."""


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=False)


def previous_commit() -> str:
    """The previous release's commit: its tag's, else the recorded hash if present."""
    for ref in (f"{PREVIOUS_TAG}^{{commit}}", f"{PREVIOUS_COMMIT}^{{commit}}"):
        found = _git("rev-parse", "--verify", "--quiet", ref)
        if found.returncode == 0:
            return found.stdout.decode().strip()
    raise Unavailable(
        f"neither tag {PREVIOUS_TAG} nor commit {PREVIOUS_COMMIT} is in {REPO} "
        "(a shallow clone? fetch with --tags or full depth)"
    )


def cache_root() -> Path:
    return Path(os.environ.get("PGJOBD_RELEASE_CACHE", REPO / ".cache" / "releases"))


def install_previous_release() -> Path:
    """The `pgjobd` executable of the previous release, installing it if needed."""
    commit = previous_commit()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / commit
    executable = target / "venv" / "bin" / "pgjobd"
    with (root / f"{commit}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be installing it
        if (target / "installed").exists():
            return executable
        shutil.rmtree(target, ignore_errors=True)
        source = target / "src"
        source.mkdir(parents=True)
        with tempfile.TemporaryFile() as archive:
            made = subprocess.run(
                ["git", "-C", str(REPO), "archive", "--format=tar", commit],
                stdout=archive, stderr=subprocess.PIPE, check=False,
            )  # fmt: skip
            if made.returncode != 0:
                raise Unavailable(f"git archive {commit}: {made.stderr.decode().strip()}")
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(source, filter="data")
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(target / "venv")], check=True)
        subprocess.run(
            [str(target / "venv" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
             str(source)], check=True,
        )  # fmt: skip
        (target / "installed").write_text(commit + "\n")
    return executable
