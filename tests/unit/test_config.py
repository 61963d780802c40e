from __future__ import annotations

import json
import math
import re
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.config import (
    Config,
    CronEntry,
    DaemonConfig,
    DatabaseConfig,
    QueueConfig,
    WebConfig,
    apply_overrides,
    load,
    loads,
    resolve_config_path,
)
from pgjobd.duration import format_duration
from pgjobd.errors import ConfigError
from pgjobd.handler_api import ArgsError, job, validate_args
from pgjobd.handler_loader import Registry, check_cron

REPO = Path(__file__).resolve().parents[2]
FILE = Path("/srv/app/pgjobd.toml")  # for loads(): named in errors, never read
CRON = 'name = "nightly"\nschedule = "0 2 * * *"\nkind = "build_report"\n'


def config_error(text: str, path: Path = FILE) -> str:
    """The message of the ConfigError that `text` gives; it must start with the file."""
    with pytest.raises(ConfigError) as caught:
        loads(text, path)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    return message


def write(directory: Path, text: str, name: str = "pgjobd.toml") -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


# --- whole files -------------------------------------------------------------------------


def test_no_file_gives_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load(None)
    assert config.source is None
    assert config.dsn is None
    assert config.database == DatabaseConfig()
    assert config.database.schema == "pgjobd"
    assert config.daemon.handlers == (tmp_path / "handlers",)
    assert config.daemon.lease == timedelta(seconds=30)
    assert config.daemon.drain_timeout == timedelta(seconds=30)
    assert config.daemon.metrics_address == ("127.0.0.1", 9464)
    assert config.queues == {"default": QueueConfig()}
    assert config.cron == ()


def test_empty_file_gives_the_defaults() -> None:
    config = loads("", FILE)
    assert config.source == FILE
    assert config.queues == {"default": QueueConfig()}
    assert config.daemon.handlers == (FILE.parent / "handlers",)


def test_queue_defaults() -> None:
    queue = QueueConfig()
    assert (queue.concurrency, queue.processes, queue.max_attempts, queue.max_crashes) == (
        20,
        2,
        20,
        3,
    )
    assert queue.timeout == timedelta(minutes=5)
    assert queue.backoff_base == timedelta(seconds=1)
    assert queue.backoff_max == timedelta(hours=1)
    assert queue.cpu_scheduling == "batch"


def test_example_config_loads() -> None:
    config = load(REPO / "config" / "pgjobd.example.toml")
    assert config.dsn == "postgresql://pgjobd@127.0.0.1:5432/app"
    assert config.dsn_source == "database.dsn"
    assert config.daemon.handlers == (REPO / "handlers",)
    assert set(config.queues) == {"default", "email", "api"}
    assert config.queues["email"].concurrency == 50
    assert config.queues["email"].timeout == timedelta(seconds=30)
    api = config.queues["api"]
    assert (api.global_concurrency, api.max_depth) == (10, 100000)
    assert api.rate == (100, timedelta(seconds=1))
    assert config.queues["default"].rate is None
    (nightly,) = config.cron
    assert nightly.name == "nightly-report"
    assert nightly.args == {"scope": "all"}
    assert nightly.zone.key == "Europe/Berlin"
    assert nightly.catch_up == "latest"


def test_example_config_documents_every_key() -> None:
    text = (REPO / "config" / "pgjobd.example.toml").read_text(encoding="utf-8")
    for struct in (DatabaseConfig, DaemonConfig, QueueConfig, CronEntry):
        for field in msgspec.structs.fields(struct):
            written = re.search(rf"^(# )?{field.encode_name} = ", text, re.MULTILINE)
            assert written, f"{struct.__name__}.{field.encode_name} is not in the example"
            # A comment may describe a few keys set one after another (pool_min, pool_max).
            above = text[: written.start()].rstrip("\n").split("\n")
            while above and re.match(r"\w+ = ", above[-1]):
                above.pop()
            assert above[-1].startswith("#"), f"{field.encode_name} has no comment above it"


def test_dev_config_loads() -> None:
    config = load(REPO / "config" / "dev.toml")
    assert config.daemon.handlers == (REPO / "handlers",)
    assert config.daemon.handlers[0].resolve() == REPO / "handlers"
    assert config.dsn is None


def test_default_queue_can_be_configured_and_others_added() -> None:
    config = loads("[queues.default]\nconcurrency = 5\n[queues.email]\nprocesses = 1\n", FILE)
    assert config.queues["default"].concurrency == 5
    assert config.queues["email"] == QueueConfig(processes=1)


