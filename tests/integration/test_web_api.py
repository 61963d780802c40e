"""The console's /api/ against a real database: every endpoint's JSON is the CLI's
`--json` for the same data; actions need the bearer token (401 without, 403 wrong),
are audited like the CLI's, and are refused on a read-only console. The HTML forms'
session and CSRF checks, keyset paging, and escaping of hostile strings."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import httpx
import pytest

from pgjobd import fingerprint as fingerprints
from pgjobd.roles import Deposed, RoleContext
from pgjobd.roles.queue_stats import QueueStats
from pgjobd.roles.samples import QueueSampler
from pgjobd.web.app import create_app
from pgjobd.web.auth import SESSION_COOKIE
from tests.console_data import FINGERPRINT, HOSTILE, Population, enqueue, finish, populate

pytestmark = pytest.mark.anyio

TOKEN = "test-token-0123456789abcdef"
BEARER = {"authorization": f"Bearer {TOKEN}"}

Console = Callable[..., Awaitable[httpx.AsyncClient]]


@pytest.fixture
async def console(dsn: str, schema: str) -> AsyncIterator[Console]:
    """Opens a console on the test's schema: with the admin token unless token=None."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    clients: list[httpx.AsyncClient] = []

    async def open_console(token: str | None = TOKEN) -> httpx.AsyncClient:
        app = create_app(schema=schema, token=token, pool=pool)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://console.test"
        )
        clients.append(client)
        return client

    try:
        yield open_console
    finally:
        for client in clients:
            await client.aclose()
        await pool.close()


@pytest.fixture
async def jobs(conn: asyncpg.Connection, schema: str) -> Population:
    return await populate(conn, schema)


async def cli_json(dsn: str, schema: str, *args: str) -> Any:
    clean = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", *args, "--json", "--dsn", dsn, "--schema", schema],
        env=clean, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


async def audit_rows(conn: asyncpg.Connection, schema: str) -> list[asyncpg.Record]:
    return await conn.fetch(f"SELECT * FROM {schema}.audit ORDER BY id")


# -- reads: the CLI's shapes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "cli_args"),
    [
        ("", []),
        ("?state=dead", ["--state", "dead"]),
        ("?state=running,available", ["--state", "running", "--state", "available"]),
        ("?queue=default&kind=hostile.kind&limit=3", ["--queue", "default", "--kind",
                                                      "hostile.kind", "--limit", "3"]),
        ("?tenant=nobody", ["--tenant", "nobody"]),
    ],
)  # fmt: skip
async def test_jobs_are_the_cli_jobs_list(
    console: Console, jobs: Population, dsn: str, schema: str, query: str, cli_args: list[str]
) -> None:
    client = await console()
    api = (await client.get(f"/api/jobs{query}")).json()
    cli = await cli_json(dsn, schema, "jobs", "list", *cli_args)
    assert api["jobs"] == cli["jobs"]
    assert set(api) == {"jobs", "next_cursor"}


async def test_one_job_is_the_cli_jobs_show(
    console: Console, jobs: Population, dsn: str, schema: str
) -> None:
    client = await console()
    for state in ("dead", "running", "completed"):
        api = (await client.get(f"/api/jobs/{jobs[state]}")).json()
        assert api == await cli_json(dsn, schema, "jobs", "show", str(jobs[state]))
        assert api["state"] == state
    missing = await client.get("/api/jobs/999999")
    assert missing.status_code == 404
    assert missing.json() == {"error": "no such job: 999999"}


async def test_status_is_the_cli_status(
    console: Console, jobs: Population, dsn: str, schema: str
) -> None:
    client = await console()
    api = (await client.get("/api/status")).json()
    cli = await cli_json(dsn, schema, "status")

    def steady(status: dict[str, Any]) -> dict[str, Any]:  # ages move between the reads
        for queue in status["queues"].values():
            queue.pop("oldest_available_age_s")
        return status

    assert steady(api) == steady(cli)
    assert api["queues"]["default"]["running"] == 1


