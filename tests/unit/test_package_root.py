"""The package root imports lazily: a handler's `from pgjobd import job` stays small."""

from __future__ import annotations

import subprocess
import sys

import asyncpg
import pytest

import pgjobd
from pgjobd import admin, client, errors, handler_api  # submodules: past the lazy names
from pgjobd.errors import TRANSIENT, retry_later


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running code."""
    probe = code + "\nimport sys\nprint('\\n'.join(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(result.stdout.split())


def test_the_handler_api_does_not_load_the_client() -> None:
    loaded = _modules_after(
        "import pgjobd\nfrom pgjobd import Discard, JobContext, Retry, Snooze, job"
    )
    assert "pgjobd.handler_api" in loaded
    assert not {"pgjobd.client", "asyncpg", "anyio"} & loaded


def test_the_client_loads_on_first_use() -> None:
    loaded = _modules_after("import pgjobd\npgjobd.Client")
    assert {"pgjobd.client", "asyncpg"} <= loaded


def test_every_exported_name_resolves() -> None:
    homes = {"Client": client, "SyncClient": client, "JobSpec": client, "JobInfo": client,
             "DuplicateJob": errors, "EnqueueError": errors, "PgjobdError": errors,
             "QueueFull": errors, "job": handler_api, "JobContext": handler_api,
             "Retry": handler_api, "Snooze": handler_api, "Discard": handler_api,
             "Batch": client, "BatchCounts": handler_api}  # fmt: skip
    assert set(pgjobd.__all__) == {*homes, "__version__"}
    for name, module in homes.items():
        assert getattr(pgjobd, name) is getattr(module, name)
    assert set(pgjobd.__all__) <= set(dir(pgjobd))


def test_unknown_names_and_submodules() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Clint'"):
        pgjobd.Clint  # noqa: B018
    assert admin.__name__ == "pgjobd.admin"


def test_errors_builds_transient_on_first_use() -> None:
    loaded = _modules_after("import pgjobd.errors")
    assert "asyncpg" not in loaded
    assert OSError in TRANSIENT and asyncpg.exceptions.DeadlockDetectedError in TRANSIENT


def test_retry_later_is_a_lost_connection_or_a_database_refusing_for_now() -> None:
    exceptions = asyncpg.exceptions
    assert retry_later(OSError()) and retry_later(exceptions.CannotConnectNowError())
    assert retry_later(exceptions.DiskFullError())  # 53100: its disk is full
    assert retry_later(exceptions.ReadOnlySQLTransactionError())  # 25006
    assert retry_later(exceptions.QueryCanceledError())  # 57014: a statement_timeout
    assert not retry_later(exceptions.UndefinedFunctionError())  # 42883: a bug, loudly
    assert not retry_later(RuntimeError())