def test_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("postgresql://from-file\n", encoding="utf-8")
    path = write(
        tmp_path,
        '[database]\ndsn_file = "secret"\n[daemon]\nhandlers = ["jobs", "/opt/handlers"]\n',
    )
    config = load(path)
    assert config.daemon.handlers == (tmp_path / "jobs", Path("/opt/handlers"))
    assert config.database.dsn_file == tmp_path / "secret"
    assert config.dsn == "postgresql://from-file"
    assert config.dsn_source == "database.dsn_file"


def test_config_is_frozen() -> None:
    config = loads("", FILE)
    with pytest.raises(AttributeError):
        config.daemon = DaemonConfig()  # type: ignore[misc]


# --- errors name the file, the key path and what was expected --------------------------


def test_malformed_toml_gives_line_and_column() -> None:
    message = config_error("[daemon]\nlease = \n")
    assert "invalid TOML" in message
    assert "line 2, column" in message


def test_duplicate_toml_key_is_malformed() -> None:
    assert "invalid TOML" in config_error("[daemon]\nlease = '1s'\nlease = '2s'\n")


@pytest.mark.parametrize(
    ("text", "where", "fragment"),
    [
        # unknown keys, one per level
        ("databse = {}", "databse", "unknown key (did you mean database?)"),
        ("[database]\ndsnfile = 'x'", "database.dsnfile", "did you mean dsn_file?"),
        ("[daemon]\nlease_time = '30s'", "daemon.lease_time", "did you mean lease?"),
        ("[queues.email]\nconcurency = 3", "queues.email.concurency", "unknown key"),
        (f"[[cron]]\n{CRON}when = 1", 'cron[0] (name "nightly").when', "unknown key"),
        # wrong types
        ("database = 1", "database", "expected a table, got an integer (1)"),
        ("[database]\ndsn = 5", "database.dsn", "expected a string, got an integer (5)"),
        ("[database]\npool_max = '9'", "database.pool_max", "expected an integer, got a string"),
        ("[daemon]\nhandlers = 'x'", "daemon.handlers", "expected an array, got a string"),
        ("[daemon]\nhandlers = ['a', 3]", "daemon.handlers[1]", "expected a non-empty path"),
        ("[daemon]\nhandlers = ['']", "daemon.handlers[0]", "expected a non-empty path"),
        ("[daemon]\nlog_format = 3", "daemon.log_format", "expected a string"),
        ("[queues.email]\nconcurrency = true", "queues.email.concurrency", "got a boolean"),
        ("[queues.email]\nconcurrency = 2.5", "queues.email.concurrency", "got a float"),
        ("[queues]\nemail = 5", "queues.email", "expected a table, got an integer (5)"),
        ("queues = 5", "queues", "expected a table of queue tables"),
        (f"[cron]\n{CRON}", "cron", "expected an array of tables (write [[cron]])"),
        ("cron = [1]", "cron[0]", "expected a table, got an integer (1)"),
        (f"[[cron]]\n{CRON}args = [1]", 'cron[0] (name "nightly").args', "expected a table"),
        # missing required keys
        ("[[cron]]\nschedule = '* * * * *'\nkind = 'k'", "cron[0].name", "missing"),
        ("[[cron]]\nname = 'x'\nkind = 'k'", 'cron[0] (name "x").schedule', "missing"),
        # choices
        ("[daemon]\nlog_format = 'xml'", "daemon.log_format", 'one of "json", "text"'),
        ("[daemon]\nlog_level = 'loud'", "daemon.log_level", '"debug", "error"'),
        (
            "[queues.email]\ncpu_scheduling = 'fifo'",
            "queues.email.cpu_scheduling",
            'expected one of "batch", "other", got a string ("fifo")',
        ),
        (
            f"[[cron]]\n{CRON}catch_up = 'some'",
            'cron[0] (name "nightly").catch_up',
            'expected one of "all", "latest", "none", got a string ("some")',
        ),
        # durations
        ("[daemon]\nlease = 30", "daemon.lease", 'duration string like "30s"'),
        ("[daemon]\nlease = '30'", "daemon.lease", "a number needs a unit"),
        ("[daemon]\ndrain_timeout = '30 s'", "daemon.drain_timeout", 'got "30 s"'),
        ("[daemon]\ndrain_timeout = '-5s'", "daemon.drain_timeout", "not negative"),
        ("[daemon]\ndrain_timeout = 00:00:30", "daemon.drain_timeout", "got a time"),
        ("[queues.q]\ntimeout = '5 minutes'", "queues.q.timeout", "expected a duration"),
        ("[queues.q]\ntimeout = '0s'", "queues.q.timeout", 'more than "0s"'),
        ("[database]\nconnect_timeout = '0s'", "database.connect_timeout", 'more than "0s"'),
        ("[database]\nstatement_timeout = '1x'", "database.statement_timeout", "duration"),
        # PostgreSQL refuses 0 (no limit) on no session and more than 2^31 - 1 ms at connect:
        # before the bound these passed the config and stopped the daemon at its first connect.
        ("[database]\nstatement_timeout = '0s'", "database.statement_timeout", 'least "1ms"'),
        ("[database]\nstatement_timeout = '30d'", "database.statement_timeout", "2147483647"),
        (
            "[database]\nidle_in_transaction_session_timeout = '25d'",
            "database.idle_in_transaction_session_timeout",
            "PostgreSQL's limit",
        ),
        ("[daemon]\nlease = '500ms'", "daemon.lease", 'at least "1s", got "500ms"'),
        # constraints and cross-field checks
        ("[queues.q]\nconcurrency = 0", "queues.q.concurrency", "expected an integer >= 1, got 0"),
        ("[queues.q]\nprocesses = 0", "queues.q.processes", ">= 1, got 0"),
        ("[queues.q]\nmax_attempts = -1", "queues.q.max_attempts", ">= 1, got -1"),
        ("[queues.q]\nmax_crashes = 0", "queues.q.max_crashes", ">= 1, got 0"),
        ("[queues.q]\nconcurrency = 10001", "queues.q.concurrency", "<= 10000"),
        ("[queues.q]\nconcurrency = 1", "queues.q.processes", "must not exceed concurrency (1)"),
        (
            "[queues.q]\nbackoff_base = '1m'\nbackoff_max = '30s'",
            "queues.q.backoff_max",
            'must be at least backoff_base ("1m"), got "30s"',
        ),
        ("[database]\npool_min = 5\npool_max = 2", "database.pool_max", "at least pool_min (5)"),
        ("[database]\npool_min = -1", "database.pool_min", ">= 0, got -1"),
        ("[database]\ndsn = ''", "database.dsn", 'expected a non-empty string, got ""'),
        (
            "[database]\ndsn = 'postgresql://a'\ndsn_file = 'b'",
            "database.dsn_file",
            "set database.dsn or database.dsn_file, not both",
        ),
        # names
        ("[database]\nschema = 'Bad-Schema'", "database.schema", "invalid schema name"),
        ("[database]\nschema = '1st'", "database.schema", "invalid schema name"),
        ('[queues."bad name"]', 'queues."bad name"', "invalid queue name 'bad name'"),
        ('[queues."-lead"]', "queues.-lead", "invalid queue name"),
        (
            f"[[cron]]\n{CRON}queue = 'no way'",
            'cron[0] (name "nightly").queue',
            "invalid queue name",
        ),
        (
            "[[cron]]\nname = 'x'\nschedule = '0 * * * *'\nkind = '9lives'",
            'cron[0] (name "x").kind',
            "invalid job kind",
        ),
        (
            "[[cron]]\nname = 'bad name'\nschedule = '0 * * * *'\nkind = 'k'",
            'cron[0] (name "bad name").name',
            'invalid cron name "bad name"',
        ),
        # metrics_listen
        ("[daemon]\nmetrics_listen = 'localhost'", "daemon.metrics_listen", '"host:port"'),
        ("[daemon]\nmetrics_listen = 'h:99999'", "daemon.metrics_listen", "port must be 0-65535"),
        ("[daemon]\nmetrics_listen = '::1:9464'", "daemon.metrics_listen", "[::1]:9464"),
        ("[daemon]\nmetrics_listen = 'h:port'", "daemon.metrics_listen", '"host:port"'),
    ],
)
def test_bad_values_name_file_key_and_expectation(text: str, where: str, fragment: str) -> None:
    message = config_error(text)
    assert message.startswith(f"{FILE}: {where}: "), message
    assert fragment in message