async def test_cron_and_dead_are_the_cli_lists(
    console: Console, jobs: Population, dsn: str, schema: str, conn: asyncpg.Connection
) -> None:
    await conn.execute(
        f"INSERT INTO {schema}.cron (name, schedule, timezone, kind, source) "
        "VALUES ('nightly', '0 2 * * *', 'Europe/Berlin', 'report', 'api')"
    )
    client = await console()
    assert (await client.get("/api/cron")).json() == await cli_json(dsn, schema, "cron", "list")
    assert (await client.get("/api/dead")).json() == await cli_json(dsn, schema, "dlq", "list")


async def test_dead_jobs_are_grouped_by_their_error(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str
) -> None:
    # Grouped by fingerprint, not by text: the ids in the messages differ (the console
    # keyed on the error text before migration 0019, and showed two groups here).
    for error in ("OSError: disk 7 full", "OSError: disk 9 full", "KeyError: 'x'"):
        cls, message = error.split(": ")
        await finish(
            conn, schema, await enqueue(conn, schema, kind="other"), "discarded", error,
            fingerprint=fingerprints.fingerprint(cls, message, "h:handle"),
        )  # fmt: skip
    client = await console()
    groups = (await client.get("/api/dead/groups")).json()["groups"]
    assert [(g["jobs"], g["error"], g["reason"]) for g in groups] == [
        (2, "OSError: disk 9 full", "discarded"),  # the newest one's error
        (1, "KeyError: 'x'", "discarded"),
        (1, f"ValueError: bad input {HOSTILE}", "attempts_exhausted"),
    ]
    disk = groups[0]
    assert disk["kinds"] == ["other"] and disk["queues"] == ["default"]
    assert disk["fingerprint"] == fingerprints.fingerprint("OSError", "disk 1 full", "h:handle")
    assert disk["key"] == f"{disk['fingerprint']}.discarded"
    assert groups[2]["fingerprint"] == FINGERPRINT

    done = await client.post(f"/api/dead/groups/{disk['key']}/redrive", headers=BEARER)
    assert done.status_code == 200
    assert len(done.json()["ids"]) == 2
    revived = await conn.fetchval(
        f"SELECT count(*) FROM {schema}.job WHERE id = ANY($1::bigint[])", done.json()["ids"]
    )
    assert revived == 2
    audit = (await audit_rows(conn, schema))[-1]
    assert audit["action"] == "dlq.redrive" and sorted(audit["job_ids"]) == sorted(
        done.json()["ids"]
    )


async def test_the_console_groups_dead_jobs_as_dlq_list_does(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str, dsn: str
) -> None:
    """The same groups, counts and fingerprints as `pgjobd dlq list --since 24h --json`,
    also for jobs that died without a fingerprint (grouped by their reason)."""
    for n in range(3):
        await finish(conn, schema, await enqueue(conn, schema), "expired", f"Expired: {n}")
    await finish(
        conn, schema, await enqueue(conn, schema), "discarded", "OSError: disk 3 full",
        fingerprint=fingerprints.fingerprint("OSError", "disk 3 full", "h:handle"),
    )  # fmt: skip
    client = await console()
    groups = (await client.get("/api/dead/groups?hours=24")).json()["groups"]
    cli = (await cli_json(dsn, schema, "dlq", "list", "--since", "24h"))["groups"]
    assert {(g["fingerprint"], g["reason"], g["jobs"]) for g in groups} == {
        (g["fingerprint"], g["reason"], g["count"]) for g in cli
    }
    assert len(groups) == len(cli) == 3
    expired = next(g for g in groups if g["reason"] == "expired")
    assert (expired["fingerprint"], expired["key"], expired["jobs"]) == (None, "none.expired", 3)
    done = await client.post(f"/api/dead/groups/{expired['key']}/redrive", headers=BEARER)
    assert len(done.json()["ids"]) == 3


# -- keyset paging -----------------------------------------------------------------------


