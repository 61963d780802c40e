"""The console in a real browser: `pgjobd web` as a process, Debian's Chromium driven by
Playwright, a real database with jobs in every state and real members.

Each page is loaded and screenshotted (into $PGJOBD_WEB_SCREENSHOTS when set: that is
how docs/web/*.png are made, see docs/web.md), filters and pagination are clicked,
every action is tried with and without the token and checked in the database, hostile
strings must stay text, and a job page must show its job completing without a reload.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
from anyio.abc import Process

from pgjobd import admin
from tests.console_data import HOSTILE, enqueue, finish, populate

from .conftest import MemberProcess, wait_until
from .events import log_events

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
TOKEN = "browser-token-0123456789abcdef"
QUEUE = "console"  # no member serves it: the populated jobs stay as they are
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
PAGES = {
    "overview": "/",
    "jobs": "/jobs",
    "job": "/jobs/{dead}",
    "members": "/members",
    "cron": "/cron",
    "dead": "/dead",
}


@dataclass
class Console:
    url: str
    process: Process
    log_path: Path


StartConsole = Callable[..., Awaitable[Console]]


@pytest.fixture
async def start_console(dsn: str, schema: str, tmp_path: Path) -> AsyncIterator[StartConsole]:
    """Starts `pgjobd web --listen 127.0.0.1:0` (with the admin token unless
    token=False) and waits until it answers."""
    started: list[Console] = []

    async def start(token: bool = True) -> Console:
        index = len(started)
        token_line = ""
        if token:
            (tmp_path / "token").write_text(TOKEN + "\n")
            token_line = f'admin_token_file = "{tmp_path / "token"}"\n'
        config = tmp_path / f"web{index}.toml"
        config.write_text(
            f'[database]\nschema = "{schema}"\n[daemon]\nlog_format = "json"\n'
            f'[web]\nrefresh = "1s"\n{token_line}'
        )
        log_path = tmp_path / f"web{index}.log"
        env = {**os.environ, "PGJOBD_DSN": dsn}
        env.pop("DATABASE_URL", None)
        with log_path.open("wb") as log_file:
            process = await anyio.open_process(
                [sys.executable, "-m", "pgjobd", "web", "--config", str(config),
                 "--listen", "127.0.0.1:0"],
                stdout=log_file, stderr=log_file, env=env,
            )  # fmt: skip

        def listening() -> dict[str, Any] | None:
            if process.returncode is not None:
                raise AssertionError(f"pgjobd web exited: {log_path.read_text()[-3000:]}")
            found = [e for e in log_events(log_path.read_text()) if e["event"] == "web.listening"]
            return found[0] if found else None

        event = await wait_until(listening, what="web.listening")
        console = Console(f"http://127.0.0.1:{event['port']}", process, log_path)
        started.append(console)
        async with httpx.AsyncClient() as client:
            await wait_until(lambda: _answers(client, console.url), what="the console answering")
        return console

    yield start
    for console in started:
        if console.process.returncode is None:
            console.process.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                await console.process.wait()


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/api/status")).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(
            f"no {CHROMIUM}: install Debian's chromium (apt-get install -y chromium); .ci/run does"
        )
    return CHROMIUM


@pytest.fixture
async def browser(chromium: Path) -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright  # noqa: PLC0415

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=str(chromium), args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: $PGJOBD_WEB_SCREENSHOTS (docs/web to refresh the docs')."""
    chosen = os.environ.get("PGJOBD_WEB_SCREENSHOTS")
    directory = Path(chosen) if chosen else tmp_path / "shots"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


async def _page(browser: Any, viewport: dict[str, int] = DESKTOP) -> Any:
    context = await browser.new_context(viewport=viewport)
    page = await context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    page.dialogs = dialogs  # an alert() from a hostile string would land here
    return page


