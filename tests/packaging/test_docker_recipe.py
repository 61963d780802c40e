"""The container recipe in docker/, checked without a Docker engine (none runs on the
project's CI machines): the Dockerfile and compose.yaml are read and their settings
checked against each other and against the container config, the build stage's files
are built into a wheel, and the image's entrypoint command is run directly: `pgjobd
check-config` with the container config, and `pgjobd migrate` then `pgjobd run` against
the test database, probed with the image's own HEALTHCHECK command.

PyYAML is not a dependency, so compose.yaml is read by indentation and regexes: enough
for the file as written (block mappings, anchors and `<<:` merges)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from pgjobd import config
from pgjobd.duration import parse_duration

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"
COMPOSE = DOCKER / "compose.yaml"
PROMETHEUS = DOCKER / "prometheus.yml"
CONTAINER_CONFIG = DOCKER / "pgjobd.toml"
MEMBERS = ("pgjobd-1", "pgjobd-2", "pgjobd-3")
HANDLERS_IN_IMAGE = "/srv/pgjobd/handlers"
CONFIG_IN_IMAGE = "/etc/pgjobd/pgjobd.toml"


# -- the Dockerfile ---------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of its FROM; -1 before the first FROM (global ARGs)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comment lines dropped (as Docker
    does, also inside a continued instruction)."""
    instructions: list[Instruction] = []
    stage, pending = -1, ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        pending = ""
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, " ".join(args.split()), stage))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


DF = parse_dockerfile(DOCKERFILE.read_text())
STAGES = [i for i in DF if i.keyword == "FROM"]
FINAL = len(STAGES) - 1


def stage_named(name: str) -> int:
    for index, instruction in enumerate(STAGES):
        if instruction.args.split()[-2:] == ["AS", name] or instruction.args.endswith(
            f" as {name}"
        ):
            return index
    raise AssertionError(f"no stage named {name}")


def instructions(keyword: str, stage: int | None = None) -> list[Instruction]:
    return [i for i in DF if i.keyword == keyword and (stage is None or i.stage == stage)]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    assert all(isinstance(item, str) for item in value), args
    return value


def env(stage: int) -> dict[str, str]:
    values: dict[str, str] = {}
    for instruction in instructions("ENV", stage):
        for word in shlex.split(instruction.args):
            key, _, value = word.partition("=")
            values[key] = value
    return values


def entrypoint_argv() -> list[str]:
    """What the image runs: ENTRYPOINT + CMD of the final stage (the last of each)."""
    (*_, entrypoint) = instructions("ENTRYPOINT", FINAL)
    (*_, cmd) = instructions("CMD", FINAL)
    return exec_form(entrypoint.args) + exec_form(cmd.args)


def pgjobd_command(argv: list[str]) -> list[str]:
    """The image's `tini -- pgjobd ...` as run here: tini dropped (it only forwards
    signals and reaps) and `pgjobd` this interpreter's, as the venv's script would be."""
    assert argv[:2] == ["tini", "--"], argv
    assert argv[2] == "pgjobd", argv
    return [sys.executable, "-m", "pgjobd", *argv[3:]]


def test_dockerfile_has_a_build_stage_and_a_final_stage_on_slim_python() -> None:
    (version,) = [i.args for i in instructions("ARG", -1) if i.args.startswith("PYTHON_VERSION=")]
    python = version.partition("=")[2]
    assert python in ("3.11", "3.12")
    assert len(STAGES) >= 2
    for stage in STAGES:
        image = stage.args.split()[0].replace("${PYTHON_VERSION}", python)
        assert re.fullmatch(rf"python:{re.escape(python)}-slim(-\w+)?", image), stage.args
    build = stage_named("build")
    assert build != FINAL
    assert any("pip wheel" in i.args for i in instructions("RUN", build))


def test_final_stage_installs_from_the_wheels_and_carries_no_build_tools() -> None:
    runs = " ".join(i.args for i in instructions("RUN", FINAL))
    assert "--mount=type=bind,from=build" in runs or instructions("COPY", FINAL)
    assert re.search(r"pip install --no-index --find-links /wheels pgjobd\b", runs)
    for tool in ("build-essential", "gcc", "make", "libpq-dev", "python3-dev"):
        assert not re.search(rf"\b{tool}\b", runs), f"{tool} in the final stage"
    # tini comes from Debian's package, in the image that runs it.
    assert re.search(r"apt-get install -y --no-install-recommends tini\b", runs)
    assert "rm -rf /var/lib/apt/lists/*" in runs