async def test_pages_follow_the_cursor_newest_first_without_gaps(
    console: Console, conn: asyncpg.Connection, schema: str
) -> None:
    ids = [await enqueue(conn, schema, tenant=None) for _ in range(7)]
    for job_id in ids[:3]:  # some live, some in history: one order across both
        await finish(conn, schema, job_id, None)
    client = await console()
    seen: list[int] = []
    cursor = None
    pages = 0
    while True:
        query = "?limit=3" + (f"&cursor={cursor}" if cursor else "")
        page = (await client.get(f"/api/jobs{query}")).json()
        seen += [j["id"] for j in page["jobs"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True)
    assert pages == 3


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("?state=lost", "state: unknown state lost"),
        ("?limit=0", "limit: expected 1-500, got 0"),
        ("?limit=ten", "limit: expected an integer, got 'ten'"),
        ("?cursor=-4", "cursor: expected 1-"),
    ],
)
async def test_bad_parameters_are_400_naming_the_parameter(
    console: Console, schema: str, query: str, message: str
) -> None:
    client = await console()
    answer = await client.get(f"/api/jobs{query}")
    assert answer.status_code == 400
    assert answer.json()["error"].startswith(message)
    page = await client.get(f"/jobs{query}")
    assert page.status_code == 400
    assert message.split(":", maxsplit=1)[0] in page.text


# -- actions -----------------------------------------------------------------------------


ACTIONS = [
    ("/api/jobs/{dead}/retry", "jobs.retry"),
    ("/api/jobs/{available}/cancel", "jobs.cancel"),
    ("/api/queues/default/pause", "queues.pause"),
    ("/api/queues/default/resume", "queues.resume"),
    ("/api/dead/redrive?queue=default&since_hours=1", "dlq.redrive"),
]


@pytest.mark.parametrize(("path", "action"), ACTIONS)
async def test_actions_need_the_token_and_are_audited(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str,
    path: str, action: str,
) -> None:  # fmt: skip
    client = await console()
    url = path.format(**jobs.ids)
    before = await conn.fetch(f"SELECT id, state FROM {schema}.job ORDER BY id")
    without = await client.post(url)
    assert without.status_code == 401
    assert without.headers["www-authenticate"] == "Bearer"
    wrong = await client.post(url, headers={"authorization": "Bearer not-the-token-at-all"})
    assert wrong.status_code == 403
    assert await conn.fetch(f"SELECT id, state FROM {schema}.job ORDER BY id") == before
    assert await audit_rows(conn, schema) == []

    done = await client.post(url, headers=BEARER)
    assert done.status_code == 200, done.text
    assert done.json()["action"] == action
    [audit] = await audit_rows(conn, schema)
    assert audit["action"] == action
    assert audit["os_user"] == "web@127.0.0.1"
    assert audit["id"] == done.json()["audit_id"]


async def test_actions_do_what_the_cli_does_with_the_same_shape(
    console: Console, conn: asyncpg.Connection, schema: str, dsn: str
) -> None:
    dead = [await enqueue(conn, schema) for _ in range(2)]
    for job_id in dead:
        await finish(conn, schema, job_id, "discarded", "E: x")
    client = await console()
    api = (await client.post(f"/api/jobs/{dead[0]}/retry", headers=BEARER)).json()
    cli = await cli_json(dsn, schema, "jobs", "retry", str(dead[1]))
    for shown in (api, cli):
        shown.pop("audit_id")
        shown["jobs"][0].pop("id")
    assert (
        api
        == cli
        == {
            "action": "jobs.retry",
            "jobs": [{"outcome": "retried", "state": "dead"}],
        }
    )
    states = await conn.fetch(f"SELECT state::text FROM {schema}.job WHERE id = ANY($1)", dead)
    assert [r["state"] for r in states] == ["available", "available"]

    api = (await client.post("/api/queues/default/pause", headers=BEARER)).json()
    cli = await cli_json(dsn, schema, "queues", "pause", "default")
    assert api.keys() == cli.keys()
    assert (api["paused"], api["changed"], cli["changed"]) == (True, True, False)