@pytest.mark.parametrize(
    ("schedule", "fragment"),
    [
        ("* * * *", "expected 5 fields"),
        ("0 0 * * * *", "expected 5 fields"),
        ("@every", "expected 5 fields"),
        ("@reboot", "expected 5 fields"),
        ("61 * * * *", "invalid cron schedule"),
        ("*/0 * * * *", "invalid cron schedule"),
        ("a b c d e", "invalid cron schedule"),
        ("H * * * *", "invalid cron schedule"),
        ("0 0 30 2 *", "it never fires"),
    ],
)
def test_invalid_cron_schedule(schedule: str, fragment: str) -> None:
    message = config_error(f"[[cron]]\nname = 'n'\nschedule = '{schedule}'\nkind = 'k'\n")
    assert 'cron[0] (name "n").schedule: ' in message
    assert fragment in message


@pytest.mark.parametrize(
    "schedule", ["0 2 * * *", "*/15 * * * *", "0 9 * * mon-fri", "0 0 1 jan *", "@daily"]
)
def test_valid_cron_schedules(schedule: str) -> None:
    (entry,) = loads(f"[[cron]]\nname = 'n'\nschedule = '{schedule}'\nkind = 'k'\n", FILE).cron
    assert entry.schedule == schedule


@pytest.mark.parametrize("timezone", ["Mars/Olympus", "", "../etc/passwd", "America"])
def test_invalid_cron_timezone(timezone: str) -> None:
    message = config_error(f"[[cron]]\n{CRON}timezone = '{timezone}'\n")
    assert f'{FILE}: cron[0] (name "nightly").timezone: unknown time zone' in message


