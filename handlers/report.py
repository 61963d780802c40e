"""Plain `def` handlers, which run in a thread of the worker process, and outcomes."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from pgjobd import Discard, JobContext, Retry, Snooze, job


@dataclass
class ReportArgs:
    scope: Literal["all", "today"] = "all"


@job(timeout="2m", max_attempts=3)
def build_report(args: ReportArgs, ctx: JobContext) -> dict[str, Any]:
    rows = 1000 if args.scope == "all" else 40
    for _ in range(10):
        if ctx.cancelled.is_set():  # cancelled, or the lease was lost: stop early
            raise Retry(after="1m")
        time.sleep(0.05)  # stands in for the real work
    return {"scope": args.scope, "rows": rows}


class Webhook(msgspec.Struct):
    url: str
    event: str


@job(queue="default", max_attempts=5, discard_on=(ValueError,))
def flaky_webhook(args: Webhook, ctx: JobContext) -> dict[str, Any]:
    if urlsplit(args.url).scheme not in ("http", "https"):  # a malformed url: ValueError
        raise Discard(f"not an http(s) url: {args.url}")
    # A simulated remote end, so the example needs no network.
    status = random.choice([200, 200, 429, 503])
    if status == 429:
        raise Snooze("30s")  # rate limited: try later without spending an attempt
    if status >= 500:
        raise Retry(after="10s")
    ctx.logger.info("delivered %s to %s", args.event, args.url)
    return {"status": status}