async def test_action_errors_are_named(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str
) -> None:
    client = await console()
    unknown = await client.post("/api/jobs/424242/cancel", headers=BEARER)
    assert (unknown.status_code, unknown.json()) == (404, {"error": "no such job: 424242"})
    verb = await client.post(f"/api/jobs/{jobs['dead']}/explode", headers=BEARER)
    assert verb.status_code == 404 and "expected retry or cancel" in verb.json()["error"]
    queue = await client.post("/api/queues/-bad/pause", headers=BEARER)
    assert queue.status_code == 400
    assert await audit_rows(conn, schema) == []


async def test_a_console_without_a_token_file_is_read_only(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str
) -> None:
    client = await console(token=None)
    refused = await client.post(f"/api/jobs/{jobs['available']}/cancel", headers=BEARER)
    assert refused.status_code == 403
    assert "read-only" in refused.json()["error"]
    page = await client.get(f"/jobs/{jobs['available']}")
    assert page.status_code == 200
    assert "<button" not in page.text and "/actions/" not in page.text
    assert "read-only" in page.text
    assert await conn.fetchval(f"SELECT state::text FROM {schema}.job WHERE id = $1",
                               jobs["available"]) == "available"  # fmt: skip


# -- the forms: session and CSRF ---------------------------------------------------------


async def _log_in(client: httpx.AsyncClient) -> str:
    """Logs in; the CSRF field of the job pages' forms."""
    done = await client.post("/login", data={"token": TOKEN, "next": "/"})
    assert done.status_code == 303
    assert SESSION_COOKIE in client.cookies
    page = await client.get("/")
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert match, "no action form once logged in"
    return match.group(1)


async def test_forms_act_only_in_a_session_with_its_csrf_field(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str
) -> None:
    client = await console()
    url = f"/actions/jobs/{jobs['available']}/cancel"
    page = await client.get(f"/jobs/{jobs['available']}")
    assert "/actions/" not in page.text  # not logged in: no buttons
    assert (await client.post(url, data={"csrf": "x"})).status_code == 401
    wrong_login = await client.post("/login", data={"token": "guess-guess-guess-guess"})
    assert wrong_login.status_code == 403 and SESSION_COOKIE not in client.cookies

    csrf = await _log_in(client)
    assert (await client.post(url, data={"csrf": "0" * 64})).status_code == 403
    cross = await client.post(url, data={"csrf": csrf}, headers={"origin": "http://evil.test"})
    assert cross.status_code == 403
    assert await audit_rows(conn, schema) == []

    done = await client.post(url, data={"csrf": csrf, "next": "//evil.test/x"})
    assert done.status_code == 303
    assert done.headers["location"] == "/"  # never another site
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE id = $1",
                               jobs["available"]) == 0  # fmt: skip
    [audit] = await audit_rows(conn, schema)
    assert audit["action"] == "jobs.cancel"

    forged = httpx.Cookies({SESSION_COOKIE: "a.9999999999.deadbeef"})
    other = await console()
    other.cookies = forged
    assert (await other.post(url, data={"csrf": csrf})).status_code == 401


# -- escaping ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/jobs", "/jobs/{dead}", "/jobs/{completed}", "/dead", "/"])
async def test_hostile_strings_are_shown_as_text(
    console: Console, jobs: Population, path: str
) -> None:
    client = await console()
    page = await client.get(path.format(**jobs.ids))
    assert page.status_code == 200
    assert "<script>alert" not in page.text and "<img src=x" not in page.text
    assert "<b>done</b>" not in page.text
    if path != "/":
        assert "&lt;script&gt;alert" in page.text


async def test_fragments_are_the_live_region_only(console: Console, jobs: Population) -> None:
    client = await console()
    for path in ("/", "/jobs", f"/jobs/{jobs['dead']}", "/members", "/cron", "/dead"):
        page = await client.get(path)
        fragment = await client.get(path, headers={"hx-request": "true"})
        assert page.status_code == fragment.status_code == 200
        assert fragment.text.lstrip().startswith('<div id="live"'), path
        assert "<html" not in fragment.text and "<html" in page.text


# -- the samples behind the charts -------------------------------------------------------


