"""The member's HTTP endpoint on `daemon.metrics_listen`: /metrics, /healthz, /readyz.

A minimal HTTP/1.1 server on the daemon's own event loop (one request per connection,
GET or HEAD), so that a scrape reads the member's state without locks, and an answer
at all proves the loop is turning. It starts before anything else, so /healthz answers
during start-up, and stops last.

- /healthz: 200 while the process works: the event loop keeps up (`LoopMonitor`) and no
  core task has died. 503 otherwise; orchestrators restart on it.
- /readyz: 200 only while the member is ready (contract §5: schema checked, first worker
  generation ready, producers claiming) and stays so: the database answered recently,
  the LISTEN session is up, outcomes are being recorded, no queue is crash-looping, not
  draining. 503 with a JSON body listing the problems otherwise; load balancers and
  dashboards use it, it restarts nothing.

Both answer JSON: {"status": "ok"|"unavailable", "problems": [...]}.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from pgjobd import metrics
from pgjobd.errors import PgjobdError

log = logging.getLogger(__name__)

LOOP_PROBE_S = 0.5
LOOP_LAG_LIMIT_S = 5.0  # a loop this late is stuck (a blocking call), not busy
DB_STALE_S = 20.0  # no database round trip for this long: not ready
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192


@dataclass
class Checks:
    """The member's state as the probes judge it (a snapshot; see Member.health_checks)."""

    started: bool = False  # ready once: schema, first generation, producers, joined
    draining: bool = False
    dead_task: str | None = None  # a core task that died, and how
    db_ok_age_s: float | None = None  # since the last successful database round trip
    db_error: str | None = None  # the last round trip's failure, until one succeeds
    listener_healthy: bool = False
    recording: bool = True  # the completer can write outcomes
    failed_queues: dict[str, str] = field(default_factory=dict)  # queue -> why
    loop_lag_s: float = 0.0


def live_problems(c: Checks) -> list[str]:
    problems = []
    if c.dead_task is not None:
        problems.append(f"core task died: {c.dead_task}")
    if c.loop_lag_s > LOOP_LAG_LIMIT_S:
        problems.append(f"event loop stalled: woke {c.loop_lag_s:.1f} s late")
    return problems


def ready_problems(c: Checks) -> list[str]:
    problems = live_problems(c)
    if not c.started:
        problems.append("starting")
    if c.draining:
        problems.append("draining")
    if c.db_error is not None:
        problems.append(f"database: {c.db_error}")
    elif c.started and (c.db_ok_age_s is None or c.db_ok_age_s > DB_STALE_S):
        age = "never" if c.db_ok_age_s is None else f"{c.db_ok_age_s:.0f} s ago"
        problems.append(f"database: last successful round trip {age}")
    if c.started and not c.listener_healthy:
        problems.append("LISTEN session down")
    if not c.recording:
        problems.append("cannot record outcomes in the database")
    for queue, why in sorted(c.failed_queues.items()):
        problems.append(f"queue {queue} crash-looping: {why}")
    return problems


class LoopMonitor:
    """Measures how late the event loop wakes a short sleep."""

    def __init__(self) -> None:
        self.lag_s = 0.0

    async def run(self) -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(LOOP_PROBE_S)
            self.lag_s = max(0.0, time.monotonic() - before - LOOP_PROBE_S)


_encoder = msgspec.json.Encoder()


def _status_body(problems: list[str]) -> tuple[int, bytes]:
    status = "unavailable" if problems else "ok"
    body = _encoder.encode({"status": status, "problems": problems}) + b"\n"
    return (503 if problems else 200), body


def respond(method: str, path: str, checks: Callable[[], Checks]) -> tuple[int, str, bytes]:
    """(status, content type, body) for one request."""
    path = path.split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return 405, "text/plain; charset=utf-8", b"method not allowed\n"
    if path == "/metrics":
        return 200, metrics.CONTENT_TYPE, metrics.exposition()
    if path in ("/healthz", "/livez"):
        return _json(_status_body(live_problems(checks())))
    if path == "/readyz":
        return _json(_status_body(ready_problems(checks())))
    if path == "/":
        return 200, "text/plain; charset=utf-8", b"pgjobd: /metrics /healthz /readyz\n"
    return 404, "text/plain; charset=utf-8", b"not found\n"


def _json(answer: tuple[int, bytes]) -> tuple[int, str, bytes]:
    return answer[0], "application/json", answer[1]


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}  # fmt: skip


async def serve(
    host: str,
    port: int,
    checks: Callable[[], Checks],
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; reports the port bound (useful with port 0)."""
    try:
        listener = await anyio.create_tcp_listener(local_host=host or None, local_port=port)
    except OSError as e:
        raise PgjobdError(f"daemon.metrics_listen: cannot listen on {host}:{port}: {e}") from e
    # Bandit's B610 is about Django's raw-SQL .extra(); this is anyio's attribute lookup.
    bound = listener.listeners[0].extra(SocketAttribute.local_port)  # nosec B610
    log.info(
        "serving /metrics, /healthz and /readyz on %s:%d", host or "*", bound,
        extra={"event": "metrics.listening", "port": bound},
    )  # fmt: skip
    task_status.started(bound)

    async def handle(stream: SocketStream) -> None:
        try:
            await _handle(stream, checks)
        except Exception as e:  # one bad client never stops the server
            log.debug("metrics endpoint: %s", e)
        finally:
            with anyio.move_on_after(1, shield=True):
                await stream.aclose()

    async with listener:
        await listener.serve(handle)


async def _handle(stream: SocketStream, checks: Callable[[], Checks]) -> None:
    head = b""
    with anyio.move_on_after(REQUEST_TIMEOUT_S):
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            if len(head) > MAX_REQUEST_BYTES:
                break
            try:
                head += await stream.receive(4096)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                break
    request_line = head.split(b"\n", 1)[0].decode("latin-1").strip()
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        if not head:
            return
        status, content_type, body = 400, "text/plain; charset=utf-8", b"bad request\n"
        method = "GET"
    else:
        method, path = parts[0], parts[1]
        status, content_type, body = respond(method, path, checks)
    headers = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    await stream.send(headers if method == "HEAD" else headers + body)
