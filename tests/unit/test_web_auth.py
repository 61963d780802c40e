"""The console's token, session and CSRF checks (pgjobd/web/auth.py), and the charts'
escaping: input surfaces, so property-tested."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from xml.etree import ElementTree

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.errors import ConfigError
from pgjobd.web import charts
from pgjobd.web.auth import SESSION_S, Guard, read_token

TOKEN = "a-token-of-enough-characters"


@given(st.text(max_size=80))
def test_only_the_token_itself_passes(given_token: str) -> None:
    guard = Guard(TOKEN)
    assert guard.bearer_ok(f"Bearer {given_token}") == (given_token.strip() == TOKEN)
    assert guard.token_ok(given_token) == (given_token.strip() == TOKEN)


def test_the_bearer_scheme_is_required_and_a_read_only_guard_passes_nothing() -> None:
    assert Guard(TOKEN).bearer_ok(f"bearer {TOKEN}")
    assert not Guard(TOKEN).bearer_ok(f"Basic {TOKEN}")
    assert not Guard(TOKEN).bearer_ok(TOKEN)
    assert not Guard(None).bearer_ok(f"Bearer {TOKEN}")
    assert Guard(None).session(Guard(TOKEN).new_cookie()) is None


def test_a_session_holds_until_it_expires_and_only_for_its_token() -> None:
    guard = Guard(TOKEN)
    cookie = guard.new_cookie(now=1_000_000.0)
    session = guard.session(cookie, now=1_000_000.0 + SESSION_S - 1)
    assert session is not None
    assert guard.csrf_ok(session, session.csrf)
    assert guard.session(cookie, now=1_000_000.0 + SESSION_S + 1) is None
    assert Guard(TOKEN + "x").session(cookie, now=1_000_000.0) is None


@given(st.text(max_size=120))
def test_forged_cookies_make_no_session(cookie: str) -> None:
    assert Guard(TOKEN).session(cookie) is None


def test_cookies_of_one_session_do_not_carry_another_sessions_csrf() -> None:
    guard = Guard(TOKEN)
    first = guard.session(guard.new_cookie())
    second = guard.session(guard.new_cookie())
    assert first is not None and second is not None
    assert not guard.csrf_ok(first, second.csrf)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), ("short", "is 5 characters; use at least 16"), (b"\xff" * 20, "UTF-8")],
)
def test_bad_token_files_name_the_key(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / "token"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        read_token(path)
    assert str(caught.value).startswith("web.admin_token_file: ")
    assert message in str(caught.value)


def test_a_token_file_is_read_without_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert read_token(path) == TOKEN


@given(
    st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=40),
    st.lists(st.floats(0, 1e9), max_size=20),
)
def test_chart_labels_are_text_whatever_they_hold(name: str, values: list[float]) -> None:
    end = datetime(2026, 1, 1, tzinfo=UTC)
    times = [end - timedelta(minutes=len(values) - i) for i in range(len(values))]
    series = [charts.Series(name, "dead", values)]
    figure = ElementTree.fromstring(
        str(charts.line_chart(name, times, series, end - timedelta(hours=1), end))
    )
    tags = {element.tag for element in figure.iter()}
    assert tags <= {"figure", "figcaption", "span", "svg", "title", "line", "text", "polyline"}
    assert (figure.find("svg/title").text or "") == name  # type: ignore[union-attr]
    assert (figure.find("figcaption/span").text or "") == name  # type: ignore[union-attr]