async def test_the_sampler_counts_each_finish_once_and_trims(
    leading: RoleContext, conn: asyncpg.Connection, schema: str
) -> None:
    await enqueue(conn, schema, queue="mail")
    for reason in (None, None, "discarded", "cancelled"):
        await finish(conn, schema, await enqueue(conn, schema, queue="mail"), reason)
    sampler = QueueSampler()
    await sampler.tick(leading)
    await sampler.tick(leading)  # nothing finished since: counts nothing twice
    rows = await conn.fetch(f"SELECT * FROM {schema}.queue_sample WHERE queue = 'mail' ORDER BY at")
    assert [(r["available"], r["completed"], r["dead"], r["cancelled"]) for r in rows] == [
        (1, 2, 1, 1),
        (1, 0, 0, 0),
    ]
    await conn.execute(f"UPDATE {schema}.queue_sample SET at = at - interval '25 hours'")
    await sampler.tick(leading)
    left = await conn.fetch(f"SELECT at FROM {schema}.queue_sample WHERE queue = 'mail'")
    assert len(left) == 1  # the old ones trimmed, the new one written


async def test_a_deposed_sampler_writes_nothing(
    leading: RoleContext, conn: asyncpg.Connection, schema: str
) -> None:
    await conn.execute(f"UPDATE {schema}.leader SET resigned_at = now()")
    with pytest.raises(Deposed):
        await QueueSampler().tick(leading)
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.queue_sample") == 0


# -- the overview's counts: the leader's, published -------------------------------------


async def test_the_overview_shows_the_leaders_published_counts_and_api_status_counts_now(
    console: Console, leading: RoleContext, conn: asyncpg.Connection, schema: str
) -> None:
    for _ in range(3):
        await enqueue(conn, schema, queue="mail")
    await QueueStats().tick(leading)  # publishes 3 available in mail
    for _ in range(2):
        await enqueue(conn, schema, queue="mail")
    client = await console()

    def available(page: str) -> int:
        row = re.search(r'data-queue="mail">.*?<td class="num">(\d+)</td>', page, re.S)
        assert row, page
        return int(row.group(1))

    page = (await client.get("/", headers={"hx-request": "true"})).text
    assert available(page) == 3 and "as the leader counted them" in page
    # /api/status is `pgjobd status --json`: every live job counted now.
    assert (await client.get("/api/status")).json()["queues"]["mail"]["available"] == 5
    # Counts older than three of the leader's ticks (no leader): the console counts.
    await conn.execute(f"UPDATE {schema}.queue_count SET counted_at = now() - interval '1 min'")
    page = (await client.get("/", headers={"hx-request": "true"})).text
    assert available(page) == 5 and "counted now" in page


async def test_the_published_counts_follow_the_queues_and_a_deposed_leader_writes_none(
    leading: RoleContext, conn: asyncpg.Connection, schema: str
) -> None:
    await enqueue(conn, schema, queue="mail")
    await enqueue(conn, schema, queue="news")
    await QueueStats().tick(leading)
    await conn.execute(f"DELETE FROM {schema}.job WHERE queue = 'news'")
    await QueueStats().tick(leading)
    rows = await conn.fetch(f"SELECT queue, available FROM {schema}.queue_count ORDER BY 1")
    assert [(r["queue"], r["available"]) for r in rows] == [("default", 0), ("mail", 1)]
    await enqueue(conn, schema, queue="mail")
    await conn.execute(f"UPDATE {schema}.leader SET resigned_at = now()")
    with pytest.raises(Deposed):
        await QueueStats().tick(leading)
    count = f"SELECT available FROM {schema}.queue_count WHERE queue = 'mail'"
    assert await conn.fetchval(count) == 1


# -- the command -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "args", "message"),
    [
        ("", ["--listen", "localhost"], '--listen: expected "host:port"'),
        ('[web]\nlisten = "1.2.3.4:99999"\n', [], "web.listen: port must be 0-65535"),
        ('[web]\nadmin_token_file = "missing"\n', [], "web.admin_token_file: cannot read"),
    ],
)
async def test_the_command_refuses_a_bad_web_config_with_exit_78(
    dsn: str, tmp_path: Any, config: str, args: list[str], message: str
) -> None:
    path = tmp_path / "pgjobd.toml"
    path.write_text(config)
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "web", "--config", str(path), "--dsn", dsn, *args],
        check=False,
    )
    assert done.returncode == 78, done.stderr.decode()
    assert message in done.stderr.decode()