def test_final_stage_runs_as_a_non_root_user() -> None:
    (*_, user) = instructions("USER", FINAL)
    name, _, group = user.args.partition(":")
    assert name not in ("root", "0") and group not in ("root", "0")
    runs = " ".join(i.args for i in instructions("RUN", FINAL))
    created = re.search(rf"useradd [^&]*--uid (\d+) [^&]*\b{re.escape(name)}\b", runs)
    assert created, f"user {name} not created in the final stage"
    assert int(created[1]) >= 1000


def test_entrypoint_is_tini_then_pgjobd_run_and_sigterm_stops_it() -> None:
    assert entrypoint_argv() == ["tini", "--", "pgjobd", "run"]
    (stop,) = instructions("STOPSIGNAL", FINAL)
    assert stop.args == "SIGTERM"
    (expose,) = instructions("EXPOSE", FINAL)
    port = config.load(CONTAINER_CONFIG).daemon.metrics_address
    assert port is not None and expose.args.split() == [str(port[1])] == ["9464"]


def test_healthcheck_asks_healthz_with_python_not_curl() -> None:
    (check,) = instructions("HEALTHCHECK", FINAL)
    options, _, command = check.args.partition("CMD ")
    assert all(re.fullmatch(r"--[a-z-]+=\w+", o) for o in options.split()), options
    argv = exec_form(command)
    assert argv[:2] == ["python", "-c"] and len(argv) == 3
    compile(argv[2], "<HEALTHCHECK>", "exec")
    assert "curl" not in check.args and "wget" not in check.args
    assert "PGJOBD_HEALTH_URL" in argv[2]
    url = env(FINAL)["PGJOBD_HEALTH_URL"]
    address = config.load(CONTAINER_CONFIG).daemon.metrics_address
    assert address is not None
    assert url == f"http://127.0.0.1:{address[1]}/healthz"


def test_image_config_is_the_container_config_and_the_handler_dir_exists() -> None:
    assert env(FINAL)["PGJOBD_CONFIG"] == CONFIG_IN_IMAGE
    copies = [i.args.split() for i in instructions("COPY", FINAL)]
    assert ["docker/pgjobd.toml", CONFIG_IN_IMAGE] in copies
    runs = " ".join(i.args for i in instructions("RUN", FINAL))
    assert re.search(rf"mkdir -p [^&]*{re.escape(HANDLERS_IN_IMAGE)}\b", runs)


