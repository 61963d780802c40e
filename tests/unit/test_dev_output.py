"""`pgjobd dev` writes each of its lines in one write: the daemon it starts shares its
output, so a line written in two pieces (print() does, to an unbuffered stream, as under
PYTHONUNBUFFERED) could get a worker's log line between them. Found in CI: the ready
line a reader parsed came with a worker's line glued to its DSN."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.dev import _say


class Writes:
    """A stream that keeps each write apart, as an unbuffered pipe would send them."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n")))
def test_a_line_and_its_end_leave_in_one_write(message: str) -> None:
    stream = Writes()
    _say(message, file=stream)  # type: ignore[arg-type]
    assert stream.writes == [message + "\n"]


def test_standard_output_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Writes()
    monkeypatch.setattr(sys, "stdout", stream)
    _say("pgjobd dev: ready: postgresql://127.0.0.1:54329/pgjobd")
    assert stream.writes == ["pgjobd dev: ready: postgresql://127.0.0.1:54329/pgjobd\n"]
