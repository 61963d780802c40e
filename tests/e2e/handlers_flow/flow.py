"""Handlers for the flow-control end-to-end tests: a ledger of who ran what, when. Kept
apart from ../handlers because a kind with a limit puts every queue of the fleet on the
limited claim path."""

import os
import time

import msgspec

from pgjobd import JobContext, job


class Ledger(msgspec.Struct):
    path: str
    hold_s: float = 0.0


def _run(args: Ledger, ctx: JobContext) -> None:
    start = time.time()
    time.sleep(args.hold_s)
    with open(args.path, "a") as ledger:
        ledger.write(f"{ctx.id} {ctx.attempt} {start} {time.time()} {os.getpid()} {ctx.kind}\n")


@job(queue="api")
def limited_record(args: Ledger, ctx: JobContext) -> None:
    """Appends "job attempt start end pid kind" to the ledger file."""
    _run(args, ctx)


@job(queue="api", global_concurrency=2, rate_limit="1000/1s")
def capped_record(args: Ledger, ctx: JobContext) -> None:
    """The same, for a kind that declares its own fleet-wide limit."""
    _run(args, ctx)
