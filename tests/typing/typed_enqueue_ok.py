"""Typed enqueue as mypy sees it: this file must check clean (tests/unit/test_typed_enqueue.py)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pgjobd import Client, JobContext, job


class Welcome(msgspec.Struct):
    user_id: int


@dataclass
class Report:
    scope: str


@job(queue="email")
async def send_welcome(args: Welcome, ctx: JobContext) -> None: ...


@job
def build_report(args: Report) -> dict[str, int]:
    return {}


async def application(client: Client) -> list[int]:
    return [
        await client.enqueue(send_welcome, Welcome(user_id=7)),
        await client.enqueue(send_welcome, Welcome(user_id=7), delay="10s", tenant="acme"),
        await client.enqueue(build_report, Report(scope="all"), priority=1),
        await client.enqueue("send_welcome", {"user_id": 7}),  # the string-kind form stays
    ]