async def test_the_overview_shows_a_queues_limits(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str
) -> None:
    await conn.execute(
        f"""INSERT INTO {schema}.queue (name, global_concurrency, rate_limit, rate_window,
                max_depth) VALUES ('default', 4, 100, interval '1 minute', 5000)
            ON CONFLICT (name) DO UPDATE SET global_concurrency = 4, rate_limit = 100,
                rate_window = interval '1 minute', max_depth = 5000"""
    )
    client = await console()
    page = (await client.get("/")).text
    row = page[page.index('data-queue="default"') :].split("</tr>")[0]
    assert "1/4 running" in row and "depth ≤ 5000" in row
    limited = (await client.get("/api/status")).json()["queues"]["default"]["limited"]
    assert limited["global_concurrency"] == 4 and limited["rate_limit"] in row


async def test_the_overview_shows_the_circuit_breakers(
    console: Console, jobs: Population, conn: asyncpg.Connection, schema: str
) -> None:
    client = await console()
    assert "Circuit breakers" not in (await client.get("/")).text  # none declared
    await conn.execute(
        f"""INSERT INTO {schema}.kind (name, queue, breaker_failures, breaker_window,
                breaker_cooldown, breaker_limit, breaker_at)
            VALUES ('charge', 'default', 5, '1 minute', '30 s', 0, now()),
                   ('calm', 'default', 3, '10 s', '1 minute', NULL, NULL)"""
    )
    page = (await client.get("/")).text
    row = page[page.index('data-breaker="charge"') :].split("</tr>")[0]
    assert ">open</span>" in row and "5/1m failed" in row
    assert "closed" in page[page.index('data-breaker="calm"') :].split("</tr>")[0]
    api = (await client.get("/api/status")).json()["breakers"]
    assert api["charge"]["state"] == "open" and api["calm"]["state"] == "closed"


async def test_a_kinds_secret_fields_are_masked_as_the_cli_masks_them(
    console: Console, conn: asyncpg.Connection, schema: str, dsn: str
) -> None:
    await conn.execute(
        f"INSERT INTO {schema}.kind (name, queue, redact) VALUES ('login', 'default', "
        "ARRAY['password'])"
    )
    job_id = await enqueue(conn, schema, kind="login", args='{"user": "ada", "password": "s3"}')
    client = await console()
    api = (await client.get(f"/api/jobs/{job_id}")).json()
    assert api == await cli_json(dsn, schema, "jobs", "show", str(job_id))
    assert api["args"]["user"] == "ada" and api["args"]["password"] != "s3"
    page = (await client.get(f"/jobs/{job_id}")).text
    assert "ada" in page and "s3" not in page


async def test_a_jobs_page_shows_its_dependencies_dependants_and_expiry(
    console: Console, conn: asyncpg.Connection, schema: str
) -> None:
    first = await conn.fetchval(f"SELECT {schema}.enqueue('step', '{{}}')")
    second = await conn.fetchval(
        f"SELECT {schema}.enqueue('step', '{{}}', depends_on => ARRAY[$1::bigint], "
        "ttl => interval '1 hour')",
        first,
    )  # fmt: skip
    client = await console()
    blocked = (await client.get(f"/jobs/{second}")).text
    assert 'class="state state-blocked"' in blocked
    depends_on = blocked[blocked.index('class="depends-on"') :].split("</dd>")[0]
    assert f'<a href="/jobs/{first}">{first}</a>' in depends_on
    expires = blocked[blocked.index('class="expires"') :].split("</dd>")[0]
    assert expires.split(">", 1)[1].strip() not in ("", "-")
    waited_on = (await client.get(f"/jobs/{first}")).text
    dependants = waited_on[waited_on.index('class="dependants"') :].split("</dd>")[0]
    assert f'<a href="/jobs/{second}">{second}</a>' in dependants
    assert waited_on[waited_on.index('class="depends-on"') :].split("</dd>")[0].endswith(">-")