def test_duplicate_cron_names() -> None:
    text = f"[[cron]]\n{CRON}\n[[cron]]\n{CRON}\n[[cron]]\n{CRON}"
    message = config_error(text.replace('"nightly"', '"other"', 1))
    assert 'cron[2] (name "nightly").name: duplicate cron name, already used by cron[1]' in message


def test_cron_args_must_be_json() -> None:
    message = config_error(f"[[cron]]\n{CRON}args = {{ when = {{ day = 1979-05-27 }} }}\n")
    assert 'cron[0] (name "nightly").args.when.day: TOML dates and times are not JSON' in message
    message = config_error(f"[[cron]]\n{CRON}args = {{ xs = [1, nan] }}\n")
    assert 'cron[0] (name "nightly").args.xs[1]: nan is not a JSON number' in message


def test_cron_args_size_limit() -> None:
    message = config_error(f"[[cron]]\n{CRON}args = {{ blob = '{'x' * 70_000}' }}\n")
    assert 'cron[0] (name "nightly").args: JSON text is' in message


def test_cron_entry_fields() -> None:
    text = f"[[cron]]\n{CRON}timezone = 'Europe/Berlin'\nargs = {{ a = [1, 'b'] }}\nqueue = 'r'\n"
    (entry,) = loads(text + "catch_up = 'all'\ncatch_up_limit = 7\n", FILE).cron
    assert entry == CronEntry(
        name="nightly",
        schedule="0 2 * * *",
        kind="build_report",
        timezone="Europe/Berlin",
        args={"a": [1, "b"]},
        queue="r",
        catch_up="all",
        catch_up_limit=7,
    )
    (default,) = loads(f"[[cron]]\n{CRON}", FILE).cron
    assert (default.timezone, default.args, default.queue, default.catch_up) == (
        "UTC",
        {},
        None,
        "latest",
    )


def test_quoted_queue_names_are_quoted_in_paths() -> None:
    message = config_error('[queues."a.b"]\nconcurrency = 0\n')
    assert f'{FILE}: queues."a.b".concurrency: expected an integer >= 1, got 0' in message
    assert "a.b" in loads('[queues."a.b"]\n', FILE).queues


@pytest.mark.parametrize(
    ("listen", "address"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("localhost:80", ("localhost", 80)),
        (":9464", ("", 9464)),
        ("[::1]:9464", ("::1", 9464)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("", None),
    ],
)
def test_metrics_listen(listen: str, address: tuple[str, int] | None) -> None:
    config = loads(f"[daemon]\nmetrics_listen = '{listen}'\n", FILE)
    assert config.daemon.metrics_address == address


# --- reading files ---------------------------------------------------------------------


def test_missing_config_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: cannot read config file"):
        load(path)


def test_config_file_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path)


def test_config_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(path)


def test_load_reports_errors_with_the_path_it_was_given(tmp_path: Path) -> None:
    path = write(tmp_path, "[daemon]\nlease = 'forever'\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: daemon\.lease: "):
        load(path)


