"""Versioned payloads: the decorator's checks and the upgrade of older args."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pgjobd import job
from pgjobd.handler_api import VERSION_KEY, ArgsError, NewerArgs, handler_spec, upgraded


class V3(msgspec.Struct):
    first: str
    last: str
    tags: list[str]


def _v1(args: dict[str, Any]) -> dict[str, Any]:
    first, _, last = args.pop("name").partition(" ")
    return {"first": first, "last": last}


def _v2(args: dict[str, Any]) -> dict[str, Any]:
    return {**args, "tags": []}


@job(args_version=3, upgraders={1: _v1, 2: _v2})
async def greet(args: V3) -> None:
    return None


def test_older_payloads_are_upgraded_step_by_step_and_the_key_removed() -> None:
    spec = handler_spec(greet)
    assert spec is not None
    assert upgraded(spec, {"name": "Ada Lovelace"}) == {
        "first": "Ada", "last": "Lovelace", "tags": []
    }  # fmt: skip
    assert upgraded(spec, {VERSION_KEY: 2, "first": "A", "last": "B"}) == {
        "first": "A", "last": "B", "tags": []
    }  # fmt: skip
    current = {VERSION_KEY: 3, "first": "A", "last": "B", "tags": ["x"]}
    assert upgraded(spec, current) == {"first": "A", "last": "B", "tags": ["x"]}


def test_a_newer_payload_is_refused_as_newer_and_a_bad_version_as_invalid() -> None:
    spec = handler_spec(greet)
    assert spec is not None
    with pytest.raises(NewerArgs, match="version 4, newer than this handler's 3"):
        upgraded(spec, {VERSION_KEY: 4})
    for bad in (0, "2", 1.5, None):
        with pytest.raises(ArgsError):
            upgraded(spec, {VERSION_KEY: bad})


def test_the_decorator_checks_versions_and_upgraders() -> None:
    async def handler(args: dict[str, Any]) -> None:
        return None

    with pytest.raises(ValueError, match="args_version must be an int >= 1"):
        job(args_version=0)(handler)
    with pytest.raises(ValueError, match="keyed by the version they upgrade from, 1 to 1"):
        job(args_version=2, upgraders={2: _v1})(handler)
    with pytest.raises(TypeError, match="not callable"):
        job(args_version=2, upgraders={1: "nope"})(handler)  # type: ignore[dict-item]


def test_a_missing_step_is_invalid_args() -> None:
    @job(kind="gappy", args_version=3, upgraders={2: _v2})
    async def gappy(args: dict[str, Any]) -> None:
        return None

    spec = handler_spec(gappy)
    assert spec is not None
    with pytest.raises(ArgsError, match="no upgrader from args version 1"):
        upgraded(spec, {})
