"""The console's ASGI application: pages, htmx fragments, /api/ and the actions.

Reads come from admin.py (the CLI's functions, so the JSON is the CLI's `--json`) and
web/reads.py; actions are admin.py's, audited as the CLI's are, with os_user
"web@<client address>". A request made by htmx (header HX-Request) gets only the page's
live region, which it polls every `refresh_s`. Every template is autoescaped.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any
from urllib.parse import urlencode

import asyncpg
import msgspec
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pgjobd import admin, cron_schedule, migrate
from pgjobd.client import Client, JobInfo
from pgjobd.redact import redact_args
from pgjobd.roles import queue_stats
from pgjobd.statements.web import SampleRow
from pgjobd.web import charts, reads
from pgjobd.web.auth import SESSION_COOKIE, SESSION_S, Guard, Session

REFRESH_S = 5.0
MAX_LIMIT = 500
CHART_HOURS = (1, 6, 24)
CRON_NEXT_RUNS = 3
# The overview shows the live counts the leader publishes every queue_stats.INTERVAL_S
# (instead of counting every live job on every refresh of every tab) while they are at
# most this old; older (no leader), it counts them itself, as `pgjobd status` does.
PUBLISHED_COUNTS = timedelta(seconds=3 * queue_stats.INTERVAL_S)

_json = msgspec.json.Encoder()


class BadRequest(Exception):
    """A bad query parameter or form field: 400, with this message."""


@dataclass
class Console:
    """What every handler needs: the pool, the schema, who may act."""

    schema: str
    guard: Guard
    refresh_s: float
    pool: asyncpg.Pool | None = None

    _client: Client | None = None

    @property
    def db(self) -> asyncpg.Pool:
        assert self.pool is not None, "the console's pool is made at start-up"
        return self.pool

    @property
    def client(self) -> Client:
        """One Client for the console's life (it checks the schema once, not per page)."""
        if self._client is None or self._client.pool is not self.db:
            self._client = Client(self.db, schema=self.schema)
        return self._client


def create_app(
    *,
    schema: str,
    token: str | None,
    dsn: str | None = None,
    pool: asyncpg.Pool | None = None,
    refresh_s: float = REFRESH_S,
    statement_timeout_s: float = 30.0,
) -> Starlette:
    """The console for `schema`, on `pool` (the caller's, left open) or on a pool of
    its own to `dsn` (made at start-up, after checking the schema's version)."""
    console = Console(schema=schema, guard=Guard(token), refresh_s=refresh_s, pool=pool)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if pool is not None:
            yield
            return
        assert dsn is not None, "create_app needs a dsn or a pool"
        own = await asyncpg.create_pool(
            dsn, min_size=1, max_size=4,
            server_settings={
                "application_name": "pgjobd web",
                "statement_timeout": str(int(statement_timeout_s * 1000)),
                # One core of the server per console query at most: the counts it
                # reads must not take the cores the fleet's claims and completions use.
                "max_parallel_workers_per_gather": "0",
                # A plan for each execution's values: the console's statements have
                # optional filters ("$3 IS NULL OR ..."), and a generic plan made after
                # `dlq list`'s calls without a window grouped 24 h of dead jobs by sorting
                # 50,000 rows it expected to be 71 (112 ms against 47 ms).
                "plan_cache_mode": "force_custom_plan",
            },
        )  # fmt: skip
        try:
            async with own.acquire() as conn:
                await migrate.check_schema(conn, schema)
            console.pool = own
            yield
        finally:
            console.pool = None
            await own.close()

    def page(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(console, request)
            except BadRequest as e:
                if request.url.path.startswith("/api/"):
                    return _error(str(e), 400)
                return _render(
                    console, request, "error.html", status_code=400, full=True, status=400,
                    message=str(e),
                )  # fmt: skip

        return endpoint

    routes = [
        Route("/", page(overview)),
        Route("/jobs", page(jobs_page)),
        Route("/jobs/{job_id:int}", page(job_page)),
        Route("/members", page(members_page)),
        Route("/cron", page(cron_page)),
        Route("/dead", page(dead_page)),
        Route("/login", page(login_page), methods=["GET"]),
        Route("/login", page(login), methods=["POST"]),
        Route("/logout", page(logout), methods=["POST"]),
        Route("/actions/jobs/{job_id:int}/{verb}", page(job_action_form), methods=["POST"]),
        Route("/actions/queues/{queue}/{verb}", page(queue_action_form), methods=["POST"]),
        Route("/actions/dead/{key}/redrive", page(group_redrive_form), methods=["POST"]),
        Route("/api/status", page(api_status)),
        Route("/api/jobs", page(api_jobs)),
        Route("/api/jobs/{job_id:int}", page(api_job)),
        Route("/api/cron", page(api_cron)),
        Route("/api/dead", page(api_dead)),
        Route("/api/dead/groups", page(api_dead_groups)),
        Route("/api/jobs/{job_id:int}/{verb}", page(api_job_action), methods=["POST"]),
        Route("/api/queues/{queue}/{verb}", page(api_queue_action), methods=["POST"]),
        Route("/api/dead/groups/{key}/redrive", page(api_group_redrive), methods=["POST"]),
        Route("/api/dead/redrive", page(api_redrive), methods=["POST"]),
        Mount("/static", StaticFiles(packages=[("pgjobd.web", "static")]), name="static"),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(ServerTiming)],
    )


