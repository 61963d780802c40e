"""Rules with one home in SQL: no named statement restates them."""

from __future__ import annotations

import re
from importlib import resources

import pytest


def _statement_files() -> dict[str, str]:
    sql = resources.files("pgjobd").joinpath("sql")
    return {f.name: f.read_text() for f in sql.iterdir() if f.name.endswith(".sql")}


@pytest.mark.parametrize(
    ("rule", "pattern"),
    [
        ("a final record is written by job_move", r"INSERT\s+INTO\s+\S+\.job_history\b"),
    ],
)
def test_named_statements_call_the_one_home(rule: str, pattern: str) -> None:
    offenders = [
        name for name, text in _statement_files().items() if re.search(pattern, text, re.I)
    ]
    assert offenders == [], f"{rule}, but {offenders} write it out themselves"
