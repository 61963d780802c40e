"""The smallest handler: an async function that greets someone."""

from __future__ import annotations

import msgspec

from pgjobd import JobContext, job


class Hello(msgspec.Struct):
    name: str


@job(queue="default", timeout="10s")
async def hello(args: Hello, ctx: JobContext) -> dict[str, str]:
    greeting = f"Hello, {args.name}!"
    ctx.logger.info(greeting)
    return {"greeting": greeting}