Handler = Callable[[Console, Request], Awaitable[Response]]


class ServerTiming:
    """Adds ``Server-Timing: app;dur=<ms>`` (what bench/web.py measures), and the
    headers every response carries: no framing, no sniffing, a strict script policy."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - started) * 1000
                headers = list(message.get("headers", []))
                headers += [
                    (b"server-timing", f"app;dur={ms:.1f}".encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"content-security-policy", _CSP),
                    (b"referrer-policy", b"same-origin"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, timed)


_CSP = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


# -- rendering ---------------------------------------------------------------------------

_env = Environment(
    loader=PackageLoader("pgjobd.web", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{int(seconds)}s"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n)[:8] or "0s"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


_env.filters["when"] = _when
_env.filters["age"] = _age
_env.filters["pretty"] = _pretty


def _render(
    console: Console, request: Request, name: str, status_code: int = 200, **context: Any
) -> HTMLResponse:
    """The page `name`, or only its live region (`_name`) for an htmx poll."""
    session = console.guard.session(request.cookies.get(SESSION_COOKIE))
    fragment = request.headers.get("hx-request") == "true" and not context.get("full")
    template = _env.get_template(f"_{name}" if fragment else name)
    path_qs = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    html = template.render(
        request=request, path_qs=path_qs, refresh_s=console.refresh_s,
        read_only=console.guard.read_only, session=session,
        can_act=session is not None, **context,
    )  # fmt: skip
    return HTMLResponse(html, status_code=status_code)


def _json_response(value: object, status_code: int = 200) -> Response:
    return Response(_json.encode(value), status_code=status_code, media_type="application/json")


def _error(message: str, status_code: int, **headers: str) -> Response:
    return _json_response({"error": message}, status_code) if not headers else Response(
        _json.encode({"error": message}), status_code=status_code,
        media_type="application/json", headers=headers,
    )  # fmt: skip


# -- parameters --------------------------------------------------------------------------


@dataclass(frozen=True)
class JobFilter:
    states: list[str] | None
    queue: str | None
    kind: str | None
    tenant: str | None
    limit: int
    cursor: int | None

    def query(self, **changes: Any) -> str:
        """This filter's query string, with `changes` (None drops a key)."""
        values: dict[str, Any] = {
            "state": ",".join(self.states) if self.states else None,
            "queue": self.queue, "kind": self.kind, "tenant": self.tenant,
            "limit": self.limit if self.limit != admin.DEFAULT_LIMIT else None,
            "cursor": self.cursor,
        }  # fmt: skip
        values.update(changes)
        return urlencode({k: v for k, v in values.items() if v not in (None, "")})


def _job_filter(request: Request) -> JobFilter:
    params = request.query_params
    states = [s for given in params.getlist("state") for s in given.split(",") if s]
    bad = sorted(set(states) - set(admin.STATES))
    if bad:
        raise BadRequest(
            f"state: unknown state {', '.join(bad)}; expected one of {', '.join(admin.STATES)}"
        )
    return JobFilter(
        states=states or None,
        queue=params.get("queue") or None,
        kind=params.get("kind") or None,
        tenant=params.get("tenant") or None,
        limit=_int_param(request, "limit", admin.DEFAULT_LIMIT, 1, MAX_LIMIT),
        cursor=_int_param(request, "cursor", None, 1, 2**63 - 1),
    )


