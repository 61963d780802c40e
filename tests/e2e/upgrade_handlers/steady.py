"""Handlers the upgrade rehearsal runs on both releases: only what v0.1.0 knows."""

import time

from pgjobd import JobContext, Retry, job


@job(max_attempts=5)
def steady(args: dict[str, object]) -> dict[str, object]:
    time.sleep(0.02)
    return {"n": args.get("n")}


@job(max_attempts=5)
def fails_once(args: dict[str, object], ctx: JobContext) -> dict[str, object]:
    if ctx.attempt == 1:
        raise Retry(after="10ms")
    return {"attempt": ctx.attempt}