def test_every_copied_file_exists_and_is_in_the_build_context() -> None:
    # The context is the repository root (compose.yaml: context ..); the ignore file
    # excludes everything, then lets back what the Dockerfile copies.
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]  # fmt: skip
    assert patterns[0] == "**"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for copy in instructions("COPY"):
        words = [w for w in copy.args.split() if not w.startswith("--")]
        if any(w.startswith("--from") for w in copy.args.split()):
            continue
        for source in words[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert source.rstrip("/") in allowed, f"COPY {source}: excluded by {DOCKERIGNORE}"


def test_container_config_loads_and_matches_the_image() -> None:
    cfg = config.load(CONTAINER_CONFIG)
    assert cfg.daemon.handlers == (Path(HANDLERS_IN_IMAGE),)
    assert cfg.daemon.metrics_address == ("0.0.0.0", 9464)
    assert cfg.daemon.log_format == "json"
    assert cfg.dsn is None  # from $PGJOBD_DSN, never baked into the image


# -- compose.yaml and prometheus.yml ----------------------------------------------------


def _strip_comments(text: str) -> str:
    return "\n".join(
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )


COMPOSE_TEXT = _strip_comments(COMPOSE.read_text())


def children(block: str) -> dict[str, str]:
    """The keys of a block mapping at its outermost indentation, each with its body."""
    lines = block.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    result: dict[str, str] = {}
    key = None
    for line in lines:
        depth = len(line) - len(line.lstrip())
        if depth == indent:
            match = re.match(r"\s*([\w.-]+|\"[^\"]+\"|<<):(.*)$", line)
            assert match, f"not a mapping key: {line!r}"
            key = match[1].strip('"')
            result[key] = match[2].strip() + "\n"
        else:
            assert depth > indent and key is not None, f"bad indentation: {line!r}"
            result[key] += line + "\n"
    return result


TOP = children(COMPOSE_TEXT)
SERVICES = children(TOP["services"].split("\n", 1)[1])


def resolved(body: str) -> str:
    """A service's text with the anchors it merges (`<<: *name`), recursively."""
    anchors = {
        m[1]: value.split("\n", 1)[1]
        for value in TOP.values()
        if (m := re.match(r"&([\w-]+)\s*$", value.split("\n", 1)[0]))
    }
    merged = body
    for name in re.findall(r"<<:\s*\*([\w-]+)", body):
        merged += resolved(anchors[name])
    return merged


def test_compose_runs_postgres_migrate_three_members_and_prometheus() -> None:
    assert set(SERVICES) == {"postgres", "migrate", *MEMBERS, "prometheus"}
    assert re.search(r"^\s*image: postgres:(16|17)\b", SERVICES["postgres"], re.M)
    assert re.search(r"healthcheck:\s+test: \[\"CMD\", \"pg_isready\"", SERVICES["postgres"])
    assert re.search(r"- pgdata:/var/lib/postgresql/data\b", SERVICES["postgres"])
    assert "pgdata" in children(TOP["volumes"].split("\n", 1)[1])
    assert "init: true" not in COMPOSE_TEXT  # the image's tini is PID 1


def test_compose_migrates_once_postgres_is_healthy() -> None:
    migrate = resolved(SERVICES["migrate"])
    assert re.search(r'^\s*command: \["migrate"\]', migrate, re.M)
    assert re.search(r"depends_on:\s+postgres:\s+condition: service_healthy", migrate)
    assert re.search(r'restart: "no"', migrate)


def test_compose_members_wait_for_the_migration_and_get_time_to_drain() -> None:
    drain = config.load(CONTAINER_CONFIG).daemon.drain_timeout
    hostnames = set()
    for name in MEMBERS:
        member = resolved(SERVICES[name])
        assert re.search(r'^\s*command: \["run"\]', member, re.M)
        assert re.search(
            r"depends_on:\s+migrate:\s+condition: service_completed_successfully", member
        )
        (grace,) = re.findall(r"stop_grace_period: (\S+)", member)
        assert parse_duration(grace) >= drain + parse_duration("10s")
        assert re.search(r"stop_signal: SIGTERM", member)
        assert re.search(r"image: pgjobd:local", member)
        hostnames.update(re.findall(r"hostname: (\S+)", member))
    assert hostnames == set(MEMBERS)  # `pgjobd status` tells them apart


def test_compose_builds_this_dockerfile_and_mounts_config_and_handlers() -> None:
    base = resolved(SERVICES["pgjobd-1"])
    context = re.search(r"build:\s+context: (\S+)\s+dockerfile: (\S+)", base)
    assert context, base
    assert (DOCKER / context[1]).resolve() == REPO
    assert (REPO / context[2]).resolve() == DOCKERFILE
    assert re.search(r"PGJOBD_DSN: postgresql://\S+@postgres:5432/\S+", base)
    mounts = dict(
        (target, source) for source, target in re.findall(r"- (\.\.?/[^:\s]+):([^:\s]+):ro", base)
    )
    assert (DOCKER / mounts[CONFIG_IN_IMAGE]).resolve() == CONTAINER_CONFIG
    assert (DOCKER / mounts[HANDLERS_IN_IMAGE]).resolve() == REPO / "handlers"


def test_compose_bind_mount_sources_exist() -> None:
    # A missing source would be created by Docker as an empty directory.
    sources = re.findall(r"^\s*- (\.\.?/[^:\s]+):", COMPOSE_TEXT, re.M)
    assert sources
    for source in sources:
        assert (DOCKER / source).exists(), f"compose.yaml mounts {source}: missing"


def test_prometheus_scrapes_every_member_and_loads_the_alert_rules() -> None:
    text = _strip_comments(PROMETHEUS.read_text())
    address = config.load(CONTAINER_CONFIG).daemon.metrics_address
    assert address is not None
    targets = set(re.findall(r"^\s*- ([\w-]+:\d+)\s*$", text, re.M))
    assert targets == {f"{name}:{address[1]}" for name in MEMBERS}
    (rules,) = re.findall(r"rule_files:\s+- (\S+)", text)
    prometheus = SERVICES["prometheus"]
    assert re.search(rf"- \.\./docs/alerts\.yml:{re.escape(rules)}:ro", prometheus)
    assert re.search(r"- \./prometheus\.yml:/etc/prometheus/prometheus\.yml:ro", prometheus)


# -- running what the image runs --------------------------------------------------------


def local_config(tmp_path: Path, *, schema: str | None = None, port: int | None = None) -> Path:
    """The container config with the image's paths swapped for this machine's."""
    text = CONTAINER_CONFIG.read_text()
    swaps = [(rf'handlers = \["{HANDLERS_IN_IMAGE}"\]', f'handlers = ["{REPO / "handlers"}"]')]
    if schema is not None:
        swaps.append((r'schema = "pgjobd"', f'schema = "{schema}"'))
    if port is not None:
        swaps.append((r'metrics_listen = "0\.0\.0\.0:9464"', f'metrics_listen = "0.0.0.0:{port}"'))
    for pattern, replacement in swaps:
        text, count = re.subn(pattern, replacement, text)
        assert count == 1, pattern
    path = tmp_path / "pgjobd.toml"
    path.write_text(text)
    return path


def clean_environ(**extra: str) -> dict[str, str]:
    drop = ("PGJOBD_DSN", "DATABASE_URL", "PGJOBD_CONFIG")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def test_image_command_check_config_passes_on_the_container_config(tmp_path: Path) -> None:
    argv = pgjobd_command([*entrypoint_argv()[:-1], "check-config", "--json"])
    result = subprocess.run(
        argv, env=clean_environ(PGJOBD_CONFIG=str(local_config(tmp_path))),
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["handlers"] == [str(REPO / "handlers")]
    assert {"hello", "build_report", "flaky_webhook"} <= set(summary["kinds"])


@pytest.mark.slow
def test_build_stage_files_make_a_wheel_with_the_sql_and_the_script(tmp_path: Path) -> None:
    # What the build stage copies, and nothing else, must be enough for `pip wheel`.
    source = tmp_path / "src"
    for copy in instructions("COPY", stage_named("build")):
        *items, _ = copy.args.split()
        for item in items:
            target = source / item
            if (REPO / item).is_dir():
                shutil.copytree(REPO / item, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / item, target)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "out"), "."],
        cwd=source, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if result.returncode != 0 and "satisfies the requirement setuptools" in result.stdout + (
        result.stderr
    ):
        pytest.skip("no package index reachable for the build requirements (setuptools)")
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "out").glob("pgjobd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    expected = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "pgjobd").rglob("*")
        if path.suffix in (".py", ".sql") and "__pycache__" not in path.parts
    }
    assert expected <= names, sorted(expected - names)
    assert "pgjobd = pgjobd.cli:main" in scripts


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