def _int_param(request: Request, name: str, default: int | None, low: int, high: int) -> Any:
    given = request.query_params.get(name)
    if given in (None, ""):
        return default
    try:
        value = int(given)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, got {given!r}") from None
    if not low <= value <= high:
        raise BadRequest(f"{name}: expected {low}-{high}, got {value}")
    return value


async def _list_jobs(console: Console, f: JobFilter) -> tuple[list[admin.JobSummary], int | None]:
    """One page of jobs and the cursor of the next (None on the last page)."""
    jobs = await admin.list_jobs(
        console.db, console.schema, states=f.states, queue=f.queue, kind=f.kind,
        tenant=f.tenant, limit=f.limit + 1, before=f.cursor,
    )  # fmt: skip
    if len(jobs) > f.limit:
        jobs = jobs[: f.limit]
        return jobs, jobs[-1].id
    return jobs, None


# -- pages -------------------------------------------------------------------------------


async def overview(console: Console, request: Request) -> Response:
    hours = _int_param(request, "hours", 6, 1, 24)
    status, counted_at = await admin.status_as_counted(
        console.db, console.schema, published_within=PUBLISHED_COUNTS
    )
    now = await reads.now(console.db, console.schema)
    samples = await reads.samples(console.db, console.schema, within=timedelta(hours=hours))
    drawn = _charts(hours, now.replace(second=0, microsecond=0), tuple(samples))
    return _render(
        console, request, "overview.html", status=status, hours=hours,
        hour_choices=CHART_HOURS, charts=list(drawn),
        counted_age_s=(now - counted_at).total_seconds() if counted_at else None,
    )  # fmt: skip


@lru_cache(maxsize=16)
def _charts(hours: int, minute: datetime, samples: tuple[SampleRow, ...]) -> tuple[Markup, Markup]:
    """The overview's charts of `samples` over the `hours` up to `minute`: redrawn when a
    sample arrives (once a minute) or the minute turns, not on every refresh of every
    tab (the ~1,800 points of 6 hours were most of the overview's time)."""
    start = minute - timedelta(hours=hours)
    end = minute + timedelta(minutes=1)
    times = [s.at for s in samples]
    throughput = charts.line_chart(
        "Jobs finished per minute", times,
        [charts.Series("completed", "completed", [s.completed for s in samples]),
         charts.Series("dead", "dead", [s.dead for s in samples])],
        start, end,
    )  # fmt: skip
    depth = charts.line_chart(
        "Live jobs", times,
        [charts.Series("available", "available", [s.available for s in samples]),
         charts.Series("running", "running", [s.running for s in samples]),
         charts.Series("waiting", "retryable", [s.scheduled + s.retryable for s in samples])],
        start, end,
    )  # fmt: skip
    return throughput, depth


async def jobs_page(console: Console, request: Request) -> Response:
    f = _job_filter(request)
    jobs, next_cursor = await _list_jobs(console, f)
    return _render(
        console, request, "jobs.html", jobs=jobs, filter=f, next_cursor=next_cursor,
        states=admin.STATES,
    )  # fmt: skip


async def job_page(console: Console, request: Request) -> Response:
    job_id: int = request.path_params["job_id"]
    info = await _job(console, job_id)
    if info is None:
        return _render(
            console, request, "error.html", status_code=404, full=True, status=404,
            message=f"no such job: {job_id}",
        )  # fmt: skip
    attempts = await reads.job_attempts(console.db, console.schema, job_id)
    return _render(console, request, "job.html", job=info, attempts=attempts)


async def _job(console: Console, job_id: int) -> JobInfo | None:
    """The job as `pgjobd jobs show` shows it: its handler's redact=[...] fields masked."""
    info = await console.client.job(job_id)
    if info is None:
        return None
    secret = await admin.redacted_fields(console.db, console.schema, info.kind)
    return msgspec.structs.replace(info, args=redact_args(info.args, secret))


async def members_page(console: Console, request: Request) -> Response:
    from pgjobd.daemon import leader_roles  # noqa: PLC0415 (the daemon's modules, only here)

    members, leader = await admin.fleet(console.db, console.schema)
    now = await reads.now(console.db, console.schema)
    ages = {m.id: (now - m.heartbeat_at).total_seconds() for m in members}
    return _render(
        console, request, "members.html", members=members, leader=leader, heartbeat_age=ages,
        roles=[role.name for role in leader_roles()],
    )  # fmt: skip


@dataclass(frozen=True)
class CronRow:
    entry: admin.CronListed
    next_runs: list[datetime]  # in the entry's zone