def test_missing_dsn_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[database]\ndsn_file = "secrets/dsn"\n')
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value) == (
        f"{path}: database.dsn_file: cannot read {tmp_path / 'secrets' / 'dsn'}: "
        "No such file or directory"
    )


def test_empty_dsn_file(tmp_path: Path) -> None:
    (tmp_path / "dsn").write_text("\n", encoding="utf-8")
    path = write(tmp_path, '[database]\ndsn_file = "dsn"\n')
    with pytest.raises(ConfigError, match=r"database\.dsn_file: .*dsn is empty"):
        load(path)


# --- where the file is, and the DSN ----------------------------------------------------


def test_resolve_config_path_order(tmp_path: Path) -> None:
    local, system = tmp_path / "local.toml", tmp_path / "system.toml"
    search = (local, system)
    env = {"PGJOBD_CONFIG": "/from/env.toml"}
    assert resolve_config_path("/explicit.toml", env, search=search) == Path("/explicit.toml")
    assert resolve_config_path(None, env, search=search) == Path("/from/env.toml")
    assert resolve_config_path(None, {}, search=search) is None
    assert resolve_config_path(None, {"PGJOBD_CONFIG": ""}, search=search) is None
    system.write_text("", encoding="utf-8")
    assert resolve_config_path(None, {}, search=search) == system
    local.write_text("", encoding="utf-8")
    assert resolve_config_path(None, {}, search=search) == local


def test_resolve_config_path_defaults_to_cwd_then_etc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "")
    assert resolve_config_path(None, {}) == Path("pgjobd.toml")


def test_dsn_precedence() -> None:
    config = loads("[database]\ndsn = 'file'\n", FILE)
    env = {"PGJOBD_DSN": "pgjobd-env", "DATABASE_URL": "database-url"}
    cases = [
        ({"dsn": "cli"}, env, ("cli", "--dsn")),
        ({}, env, ("pgjobd-env", "$PGJOBD_DSN")),
        ({}, {"DATABASE_URL": "database-url"}, ("database-url", "$DATABASE_URL")),
        ({}, {"PGJOBD_DSN": "", "DATABASE_URL": ""}, ("file", "database.dsn")),
        ({}, {}, ("file", "database.dsn")),
    ]
    for options, environ, (expected, source) in cases:
        resolved = apply_overrides(config, environ=environ, **options)
        assert (resolved.dsn, resolved.dsn_source) == (expected, source)
        assert resolved.require_dsn() == expected


def test_environment_beats_dsn_file(tmp_path: Path) -> None:
    (tmp_path / "dsn").write_text("from-file", encoding="utf-8")
    config = load(write(tmp_path, '[database]\ndsn_file = "dsn"\n'))
    assert apply_overrides(config, environ={}).dsn == "from-file"
    assert apply_overrides(config, environ={"DATABASE_URL": "url"}).dsn == "url"


def test_schema_override() -> None:
    config = apply_overrides(loads("", FILE), schema="tenant_7", environ={})
    assert config.database.schema == "tenant_7"
    with pytest.raises(ConfigError, match=r"^--schema: invalid schema name"):
        apply_overrides(config, schema="Tenant-7", environ={})


def test_empty_cli_dsn_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^--dsn: must not be empty"):
        apply_overrides(loads("", FILE), dsn="", environ={})


def test_missing_dsn_says_how_to_give_one() -> None:
    config = apply_overrides(loads("", FILE), environ={})
    with pytest.raises(ConfigError) as caught:
        config.require_dsn()
    message = str(caught.value)
    for hint in ("--dsn", "$PGJOBD_DSN", "$DATABASE_URL", "database.dsn_file", str(FILE)):
        assert hint in message
    with pytest.raises(ConfigError, match="in a config file"):
        Config().require_dsn()


def test_leader_dsn() -> None:
    config = loads("[database]\ndsn = 'pooled'\n", FILE)
    assert config.require_leader_dsn() == "pooled"
    direct = loads("[database]\ndsn = 'pooled'\nleader_dsn = 'direct'\n", FILE)
    assert direct.require_leader_dsn() == "direct"
    assert apply_overrides(direct, dsn="cli", environ={}).require_leader_dsn() == "direct"


