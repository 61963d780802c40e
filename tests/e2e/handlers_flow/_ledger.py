"""The ledger the flow-control handlers keep: who ran what, when."""

import os
import time

import msgspec

from pgjobd import JobContext


class Ledger(msgspec.Struct):
    path: str
    hold_s: float = 0.0


def run(args: Ledger, ctx: JobContext) -> None:
    """Appends "job attempt start end pid kind" to the ledger file."""
    start = time.time()
    time.sleep(args.hold_s)
    with open(args.path, "a") as ledger:
        ledger.write(f"{ctx.id} {ctx.attempt} {start} {time.time()} {os.getpid()} {ctx.kind}\n")
