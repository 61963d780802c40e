"""The documentation's recipes, run as written.

- docs/operations.md's systemd install steps, followed literally on an empty directory
  tree (every absolute path under a temporary root), give a unit whose ExecStartPre
  `check-config` passes. The steps that need root, the network or systemd are stood in
  for by shell functions: useradd, runuser (runs the command as the test's user),
  systemctl (logged), `install -g` (group dropped) and the virtualenv with its `pip
  install .` (its `pgjobd` runs the test's own interpreter, which has pgjobd installed).
- Every Python block of README.md and docs/*.md runs: as a script against the test
  database (the DSN and the schema name substituted), or, for the test modules of
  docs/testing.md, as the test suite that page describes, in a pytest process of its
  own. The README's handler example loads from a handler directory and registers its
  kind, its client example and SQL block write what they say, and its middleware runs
  around a handler.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd.handler_loader import load_directories

REPO = Path(__file__).resolve().parents[2]
OPERATIONS = REPO / "docs" / "operations.md"
README = REPO / "README.md"
TESTING = REPO / "docs" / "testing.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
# A DSN in an example's connect call (Client.connect, SyncClient).
CONNECT = re.compile(r'(Client\.connect|SyncClient)\("[^"]*"')
# Paths of the install steps and the unit that move under the temporary root.
ROOTED = re.compile(r"(?<![\w./-])/(etc|opt|srv|var/lib|usr/local)(?=/|\b)")
# systemd's default PATH for services.
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

STAND_INS = r"""
set -euo pipefail
useradd() { :; }
systemctl() { echo "systemctl $*" >> "$ROOT/systemctl.log"; }
runuser() { while [ "$1" != "--" ]; do shift; done; shift; "$@"; }
install() {
    local kept=()
    while [ $# -gt 0 ]; do
        case "$1" in -g|-o) shift 2 ;; *) kept+=("$1"); shift ;; esac
    done
    command install "${kept[@]}"
}
python3() {
    [ "$1 $2" = "-m venv" ] || { echo "python3 $*: not stood in for" >&2; return 1; }
    mkdir -p "$3/bin" && cp "$STUBS/pip" "$3/bin/pip"
}
"""

PIP = """#!/bin/sh
# Stands in for `pip install .`: writes the console script, running the test's Python.
[ "$1" = install ] || exit 1
bin=$(dirname "$0")
printf '#!/bin/sh\\nexec {python} -m pgjobd "$@"\\n' > "$bin/pgjobd"
chmod 0755 "$bin/pgjobd"
"""


def fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the ```language blocks, dedented (list items indent them)."""
    pattern = re.compile(rf"^([ \t]*)```{language}\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
    return [textwrap.dedent(m[2]) for m in pattern.finditer(text)]


def rooted(text: str, root: Path) -> str:
    return ROOTED.sub(lambda m: f"{root}/{m[1]}", text)


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_the_systemd_install_steps_give_a_unit_whose_check_config_passes(tmp_path: Path) -> None:
    [steps] = [b for b in fenced_blocks(OPERATIONS.read_text(), "sh") if "systemctl enable" in b]
    root = tmp_path / "root"
    for skeleton in ("usr/local/bin", "usr/local/sbin", "etc/systemd/system", "opt", "srv"):
        (root / skeleton).mkdir(parents=True)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "pip").write_text(PIP.replace("{python}", sys.executable))
    (stubs / "pip").chmod(0o755)
    assert shutil.which("pgjobd", path=SYSTEMD_PATH) is None  # only the installed one

    done = subprocess.run(
        ["bash", "-c", STAND_INS + rooted(steps, root)], cwd=REPO, capture_output=True,
        text=True, timeout=120, check=False,
        env={"PATH": rooted(SYSTEMD_PATH, root), "ROOT": str(root), "STUBS": str(stubs),
             "HOME": str(tmp_path)},
    )  # fmt: skip

    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "OK" in done.stdout  # the steps' own check-config
    assert "enable --now pgjobd" in (root / "systemctl.log").read_text()

    # Now what the installed unit runs before starting: its environment, its command.
    unit = unit_settings(root / "etc/systemd/system/pgjobd.service")
    env = {"PATH": rooted(SYSTEMD_PATH, root)}
    for assignment in unit["Environment"]:
        key, value = rooted(assignment, root).split("=", 1)
        env[key] = value
    for env_file in unit["EnvironmentFile"]:
        path = Path(rooted(env_file.removeprefix("-"), root))
        if path.exists():
            for line in path.read_text().splitlines():
                key, value = line.split("=", 1)
                env[key] = value
    [pre] = unit["ExecStartPre"]
    handlers = root / "srv/pgjobd/handlers"
    for protected in ("/home", "/root", "/run/user"):  # ProtectHome=yes hides these
        assert not str(handlers).startswith(protected) or str(tmp_path).startswith(protected)

    checked = subprocess.run(
        pre.lstrip("-+!@").split(), cwd="/", env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip

    assert checked.returncode == 0, checked.stderr
    assert f"config: {root}/etc/pgjobd/pgjobd.toml: OK" in checked.stdout
    assert "DSN from: $PGJOBD_DSN" in checked.stdout
    assert str(handlers) in checked.stdout
    assert "build_report" in checked.stdout  # the example [[cron]] table's kind


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) of every Python block of the docs, but docs/testing.md's test
    modules (which test_the_testing_page_example_suite_passes runs)."""
    found = []
    for path in DOCS:
        for number, block in enumerate(fenced_blocks(path.read_text(), "python")):
            if path == TESTING and "def test_" in block:
                continue
            found.append((f"{path.relative_to(REPO)} python block {number}", block))
    return found


def with_database(code: str, dsn: str, schema: str) -> str:
    return CONNECT.sub(lambda m: f"{m[1]}({dsn!r}, schema={schema!r}", code)


@pytest.mark.anyio
@pytest.mark.parametrize(("where", "code"), python_blocks(), ids=lambda v: v[:60])
async def test_every_python_block_of_the_docs_runs(
    where: str, code: str, dsn: str, schema: str, tmp_path: Path
) -> None:
    script = tmp_path / "example.py"
    script.write_text(with_database(code, dsn, schema))

    result = await anyio.run_process([sys.executable, str(script)], check=False, cwd=tmp_path)

    assert result.returncode == 0, f"{where}:\n{result.stderr.decode()}"


def test_the_testing_page_example_suite_passes(
    pytester: pytest.Pytester, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/testing.md's worked example, laid out as it says: the handler module in
    jobs/, the ini option in pyproject.toml, the tests in tests/; run by pytest."""
    text = TESTING.read_text()
    [handler] = [b for b in fenced_blocks(text, "python") if "@job" in b]
    [tests] = [b for b in fenced_blocks(text, "python") if "def test_" in b]
    [ini] = fenced_blocks(text, "toml")
    (pytester.path / "jobs").mkdir()
    (pytester.path / "jobs" / "signup.py").write_text(handler)
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_signup.py").write_text(tests)
    (pytester.path / "pyproject.toml").write_text(ini)
    monkeypatch.setenv("PGJOBD_TEST_DSN", dsn)
    monkeypatch.delenv("PGJOBD_CONFIG", raising=False)

    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "tests")

    result.assert_outcomes(passed=2)