# The health server (pgjobd/health.py) is being added: run once the daemon serves it.
HEALTH_SERVED = find_spec("pgjobd.health") is not None and bool(
    re.search(
        r"^from pgjobd(\.| import .*\b)health\b", (REPO / "pgjobd/daemon.py").read_text(), re.M
    )
)


@pytest.mark.slow
@pytest.mark.skipif(
    not HEALTH_SERVED,
    reason="the daemon does not serve /healthz yet (pgjobd.health missing or not used by "
    "pgjobd/daemon.py)",
)
def test_image_migrates_runs_answers_its_healthcheck_and_drains(
    dsn: str, schema_name: str, tmp_path: Path
) -> None:
    port = free_port()
    environ = clean_environ(
        PGJOBD_DSN=dsn,
        PGJOBD_CONFIG=str(local_config(tmp_path, schema=schema_name, port=port)),
        PGJOBD_HEALTH_URL=f"http://127.0.0.1:{port}/healthz",
    )
    (check,) = instructions("HEALTHCHECK", FINAL)
    healthcheck = exec_form(check.args.partition("CMD ")[2])
    healthcheck[0] = sys.executable  # the venv's python in the image
    (migrate_cmd,) = re.findall(r"command: (\[.*\])", SERVICES["migrate"])
    try:
        migrated = subprocess.run(
            pgjobd_command([*entrypoint_argv()[:-1], *json.loads(migrate_cmd)]),
            env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert migrated.returncode == 0, migrated.stderr
        log = tmp_path / "member.log"
        with log.open("wb") as out:
            member = subprocess.Popen(
                pgjobd_command(entrypoint_argv()), env=environ, cwd=tmp_path,
                stdout=out, stderr=out,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while True:
                assert member.poll() is None, f"member exited:\n{log.read_text()[-3000:]}"
                probe = subprocess.run(healthcheck, env=environ, capture_output=True, check=False)
                if probe.returncode == 0:
                    break
                assert time.monotonic() < deadline, f"no /healthz:\n{log.read_text()[-3000:]}"
                time.sleep(0.2)
            while http_status(f"http://127.0.0.1:{port}/readyz") != 200:
                assert time.monotonic() < deadline, f"never ready:\n{log.read_text()[-3000:]}"
                time.sleep(0.2)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
                assert b"pgjobd_" in page.read()
            member.send_signal(signal.SIGTERM)  # what tini forwards on `docker stop`
            assert member.wait(timeout=40) == 0, log.read_text()[-3000:]
            # The container config logs JSON, one object a line, for `docker logs`.
            events = [json.loads(line).get("event") for line in log.read_text().splitlines()]
            assert "member.draining" in events
        finally:
            if member.poll() is None:
                member.kill()
                member.wait()
    finally:
        subprocess.run(
            [sys.executable, "-c", DROP_SCHEMA, dsn, schema_name], check=True, timeout=60
        )


DROP_SCHEMA = """
import sys, asyncio, asyncpg
async def main():
    conn = await asyncpg.connect(sys.argv[1])
    await conn.execute(f'DROP SCHEMA IF EXISTS "{sys.argv[2]}" CASCADE')
    await conn.close()
asyncio.run(main())
"""