async def cron_page(console: Console, request: Request) -> Response:
    entries = await admin.list_cron(console.db, console.schema)
    rows = [CronRow(e, _next_runs(e)) for e in entries]
    return _render(console, request, "cron.html", rows=rows)


def _next_runs(entry: admin.CronListed) -> list[datetime]:
    if entry.next_run is None or entry.error is not None:
        return []
    return list(_runs_from(entry.schedule, entry.timezone, entry.next_run))


@lru_cache(maxsize=1024)
def _runs_from(schedule: str, timezone: str, first: datetime) -> tuple[datetime, ...]:
    """CRON_NEXT_RUNS runs from `first` in the schedule's zone: the same until `first`
    passes, so remembered rather than computed on every refresh."""
    zone = cron_schedule.zone_of(timezone)
    runs = [first]
    while len(runs) < CRON_NEXT_RUNS:
        following = cron_schedule.next_slot(schedule, zone, runs[-1])
        if following is None:
            break
        runs.append(following)
    return tuple(run.astimezone(zone) for run in runs)


async def dead_page(console: Console, request: Request) -> Response:
    hours = _dead_hours(request)
    groups = await reads.dead_groups(console.db, console.schema, within=timedelta(hours=hours))
    return _render(
        console, request, "dead.html", groups=groups, hours=hours, hour_choices=reads.DEAD_HOURS
    )


def _dead_hours(request: Request) -> int:
    hours: int = _int_param(request, "hours", reads.DEAD_HOURS[0], 1, 24 * 31)
    return hours


# -- sessions ----------------------------------------------------------------------------


async def login_page(console: Console, request: Request) -> Response:
    return _render(
        console, request, "login.html", full=True, next=_local(request.query_params.get("next"))
    )


async def login(console: Console, request: Request) -> Response:
    if not _same_origin(request):
        return _forbidden_page(console, request, "cross-site request refused")
    form = await request.form()
    target = _local(_field(form, "next"))
    if console.guard.read_only:
        return _forbidden_page(console, request, "this console is read-only (no token file)")
    if not console.guard.token_ok(_field(form, "token")):
        return _render(
            console, request, "login.html", status_code=403, full=True, next=target,
            failed=True,
        )  # fmt: skip
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE, console.guard.new_cookie(), max_age=SESSION_S, httponly=True,
        samesite="strict", secure=request.url.scheme == "https", path="/",
    )  # fmt: skip
    return response


async def logout(console: Console, request: Request) -> Response:
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


