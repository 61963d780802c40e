"""`pgjobd check-config` against the handlers: a [[cron]] entry whose kind no handler in
the configured directories defines, or whose args do not convert to the handler's args
type, is a configuration error (exit 78) naming the file, the entry and the problem."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HANDLER = textwrap.dedent(
    """
    from dataclasses import dataclass
    from typing import Literal

    import msgspec

    from pgjobd import job


    @dataclass
    class ReportArgs:
        scope: Literal["all", "today"] = "all"


    class Mail(msgspec.Struct, forbid_unknown_fields=True):
        to: str
        retries: int = 0


    @job
    def build_report(args: ReportArgs) -> None:
        pass


    @job(kind="mail.send")
    def send(args: Mail) -> None:
        pass


    @job
    def anything(args: dict) -> None:
        pass
    """
)


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    return subprocess.run(
        [sys.executable, "-m", "pgjobd", "check-config", "--config", str(path)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def write_config(tmp_path: Path, cron: str) -> Path:
    handlers = tmp_path / "handlers"
    handlers.mkdir(exist_ok=True)
    (handlers / "jobs.py").write_text(HANDLER)
    path = tmp_path / "pgjobd.toml"
    path.write_text('[daemon]\nhandlers = ["handlers"]\n\n' + textwrap.dedent(cron))
    return path


def cron(name: str, kind: str, args: str = "{}") -> str:
    return f'[[cron]]\nname = "{name}"\nschedule = "0 2 * * *"\nkind = "{kind}"\nargs = {args}\n\n'


def test_cron_entries_whose_kinds_and_args_fit_their_handlers_pass(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        cron("nightly", "build_report", '{ scope = "today" }')
        + cron("defaults", "build_report")
        + cron("mail", "mail.send", '{ to = "ops", retries = 3 }')
        + cron("free", "anything", '{ nested = { list = [1, 2.5, "x", true] } }'),
    )

    result = check_config(path)

    assert result.returncode == 0, result.stderr
    assert "build_report" in result.stdout


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        (
            cron("typo", "build_reprot"),
            'cron[0] (name "typo").kind: no handler for kind "build_reprot"',
        ),
        (
            cron("scope", "build_report", '{ scope = "everything" }'),
            "cron[0] (name \"scope\").args: args for kind 'build_report' do not match "
            "ReportArgs: Invalid enum value 'everything' - at `$.scope`",
        ),
        (
            cron("no_to", "mail.send"),
            "cron[0] (name \"no_to\").args: args for kind 'mail.send' do not match Mail: "
            "Object missing required field `to`",
        ),
        (
            cron("wrong_type", "mail.send", '{ to = "ops", retries = "3" }'),
            "Expected `int`, got `str` - at `$.retries`",
        ),
        (
            cron("extra", "mail.send", '{ to = "ops", cc = "boss" }'),
            "Object contains unknown field `cc`",
        ),
    ],
)
def test_a_cron_entry_the_handlers_cannot_run_exits_78_naming_file_entry_and_problem(
    tmp_path: Path, entry: str, problem: str
) -> None:
    path = write_config(tmp_path, entry)

    result = check_config(path)

    assert result.returncode == 78, (result.stdout, result.stderr)
    assert f"{path}: cron[0] (name " in result.stderr
    assert problem in result.stderr
    assert result.stdout == ""


def test_every_bad_entry_is_named_at_once_with_the_handlers_known(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        cron("good", "build_report")
        + cron("unknown", "nope")
        + cron("bad", "build_report", "{ scope = 7 }"),
    )

    result = check_config(path)

    assert result.returncode == 78
    assert 'cron[1] (name "unknown").kind' in result.stderr
    assert "anything, build_report, mail.send" in result.stderr  # what is defined instead
    assert str(tmp_path / "handlers") in result.stderr
    assert 'cron[2] (name "bad").args' in result.stderr
    assert "good" not in result.stderr
