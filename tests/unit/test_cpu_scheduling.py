"""A worker's cpu_scheduling where it cannot be had: a warning when the system refuses
it, nothing on a platform without policies; the worker goes on under the policy it
inherited either way (the policy changes speed, not what runs)."""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.worker import parse_args, set_cpu_scheduling


def test_a_refused_policy_is_a_warning_that_names_it_and_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(pid: int, policy: int, param: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    with caplog.at_level(logging.WARNING, logger="pgjobd.worker"):
        set_cpu_scheduling("batch")
    [record] = caplog.records
    assert record.event == "worker.cpu_scheduling_refused"  # type: ignore[attr-defined]
    assert "cpu_scheduling = 'batch'" in record.getMessage()
    assert "Operation not permitted" in record.getMessage()


def test_a_platform_without_policies_ignores_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(os, "sched_setscheduler", raising=False)
    with caplog.at_level(logging.DEBUG, logger="pgjobd.worker"):
        set_cpu_scheduling("batch")
    assert caplog.records == []


@given(
    st.one_of(
        st.sampled_from(["batch", "other", "", "\x00", "BATCH", "fifo", "-1", "b" * 100_000]),
        st.text(st.characters(blacklist_categories=("Cs",))),
    )
)
def test_the_workers_option_takes_batch_or_other_and_nothing_else(value: str) -> None:
    argv = ["--queue", "q", "--handler-dir", "h", "--slots", "1", "--cpu-scheduling", value]
    if value in ("batch", "other"):
        assert parse_args(argv).cpu_scheduling == value
    else:
        with pytest.raises(SystemExit) as exited:
            parse_args(argv)
        assert exited.value.code == 2  # argparse's usage error, naming the choices
