"""The documentation's recipes, run as written.

- docs/operations.md's systemd install steps, followed literally on an empty directory
  tree (every absolute path under a temporary root), give a unit whose ExecStartPre
  `check-config` passes. The steps that need root, the network or systemd are stood in
  for by shell functions: useradd, runuser (runs the command as the test's user),
  systemctl (logged), `install -g` (group dropped) and the virtualenv with its `pip
  install .` (its `pgjobd` runs the test's own interpreter, which has pgjobd installed).
- README.md's Python blocks compile; the handler example loads from a handler directory
  and registers its kind; the client example and the SQL block run against the test
  database (the DSN and the schema name substituted).
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


def test_the_readme_python_blocks_compile() -> None:
    blocks = fenced_blocks(README.read_text(), "python")

    assert len(blocks) >= 2
    for number, block in enumerate(blocks):
        compile(block, f"README.md python block {number}", "exec")


def test_the_readme_handler_example_loads_from_a_handler_directory(tmp_path: Path) -> None:
    [block] = [b for b in fenced_blocks(README.read_text(), "python") if "@job" in b]
    (tmp_path / "hello.py").write_text(block)

    registry = load_directories([tmp_path])

    spec = registry["hello"]
    assert (spec.queue, spec.max_attempts, spec.timeout_s) == ("default", 5, 30.0)
    assert spec.args_type.__name__ == "Hello" and spec.takes_ctx and spec.is_async


@pytest.mark.anyio
async def test_the_readme_client_example_runs_against_the_database(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    [block] = [b for b in fenced_blocks(README.read_text(), "python") if "Client.connect" in b]
    code, replaced = re.subn(
        r'Client\.connect\("[^"]*"', f"Client.connect({dsn!r}, schema={schema!r}", block
    )
    assert replaced == 1

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
