"""The testing kit's pytest plugin (entry point `pgjobd`), run by pytester on sample
suites in a pytest process of their own, against the session's PostgreSQL."""

from __future__ import annotations

import re
import textwrap

import asyncpg
import pytest

HANDLER = """
import msgspec
from pgjobd import JobContext, Retry, job


class Greet(msgspec.Struct):
    name: str


@job(queue="greetings", max_attempts=2)
async def greet(args: Greet, ctx: JobContext) -> dict:
    if args.name == "flaky" and ctx.attempt == 1:
        raise Retry(after="1h")
    return {"greeting": f"hello, {args.name}", "attempt": ctx.attempt}
"""

SUITE = """
import pytest
from pgjobd.testing import all_enqueued, assert_enqueued, assert_not_enqueued

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_enqueue_then_drain(pgjobd_client, pgjobd_drain):
    print("SCHEMA", pgjobd_client.schema)
    job_id = await pgjobd_client.enqueue("greet", {"name": "Ada"})
    await assert_enqueued("greet", args={"name": "Ada"}, queue="greetings")
    [outcome] = await pgjobd_drain()
    assert (outcome.job_id, outcome.state) == (job_id, "completed")
    assert outcome.result["greeting"] == "hello, Ada" + SUFFIX
    info = await pgjobd_client.job(job_id)
    assert info.state == "completed" and info.attempt == 1
    await assert_not_enqueued("greet")


async def test_retries_are_fast_forwarded(pgjobd_client, pgjobd_drain):
    print("SCHEMA", pgjobd_client.schema)
    assert await all_enqueued() == []  # a fresh schema: nothing from the other test
    job_id = await pgjobd_client.enqueue("greet", {"name": "flaky"})
    [first] = await pgjobd_drain()
    assert (first.state, first.after.total_seconds()) == ("retryable", 3600)
    assert await pgjobd_drain() == []  # not due for an hour
    [second] = await pgjobd_drain(fast_forward=True)
    assert (second.job_id, second.state, second.attempt) == (job_id, "completed", 2)
"""

MIDDLEWARE = """
async def shout(ctx, call_next):
    value = await call_next()
    value["greeting"] = value["greeting"] + "!"
    return value
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, dsn: str, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PGJOBD_TEST_DSN", dsn)
    monkeypatch.delenv("PGJOBD_CONFIG", raising=False)
    pytester.mkdir("handlers")
    (pytester.path / "handlers" / "greetings.py").write_text(HANDLER)
    return pytester


async def _gone(dsn: str, output: str) -> None:
    schemas = re.findall(r"SCHEMA (\w+)", output)
    assert len(schemas) == 2 and len(set(schemas)) == 2
    conn = await asyncpg.connect(dsn)
    try:
        left = await conn.fetchval(
            "SELECT count(*) FROM pg_namespace WHERE nspname = ANY($1::text[])", schemas
        )
    finally:
        await conn.close()
    assert left == 0


@pytest.mark.anyio
async def test_the_plugin_with_handlers_named_in_the_ini_file(
    suite: pytest.Pytester, dsn: str
) -> None:
    suite.makeini("[pytest]\npgjobd_handlers = handlers\n")
    suite.makepyfile(test_greet=SUITE.replace("SUFFIX", '""'))
    result = suite.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    await _gone(dsn, result.stdout.str())


@pytest.mark.anyio
async def test_the_plugin_with_the_config_named_by_pgjobd_config(
    suite: pytest.Pytester, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$PGJOBD_CONFIG gives the handler directories and the middleware the drain runs."""
    config = suite.path / "conf" / "pgjobd.toml"
    config.parent.mkdir()
    config.write_text(
        textwrap.dedent("""
        [daemon]
        handlers = ["../handlers"]
        middleware = ["loud:shout"]
    """)
    )
    (suite.path / "loud.py").write_text(MIDDLEWARE)
    monkeypatch.setenv("PGJOBD_CONFIG", str(config))
    monkeypatch.setenv("PYTHONPATH", str(suite.path))
    suite.makepyfile(test_greet=SUITE.replace("SUFFIX", '"!"'))
    result = suite.runpytest_subprocess("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    await _gone(dsn, result.stdout.str())


def test_no_handlers_configured_is_a_clear_error(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_nothing="""
        import pytest

        @pytest.mark.anyio
        async def test_drain(pgjobd_drain):
            pass

        @pytest.fixture
        def anyio_backend():
            return "asyncio"
    """
    )
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pgjobd_drain: no handlers: name their directories*"])