def test_a_transaction_pooler_needs_a_leader_dsn_and_the_pooler_is_one_of_three() -> None:
    with pytest.raises(ConfigError) as caught:
        loads("[database]\ndsn = 'pooled'\npooler = 'transaction'\n", FILE)
    assert str(caught.value).startswith(f"{FILE}: database.leader_dsn: required with pooler")
    pooled = loads(
        "[database]\ndsn = 'pooled'\npooler = 'transaction'\nleader_dsn = 'direct'\n", FILE
    )
    assert pooled.database.pooler == "transaction"
    assert loads("[database]\npooler = 'session'\n", FILE).database.pooler == "session"
    assert loads("", FILE).database.pooler == "none"
    with pytest.raises(ConfigError, match=r'database\.pooler: expected one of "none", "session"'):
        loads("[database]\npooler = 'pgbouncer'\n", FILE)


# --- properties over large input spaces ------------------------------------------------

FIELDS = {
    "": ("cron", "daemon", "database", "queues", "retention", "tenants", "web"),
    "web": tuple(f.encode_name for f in msgspec.structs.fields(WebConfig)),
    "database": tuple(f.encode_name for f in msgspec.structs.fields(DatabaseConfig)),
    "daemon": tuple(f.encode_name for f in msgspec.structs.fields(DaemonConfig)),
    "queues.q": tuple(f.encode_name for f in msgspec.structs.fields(QueueConfig)),
    "cron": tuple(f.encode_name for f in msgspec.structs.fields(CronEntry)),
}
bare_keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,15}", fullmatch=True)


@given(st.sampled_from(sorted(FIELDS)), bare_keys)
def test_any_unknown_key_is_rejected(table: str, key: str) -> None:
    if key in FIELDS[table]:
        return
    if table == "":
        text, where = f"{key} = 1\n", key
    elif table == "cron":
        text, where = f"[[cron]]\n{CRON}{key} = 1\n", f'cron[0] (name "nightly").{key}'
    else:
        text, where = f"[{table}]\n{key} = 1\n", f"{table}.{key}"
    message = config_error(text)
    assert message.startswith(f"{FILE}: {where}: unknown key"), message


INT_LIMITS = {
    "concurrency": (1, 10_000),
    "max_attempts": (1, 2**31 - 1),
    "max_crashes": (1, 2**31 - 1),
}


@given(st.sampled_from(sorted(INT_LIMITS)), st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_queue_integer_limits(key: str, value: int) -> None:
    low, high = INT_LIMITS[key]
    text = f"[queues.q]\nprocesses = 1\n{key} = {value}\n"
    if low <= value <= high:
        assert getattr(loads(text, FILE).queues["q"], key) == value
    else:
        message = config_error(text)
        assert message.startswith(f"{FILE}: queues.q.{key}: expected an integer"), message
        assert message.endswith(f", got {value}")


def toml_value(value: object) -> str:
    """`value` as a TOML value: strings escaped wherever TOML requires (quotes,
    backslashes, control characters such as NUL), floats' infinities and NaN by name."""
    if isinstance(value, str):
        escaped = "".join(
            f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c
            for c in value
        )
        return f'"{escaped}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return {math.inf: "inf", -math.inf: "-inf"}.get(value, repr(value))
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value)


@given(
    st.one_of(
        st.sampled_from(
            ["batch", "other", "", "\x00", "batch\x00", " batch", "BATCH", "b" * 100_000]
        ),
        st.text(st.characters(blacklist_categories=("Cs",))),  # NUL and controls too
        st.integers(),  # negative, zero, past int64
        st.floats(),  # infinities and NaN
        st.booleans(),
        st.lists(st.integers(), max_size=3),
    )
)
def test_cpu_scheduling_is_batch_or_other_and_nothing_else(value: object) -> None:
    text = f"[queues.q]\ncpu_scheduling = {toml_value(value)}\n"
    if isinstance(value, str) and value in ("batch", "other"):
        assert loads(text, FILE).queues["q"].cpu_scheduling == value
        return
    message = config_error(text)
    where = f"{FILE}: queues.q.cpu_scheduling: "
    if isinstance(value, str):
        assert message.startswith(f'{where}expected one of "batch", "other", got a string')
    else:
        assert message.startswith(f"{where}expected a string, got "), message


@given(st.integers(min_value=1, max_value=30), st.integers(min_value=1, max_value=30))
def test_processes_never_exceed_concurrency(concurrency: int, processes: int) -> None:
    text = f"[queues.q]\nconcurrency = {concurrency}\nprocesses = {processes}\n"
    if processes <= concurrency:
        assert loads(text, FILE).queues["q"].processes == processes
    else:
        assert "queues.q.processes: must not exceed concurrency" in config_error(text)


