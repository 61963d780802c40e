"""Typed enqueue, statically: mypy accepts tests/typing/typed_enqueue_ok.py and reports
each mistake in tests/typing/typed_enqueue_bad.py on the line marked `# error`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLES = Path(__file__).parent.parent / "typing"

pytestmark = pytest.mark.slow


def _mypy(path: Path) -> tuple[int, str]:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
         "--cache-dir", str(SAMPLES.parent.parent / ".mypy_cache"), str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def test_correct_typed_enqueues_check_clean() -> None:
    code, output = _mypy(SAMPLES / "typed_enqueue_ok.py")
    assert code == 0, output


def test_each_mistake_is_reported_on_its_line() -> None:
    path = SAMPLES / "typed_enqueue_bad.py"
    marked = {
        number for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.endswith("# error")
    }  # fmt: skip
    code, output = _mypy(path)
    assert code == 1, output
    reported = {int(n) for n in re.findall(rf"{re.escape(path.name)}:(\d+): error", output)}
    assert reported == marked, output