async def _charts_data(conn: asyncpg.Connection, schema: str) -> None:
    """Six hours of minute samples for the charts (as the leader's sampler writes)."""
    await conn.execute(
        f"""INSERT INTO {schema}.queue_sample (at, queue, available, scheduled, running,
                retryable, completed, dead, cancelled)
            SELECT now() - m * interval '1 minute', q, (40 + 35 * sin(m / 25.0))::int,
                   5, (8 + 4 * cos(m / 9.0))::int, (m % 7)::int,
                   (120 + 60 * sin(m / 30.0))::int, (m % 13 = 0)::int * 3, 0
            FROM generate_series(1, 360) AS m, unnest(ARRAY['console', 'default']) AS q"""
    )


async def _cron_rows(conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(
        f"""INSERT INTO {schema}.cron (name, schedule, timezone, kind, source, args) VALUES
            ('nightly-report', '0 2 * * *', 'Europe/Berlin', 'build_report', 'api', '{{}}'),
            ('hourly-sync', '15 * * * *', 'America/New_York', 'sync', 'api', '{{}}'),
            ('broken', 'not a schedule', 'UTC', 'x', 'api', '{{}}')"""
    )


async def test_every_page_renders_on_a_desktop_and_a_phone(
    start_console: StartConsole, browser: Any, conn: asyncpg.Connection, schema: str,
    start_member: Callable[..., Awaitable[MemberProcess]], shots: Path,
) -> None:  # fmt: skip
    jobs = await populate(conn, schema, queue=QUEUE)
    for error in ("OSError: disk full", "OSError: disk full", "TimeoutError: upstream"):
        await finish(conn, schema, await enqueue(conn, schema, queue=QUEUE), "discarded", error)
    await _charts_data(conn, schema)
    await _cron_rows(conn, schema)
    await conn.execute(
        f"INSERT INTO {schema}.queue (name, global_concurrency, rate_limit, rate_window) "
        "VALUES ($1, 8, 600, interval '1 minute')",
        QUEUE,
    )
    await start_member()
    await wait_until(
        lambda: _has_leader(conn, schema), timeout_s=60, what="a leader for the members page"
    )
    console = await start_console()
    page = await _page(browser)
    headings = {
        "overview": "Overview", "jobs": "Jobs", "job": f"Job {jobs['dead']}",
        "members": "Members", "cron": "Cron", "dead": "Dead jobs",
    }  # fmt: skip
    for name, path in PAGES.items():
        answer = await page.goto(console.url + path.format(**jobs.ids))
        assert answer.status == 200, name
        assert await page.locator("h1").inner_text() == headings[name]
        await page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    assert page.dialogs == []

    await page.goto(console.url + "/")
    assert await page.locator(f"tr[data-queue={QUEUE}] td").nth(4).inner_text() == "1"
    assert "1/8 running" in await page.locator(f"tr[data-queue={QUEUE}]").inner_text()
    assert await page.locator("svg.chart polyline").count() == 5
    await page.goto(console.url + "/members")
    assert "term" in await page.locator("section.leader").inner_text()
    await page.goto(console.url + "/cron")
    berlin = await page.locator("tr[data-name=nightly-report] td.next").inner_text()
    assert "02:00 CE" in berlin  # CET or CEST: the entry's own time zone
    assert "not a schedule" in await page.locator("tr[data-name=broken]").inner_text()
    await page.goto(console.url + "/dead")
    first_group = await page.locator("table.groups tbody tr").first.inner_text()
    assert first_group.startswith("2") and "OSError: disk full" in first_group

    phone = await _page(browser, PHONE)
    for name, path in PAGES.items():
        await phone.goto(console.url + path.format(**jobs.ids))
        overflow = await phone.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, f"{name} is wider than a phone's screen by {overflow}px"
        if name in ("overview", "jobs", "job"):
            await phone.screenshot(path=str(shots / f"{name}-phone.png"), full_page=True)


async def _has_leader(conn: asyncpg.Connection, schema: str) -> bool:
    return (await admin.status(conn, schema)).leader is not None


async def test_filters_and_pagination_by_clicking(
    start_console: StartConsole, browser: Any, conn: asyncpg.Connection, schema: str
) -> None:
    jobs = await populate(conn, schema, queue=QUEUE)
    more = [await enqueue(conn, schema, queue=QUEUE, tenant="acme") for _ in range(110)]
    console = await start_console()
    page = await _page(browser)
    await page.goto(console.url + "/jobs")
    ids = await _shown_ids(page)
    assert ids == sorted(ids, reverse=True) and ids[0] == max(more) and len(ids) == 50

    await page.click("a[rel=next]")
    second = await _shown_ids(page)
    assert len(second) == 50 and max(second) < min(ids)
    await page.click("a[rel=next]")
    third = await _shown_ids(page)
    assert len(third) == 117 - 100 and await page.locator("a[rel=next]").count() == 0
    assert sorted(ids + second + third) == sorted([*jobs.ids.values(), *more])
    await page.click("a[rel=first]")
    assert await _shown_ids(page) == ids

    await page.select_option("select[name=state]", "dead")
    await page.click("form.filters button")
    assert "state=dead" in page.url
    assert await _shown_ids(page) == [jobs["dead"]]
    await page.fill("input[name=tenant]", "acme")
    await page.select_option("select[name=state]", "")
    await page.click("form.filters button")
    assert sorted(await _shown_ids(page)) == sorted(more)[-50:]
    await page.fill("input[name=tenant]", "")
    await page.fill("input[name=kind]", "no.such.kind")
    await page.click("form.filters button")
    assert await page.locator("td.empty").inner_text() == "No jobs match."


async def _shown_ids(page: Any) -> list[int]:
    await page.wait_for_load_state()
    return [int(i) for i in await page.locator("table.jobs tbody tr").evaluate_all(
        "rows => rows.filter(r => r.dataset.id).map(r => r.dataset.id)"
    )]  # fmt: skip


async def test_actions_only_with_the_token(
    start_console: StartConsole, browser: Any, conn: asyncpg.Connection, schema: str
) -> None:
    jobs = await populate(conn, schema, queue=QUEUE)
    read_only = await start_console(token=False)
    page = await _page(browser)
    for path in ("/", f"/jobs/{jobs['available']}", "/dead"):
        await page.goto(read_only.url + path)
        assert await page.locator("main button").count() == 0
    assert await page.locator(".who").inner_text() == "read-only"
    refused = await page.evaluate(
        """async url => (await fetch(url, {method: "POST"})).status""",
        f"{read_only.url}/actions/jobs/{jobs['available']}/cancel",
    )
    assert refused == 403

    console = await start_console()
    page = await _page(browser)
    await page.goto(f"{console.url}/jobs/{jobs['available']}")
    assert await page.locator("main button").count() == 0  # not logged in
    unauthorised = await page.evaluate(
        """async url => (await fetch(url, {method: "POST"})).status""",
        f"{console.url}/api/jobs/{jobs['available']}/cancel",
    )
    assert unauthorised == 401
    await page.click("text=log in to act")
    await page.fill("input[name=token]", "not-the-token-not-the-token")
    await page.click("form.login button")
    assert "That is not the admin token." in await page.locator("main").inner_text()
    await page.fill("input[name=token]", TOKEN)
    await page.click("form.login button")
    assert page.url.endswith(f"/jobs/{jobs['available']}")  # back where it started

    await page.click("button:has-text('Cancel')")
    assert await _history_state(conn, schema, jobs["available"]) == "cancelled"
    await page.goto(f"{console.url}/jobs/{jobs['dead']}")
    await page.click("button:has-text('Retry now')")
    assert await _live_state(conn, schema, jobs["dead"]) == "available"
    await page.goto(console.url + "/")
    await page.click(f"tr[data-queue={QUEUE}] button:has-text('Pause')")
    assert await conn.fetchval(f"SELECT paused FROM {schema}.queue WHERE name = $1", QUEUE)
    await page.click(f"tr[data-queue={QUEUE}] button:has-text('Resume')")
    assert not await conn.fetchval(f"SELECT paused FROM {schema}.queue WHERE name = $1", QUEUE)
    dead = [await enqueue(conn, schema, queue=QUEUE) for _ in range(3)]
    for job_id in dead:
        await finish(conn, schema, job_id, "discarded", "RuntimeError: flaky upstream")
    await page.goto(console.url + "/dead")
    await page.click("button:has-text('Redrive 3')")
    states = [await _live_state(conn, schema, job_id) for job_id in dead]
    assert states == ["available"] * 3

    actions = await conn.fetch(f"SELECT action, os_user FROM {schema}.audit ORDER BY id")
    assert [a["action"] for a in actions] == [
        "jobs.cancel", "jobs.retry", "queues.pause", "queues.resume", "dlq.redrive"
    ]  # fmt: skip
    assert {a["os_user"] for a in actions} == {"web@127.0.0.1"}

    forged = await page.evaluate(
        """async url => (await fetch(url, {method: "POST", body: new URLSearchParams(
               {csrf: "0".repeat(64)})})).status""",
        f"{console.url}/actions/queues/{QUEUE}/pause",
    )
    assert forged == 403
    assert not await conn.fetchval(f"SELECT paused FROM {schema}.queue WHERE name = $1", QUEUE)


async def _history_state(conn: asyncpg.Connection, schema: str, job_id: int) -> str | None:
    state: str | None = await conn.fetchval(
        f"SELECT state::text FROM {schema}.job_history WHERE id = $1", job_id
    )
    return state


async def _live_state(conn: asyncpg.Connection, schema: str, job_id: int) -> str | None:
    state: str | None = await conn.fetchval(
        f"SELECT state::text FROM {schema}.job WHERE id = $1", job_id
    )
    return state


async def test_hostile_strings_stay_text(
    start_console: StartConsole, browser: Any, conn: asyncpg.Connection, schema: str
) -> None:
    jobs = await populate(conn, schema, queue=QUEUE)
    console = await start_console()
    page = await _page(browser)
    for path in ("/jobs", f"/jobs/{jobs['dead']}", f"/jobs/{jobs['completed']}", "/dead"):
        await page.goto(console.url + path)
        assert await page.locator("main img, main script").count() == 0, path
    await page.goto(f"{console.url}/jobs/{jobs['dead']}")
    assert HOSTILE.replace('"', '\\"') in await page.locator("pre.args").inner_text()
    assert HOSTILE in await page.locator("dd.tenant").inner_text()
    await page.click("details summary")
    assert HOSTILE in await page.locator("pre.traceback").first.inner_text()
    assert HOSTILE in await page.locator("article.attempt .member").first.inner_text()
    await page.goto(f"{console.url}/jobs/{jobs['completed']}")
    assert "<b>done</b>" in await page.locator("pre.result").inner_text()
    assert page.dialogs == []


async def test_a_job_page_shows_its_job_completing_without_a_reload(
    start_console: StartConsole, browser: Any, conn: asyncpg.Connection, schema: str,
    start_member: Callable[..., Awaitable[MemberProcess]],
) -> None:  # fmt: skip
    await admin.set_paused(conn, schema, "default", True)
    await start_member()
    job_id = await enqueue(conn, schema, kind="echo", tenant=None, args='{"n": 1}')
    console = await start_console()
    page = await _page(browser)
    await page.goto(f"{console.url}/jobs/{job_id}")
    assert await page.locator(".summary .state").inner_text() == "available"
    await page.evaluate("window.notReloaded = true")

    await admin.set_paused(conn, schema, "default", False)
    await page.locator(".summary .state-completed").wait_for(timeout=60_000)
    assert await page.evaluate("window.notReloaded") is True
    assert '"n": 1' in await page.locator("pre.result").inner_text()