@given(
    st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=10_000)),
    st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=10_000)),
)
def test_backoff_durations_round_trip_and_are_ordered(base: timedelta, cap: timedelta) -> None:
    text = (
        f"[queues.q]\nbackoff_base = '{format_duration(base)}'\n"
        f"backoff_max = '{format_duration(cap)}'\n"
    )
    if base <= cap:
        queue = loads(text, FILE).queues["q"]
        assert (queue.backoff_base, queue.backoff_max) == (base, cap)
    else:
        assert "queues.q.backoff_max: must be at least backoff_base" in config_error(text)


# -- [[cron]] entries against the handlers (`pgjobd check-config`) ------------------------


class MailArgs(msgspec.Struct, forbid_unknown_fields=True):
    to: str
    retries: int = 0
    weight: float = 1.0


@job(kind="mail.send")
def send_mail(args: MailArgs) -> None:
    pass


CRON_REGISTRY = Registry.from_functions([send_mail])
toml_scalars = (
    st.text(max_size=8)
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)  # the config refuses the others
    | st.booleans()
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
cron_args = st.dictionaries(
    st.sampled_from(["to", "retries", "weight", "cc"]) | st.text(max_size=5),
    toml_values,
    max_size=4,
)


def with_cron(*entries: CronEntry) -> Config:
    return msgspec.structs.replace(
        Config(daemon=DaemonConfig(handlers=(Path("/srv/handlers"),))), cron=entries,
        source=FILE,
    )  # fmt: skip


@given(cron_args, st.sampled_from(["mail.send", "mail.sned"]))
def test_check_cron_passes_exactly_the_entries_a_worker_would_run(
    args: dict[str, object], kind: str
) -> None:
    """Whatever TOML args: check_cron passes, or raises a ConfigError naming the file and
    the entry; and what passes converts on the path a cron job takes (stored as JSON by
    the ticker, decoded and converted by the worker)."""
    entry = CronEntry(name="e", schedule="0 2 * * *", kind=kind, args=args)
    try:
        check_cron(with_cron(entry), CRON_REGISTRY)
    except ConfigError as e:
        assert str(e).startswith(f'{FILE}: cron[0] (name "e").'), str(e)
        passed = False
    else:
        passed = True
    try:
        stored = msgspec.json.encode(args)  # as the cron ticker writes the job's args
        validate_args(CRON_REGISTRY[kind], msgspec.json.decode(stored))
    except (KeyError, ArgsError):
        runs = False
    else:
        runs = True
    assert passed == runs


def test_check_cron_example_messages() -> None:
    entries = (
        CronEntry(name="ok", schedule="@daily", kind="mail.send", args={"to": "ops"}),
        CronEntry(name="str", schedule="@daily", kind="mail.send",
                  args={"to": "ops", "retries": "3"}),
        CronEntry(name="gone", schedule="@daily", kind="mail.old"),
    )  # fmt: skip

    with pytest.raises(ConfigError) as caught:
        check_cron(with_cron(*entries), CRON_REGISTRY)

    lines = str(caught.value).splitlines()
    assert lines == [
        f"{FILE}: cron[1] (name \"str\").args: args for kind 'mail.send' do not match "
        f"MailArgs: Expected `int`, got `str` - at `$.retries` (handler send_mail in "
        f"{CRON_REGISTRY['mail.send'].source})",
        f'{FILE}: cron[2] (name "gone").kind: no handler for kind "mail.old" in the handler '
        "directories (/srv/handlers); the kinds they define: mail.send",
    ]


# --- [web] -------------------------------------------------------------------------------


def test_web_defaults_bind_this_host_only_and_are_read_only() -> None:
    config = loads("", FILE)
    assert config.web.address == ("127.0.0.1", 9470)
    assert config.web.admin_token_file is None
    assert config.web.refresh == timedelta(seconds=5)


