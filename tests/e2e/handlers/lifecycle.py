"""Handlers for the job lifecycle's end-to-end tests (dependencies, batches, debounce)."""

import asyncio
import json
import os
import time

import msgspec

from pgjobd import Discard, JobContext, job


class Node(msgspec.Struct):
    ledger: str
    name: str
    hold_s: float = 0.0
    fail: bool = False


@job(max_attempts=3)
async def workflow_node(args: Node, ctx: JobContext) -> dict[str, object]:
    """Appends one JSON line per run: the node, its id, what it waited for and their
    results, and when it started and ended. Returns its name."""
    start = time.time()
    results = await ctx.results()
    if args.hold_s:
        await asyncio.sleep(args.hold_s)
    if args.fail:
        raise Discard(f"node {args.name} fails on purpose")
    line = {
        "name": args.name, "id": ctx.id, "attempt": ctx.attempt, "start": start,
        "end": time.time(), "dependencies": ctx.dependencies,
        "results": {str(k): v for k, v in results.items()}, "pid": os.getpid(),
        "batch": list(ctx.batch) if ctx.batch is not None else None,
    }  # fmt: skip
    with open(args.ledger, "a") as ledger:  # noqa: ASYNC230 (one short line)
        ledger.write(json.dumps(line) + "\n")
    return {"name": args.name}