@pytest.mark.anyio
async def test_the_readme_middleware_runs_around_a_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pgjobd import job  # noqa: PLC0415
    from pgjobd.testing import run_job  # noqa: PLC0415

    [block] = [b for b in fenced_blocks(README.read_text(), "python") if "call_next" in b]
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md middleware", "exec"), namespace)

    @job
    async def greet(args: dict[str, str]) -> str:
        return f"hi {args['name']}"

    with caplog.at_level("INFO", logger="pgjobd.job"):
        timing = namespace["timing"]
        outcome = await run_job(greet, {"name": "Ada"}, middleware=[timing])  # type: ignore[list-item]

    assert outcome.result == "hi Ada"
    assert any(re.fullmatch(r"greet took \d+\.\d{3}s", r.getMessage()) for r in caplog.records)


def test_the_readme_handler_example_loads_from_a_handler_directory(tmp_path: Path) -> None:
    [block] = [b for b in fenced_blocks(README.read_text(), "python") if "def hello" in b]
    (tmp_path / "hello.py").write_text(block)

    registry = load_directories([tmp_path])

    spec = registry["hello"]
    assert (spec.queue, spec.max_attempts, spec.timeout_s) == ("default", 5, 30.0)
    assert spec.args_type.__name__ == "Hello" and spec.takes_ctx and spec.is_async


@pytest.mark.anyio
async def test_the_readme_client_example_runs_against_the_database(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    [block] = [
        b for b in fenced_blocks(README.read_text(), "python")
        if "Client.connect" in b and "JobSpec" in b
    ]  # fmt: skip
    code = with_database(block, dsn, schema)

    result = await anyio.run_process([sys.executable, "-c", code], check=False)

    assert result.returncode == 0, result.stderr.decode()
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE kind = 'hello'") == 3


@pytest.mark.anyio
async def test_the_readme_sql_block_runs_against_the_database(
    conn: asyncpg.Connection, schema: str
) -> None:
    [block] = fenced_blocks(README.read_text(), "sql")

    for statement in block.replace("pgjobd.", f"{schema}.").split(";"):
        if statement.strip():
            await conn.fetch(statement)

    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE kind = 'hello'") == 4