def test_web_token_file_is_relative_to_the_config_file() -> None:
    config = loads('[web]\nlisten = "[::1]:8080"\nadmin_token_file = "token"\n', FILE)
    assert config.web.address == ("::1", 8080)
    assert config.web.admin_token_file == FILE.parent / "token"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('listen = "nope"', 'web.listen: expected "host:port"'),
        ('listen = "127.0.0.1:70000"', "web.listen: port must be 0-65535, got 70000"),
        ("listen = 9470", "web.listen: expected a string"),
        ('refresh = "100ms"', 'web.refresh: must be at least "1s"'),
        ("admin_token = 'x'", "web.admin_token: unknown key"),
    ],
)
def test_web_errors_name_the_key(text: str, message: str) -> None:
    found = config_error(f"[web]\n{text}\n")
    assert found.startswith(f"{FILE}: {message}"), found


# -- per-tenant flow control (contract §9: tenant_concurrency, fair, [tenants]) ----------


def test_tenant_limits_and_weights_load() -> None:
    config = loads(
        '[queues.api]\ntenant_concurrency = 3\nfair = true\n[tenants]\nacme = 3\n"" = 2\n', FILE
    )
    assert (config.queues["api"].tenant_concurrency, config.queues["api"].fair) == (3, True)
    assert config.tenants == {"acme": 3, "": 2}
    assert loads("", FILE).tenants is None
    assert loads("[tenants]\n", FILE).tenants == {}


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ("[queues.q]\ntenant_concurrency = 0", "queues.q.tenant_concurrency",
         "expected an integer >= 1, got 0"),
        ("[queues.q]\ntenant_concurrency = -3", "queues.q.tenant_concurrency",
         "expected an integer >= 1, got -3"),
        ("[queues.q]\ntenant_concurrency = 1.5", "queues.q.tenant_concurrency",
         "expected an integer"),
        ('[queues.q]\ntenant_concurrency = "3"', "queues.q.tenant_concurrency",
         "expected an integer"),
        ("[queues.q]\nfair = 1", "queues.q.fair", "expected a boolean"),
        ('[queues.q]\nfair = "yes"', "queues.q.fair", "expected a boolean"),
        ("tenants = 3", "tenants", "expected a table of tenant weights"),
        ("[tenants]\nacme = 0", "tenants.acme", "expected an integer >= 1 and <= 10000, got 0"),
        ("[tenants]\nacme = 10001", "tenants.acme",
         "expected an integer >= 1 and <= 10000, got 10001"),
        ("[tenants]\nacme = 2.0", "tenants.acme", "expected an integer weight"),
        ("[tenants]\nacme = true", "tenants.acme", "expected an integer weight"),
        ('[tenants]\nacme = "3"', "tenants.acme", "expected an integer weight"),
        ('[tenants]\n"a\\u0000b" = 1', "tenants.", "must not contain NUL"),
        (f'[tenants]\n"{"é" * 129}" = 1', "tenants.", "is 258 bytes, over the 256-byte limit"),
    ],
)  # fmt: skip
def test_tenant_limits_and_weights_refuse_bad_values(text: str, where: str, message: str) -> None:
    problem = config_error(text)
    assert problem.startswith(f"{FILE}: {where}"), problem
    assert message in problem, problem


# Durations at the edges for this session's keys: none, sub-second, the bounds and just
# past them, negative, not finite, past int64, empty, NUL, malformed, not a string.
EDGE_DURATION_TEXTS = st.one_of(
    st.sampled_from(["0s", "0.5ms", "1s", "1d", "1h", "3601s", "86401s", "-1s", "inf",
                     "nan", "", " ", "\x00", "1s\x00", "1x", "9" * 40 + "s", "1e400s",
                     "9223372036854775808ms"]),
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(-(2**70), 2**70),
              st.sampled_from(["ms", "s", "m", "h", "d"])),
)  # fmt: skip


@given(
    where=st.sampled_from([("database", "start_wait"), ("queues.q", "priority_aging")]),
    text=st.one_of(EDGE_DURATION_TEXTS, st.integers(-(2**70), 2**70), st.just(True)),
)
def test_start_wait_and_priority_aging_are_refused_naming_them_or_taken_in_bounds(
    where: tuple[str, str], text: object
) -> None:
    table, key = where
    value = json.dumps(text) if isinstance(text, str) else str(text).lower()
    try:
        config = loads(f"[{table}]\n{key} = {value}\n", Path("pgjobd.toml"))
    except ConfigError as e:
        assert key in str(e), str(e)
        return
    if key == "start_wait":
        assert timedelta(0) <= config.database.start_wait <= timedelta(hours=1)
    else:
        aging = config.queues["q"].priority_aging
        assert aging is not None and timedelta(seconds=1) <= aging <= timedelta(days=1)