def _local(target: str | None) -> str:
    """A redirect target on this site: a path, never another host (//x, /\\x)."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target


def _field(form: FormData, name: str) -> str:
    value = form.get(name)
    return value if isinstance(value, str) else ""


def _same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another origin."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    host = request.headers.get("host", "")
    return origin.split("://", 1)[-1] == host


def _forbidden_page(console: Console, request: Request, message: str) -> Response:
    return _render(
        console, request, "error.html", status_code=403, full=True, status=403, message=message
    )


async def _form_session(console: Console, request: Request) -> tuple[Session | None, Response]:
    """The session of an action form, or the refusal to send."""
    if console.guard.read_only:
        return None, _forbidden_page(console, request, "this console is read-only")
    if not _same_origin(request):
        return None, _forbidden_page(console, request, "cross-site request refused")
    session = console.guard.session(request.cookies.get(SESSION_COOKIE))
    if session is None:
        return None, _render(
            console, request, "error.html", status_code=401, full=True, status=401,
            message="log in with the admin token to act",
        )  # fmt: skip
    form = await request.form()
    if not console.guard.csrf_ok(session, _field(form, "csrf")):
        return None, _forbidden_page(console, request, "the form's CSRF field does not match")
    return session, RedirectResponse(_local(_field(form, "next")), status_code=303)


def _user(request: Request) -> str:
    return f"web@{request.client.host if request.client else 'unknown'}"


# -- actions (shared by the forms and the API) -------------------------------------------


async def _job_action(console: Console, request: Request) -> Any:
    job_id: int = request.path_params["job_id"]
    verb = request.path_params["verb"]
    if verb == "retry":
        return await admin.retry_jobs(console.db, console.schema, [job_id], user=_user(request))
    if verb == "cancel":
        return await admin.cancel_jobs(console.db, console.schema, [job_id], user=_user(request))
    raise LookupError(f"no action {verb!r} on jobs: expected retry or cancel")


async def _queue_action(console: Console, request: Request) -> Any:
    queue = request.path_params["queue"]
    verb = request.path_params["verb"]
    if verb not in ("pause", "resume"):
        raise LookupError(f"no action {verb!r} on queues: expected pause or resume")
    return await admin.set_paused(
        console.db, console.schema, queue, verb == "pause", user=_user(request)
    )


async def _group_redrive(console: Console, request: Request) -> Any:
    return await admin.redrive_group(
        console.db, console.schema, request.path_params["key"],
        within=timedelta(hours=_dead_hours(request)), user=_user(request),
    )  # fmt: skip


Action = Callable[[Console, Request], Awaitable[Any]]


async def _act(action: Action, console: Console, request: Request) -> tuple[Any, Response | None]:
    """Runs an action; (its result, None) or (None, the error response)."""
    try:
        return await action(console, request), None
    except LookupError as e:
        return None, _error(str(e), 404)
    except admin.UnknownJobs as e:
        return None, _error(str(e), 404)
    except admin.RetryBlocked as e:
        return None, _error(str(e), 409)
    except admin.InvalidInput as e:
        return None, _error(str(e), 400)


def _form_action(action: Action) -> Handler:
    async def handler(console: Console, request: Request) -> Response:
        session, response = await _form_session(console, request)
        if session is None:
            return response
        _, failed = await _act(action, console, request)
        if failed is not None:
            message = msgspec.json.decode(failed.body)["error"]
            return _render(
                console, request, "error.html", status_code=failed.status_code, full=True,
                status=failed.status_code, message=message,
            )  # fmt: skip
        return response

    return handler


def _api_action(action: Action) -> Handler:
    async def handler(console: Console, request: Request) -> Response:
        if console.guard.read_only:
            return _error("this console is read-only: no [web] admin_token_file", 403)
        header = request.headers.get("authorization")
        if header is None:
            return _error(
                "actions need Authorization: Bearer <token>", 401, **{"www-authenticate": "Bearer"}
            )
        if not console.guard.bearer_ok(header):
            return _error("wrong token", 403)
        done, failed = await _act(action, console, request)
        return failed if failed is not None else _json_response(done)

    return handler


job_action_form = _form_action(_job_action)
queue_action_form = _form_action(_queue_action)
group_redrive_form = _form_action(_group_redrive)
api_job_action = _api_action(_job_action)
api_queue_action = _api_action(_queue_action)
api_group_redrive = _api_action(_group_redrive)


async def _redrive_filtered(console: Console, request: Request) -> Any:
    params = request.query_params
    hours = _int_param(request, "since_hours", None, 1, 24 * 366)
    return await admin.redrive(
        console.db, console.schema, kind=params.get("kind") or None,
        queue=params.get("queue") or None,
        since=timedelta(hours=hours) if hours is not None else None, user=_user(request),
    )  # fmt: skip


api_redrive = _api_action(_redrive_filtered)


# -- API reads ---------------------------------------------------------------------------


async def api_status(console: Console, request: Request) -> Response:
    return _json_response(await admin.status(console.db, console.schema))


async def api_jobs(console: Console, request: Request) -> Response:
    jobs, next_cursor = await _list_jobs(console, _job_filter(request))
    return _json_response({"jobs": jobs, "next_cursor": next_cursor})


async def api_job(console: Console, request: Request) -> Response:
    job_id: int = request.path_params["job_id"]
    info = await _job(console, job_id)
    if info is None:
        return _error(f"no such job: {job_id}", 404)
    return _json_response(info)


async def api_cron(console: Console, request: Request) -> Response:
    return _json_response({"schedules": await admin.list_cron(console.db, console.schema)})


async def api_dead(console: Console, request: Request) -> Response:
    """`dlq list --json`: the dead jobs, and their groups by error fingerprint."""
    params = request.query_params
    kind, queue = params.get("kind") or None, params.get("queue") or None
    jobs = await admin.list_dead(
        console.db, console.schema, kind=kind, queue=queue,
        limit=_int_param(request, "limit", admin.DEFAULT_LIMIT, 1, MAX_LIMIT),
    )  # fmt: skip
    groups = await admin.group_dead(console.db, console.schema, kind=kind, queue=queue)
    return _json_response({"groups": groups, "jobs": jobs})


async def api_dead_groups(console: Console, request: Request) -> Response:
    within = timedelta(hours=_dead_hours(request))
    groups = await reads.dead_groups(console.db, console.schema, within=within)
    return _json_response({"groups": [group._asdict() for group in groups]})
