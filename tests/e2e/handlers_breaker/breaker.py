"""Handlers for the circuit breaker's end-to-end test: a kind that fails while a flag
file exists, with a ledger of its runs."""

import os
import time

import msgspec

from pgjobd import JobContext, job


class Flaky(msgspec.Struct):
    ledger: str
    broken: str  # while this file exists, the handler fails
    hold_s: float = 0.0


@job(queue="api", max_attempts=50, circuit_breaker="3/1m", breaker_cooldown="3s")
def breaker_flaky(args: Flaky, ctx: JobContext) -> None:
    """Appends "job attempt start" to the ledger, then fails while `broken` exists."""
    with open(args.ledger, "a") as ledger:
        ledger.write(f"{ctx.id} {ctx.attempt} {time.time()}\n")
    time.sleep(args.hold_s)
    if os.path.exists(args.broken):
        raise RuntimeError("the service behind this kind is down")
