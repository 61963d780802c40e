"""Typed enqueue mistakes mypy must report, each on the line marked `# error`
(tests/unit/test_typed_enqueue.py)."""

from __future__ import annotations

import msgspec

from pgjobd import Client, JobContext, job


class Welcome(msgspec.Struct):
    user_id: int


class Invoice(msgspec.Struct):
    number: str


@job
async def send_welcome(args: Welcome, ctx: JobContext) -> None: ...


async def application(client: Client) -> None:
    await client.enqueue(send_welcome, Invoice(number="7"))  # error
    await client.enqueue(send_welcome, Welcome(user_id=7), delay=[1])  # error
    await client.enqueue(send_welcome, Welcome(user_id=7), colour="red")  # error
