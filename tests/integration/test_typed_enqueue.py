"""Typed enqueue at run time: a handler as the kind gives its kind, its declared
defaults, and a check of the args against its args type; the string form stays."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypedDict

import anyio
import msgspec
import pytest

from pgjobd import Client, EnqueueError, JobContext, JobSpec, SyncClient, job

pytestmark = pytest.mark.anyio


class Welcome(msgspec.Struct):
    user_id: int
    locale: str = "en"


@dataclass
class Report:
    scope: str


class Ping(TypedDict):
    host: str


@job(queue="email", priority=3, max_attempts=4, kind="welcome.send")
async def send_welcome(args: Welcome, ctx: JobContext) -> None: ...


@job
def build_report(args: Report) -> None: ...


@job
async def ping(args: Ping) -> None: ...


def undecorated(args: Welcome) -> None: ...


@pytest.fixture
async def client(dsn: str, schema: str) -> AsyncIterator[Client]:
    async with await Client.connect(dsn, schema=schema) as c:
        yield c


async def test_a_handler_gives_its_kind_and_defaults(client: Client) -> None:
    job_id = await client.enqueue(send_welcome, Welcome(user_id=7))
    info = await client.job(job_id)
    assert info is not None
    assert (info.kind, info.queue, info.priority, info.max_attempts) == (
        "welcome.send",
        "email",
        3,
        4,
    )
    assert info.args == {"user_id": 7, "locale": "en"}
    other = await client.enqueue(send_welcome, Welcome(user_id=8), queue="bulk", priority=0)
    info = await client.job(other)
    assert info is not None and (info.queue, info.priority) == ("bulk", 0)
    report = await client.job(await client.enqueue(build_report, Report(scope="all")))
    assert report is not None and (report.kind, report.args) == ("build_report", {"scope": "all"})
    assert await client.enqueue(ping, {"host": "h"}) > 0
    assert await client.enqueue("welcome.send", {"user_id": 9}) > 0  # by name, unchecked


async def test_args_are_checked_against_the_handlers_type(client: Client) -> None:
    with pytest.raises(EnqueueError, match=r"must be a Welcome .* not Report"):
        await client.enqueue(send_welcome, Report(scope="x"))  # type: ignore[arg-type]
    with pytest.raises(EnqueueError, match="do not match Welcome"):
        await client.enqueue(send_welcome, {"user_id": "7"})  # type: ignore[arg-type]
    with pytest.raises(EnqueueError, match="do not match Ping"):
        await client.enqueue(ping, {"port": 1})  # type: ignore[typeddict-unknown-key]
    with pytest.raises(EnqueueError, match="decorated with @job"):
        await client.enqueue(undecorated, Welcome(user_id=1))


async def test_enqueue_many_takes_handlers_too(client: Client) -> None:
    ids = await client.enqueue_many(
        [(send_welcome, Welcome(user_id=1)), ("build_report", {"scope": "a"}),
         JobSpec("welcome.send", {"user_id": 2})],
    )  # fmt: skip
    kinds = [info.kind for info in [await client.job(i) for i in ids] if info is not None]
    assert kinds == ["welcome.send", "build_report", "welcome.send"]
    with pytest.raises(EnqueueError, match=r"job 2: args for 'welcome.send' must be a Welcome"):
        await client.enqueue_many([(send_welcome, Welcome(user_id=1)), (send_welcome, 5)])
    assert await client.job(max(ids) + 1) is None  # the refused batch wrote nothing


async def test_the_sync_client_takes_handlers(dsn: str, schema: str) -> None:
    def application() -> None:
        with SyncClient(dsn, schema=schema) as client:
            job_id = client.enqueue(send_welcome, Welcome(user_id=3))
            info = client.job(job_id)
            assert info is not None and info.kind == "welcome.send"

    await anyio.to_thread.run_sync(application)
