"""A member's JSON log as events: what e2e tests wait on and assert, instead of log text.

Start the member with `daemon=JSON_LOG` (plus any other [daemon] settings); every line
pgjobd logs is then one JSON object whose `event` field is a stable name
(docs/metrics.md lists them).
"""

from __future__ import annotations

import json
from typing import Any

from .conftest import MemberProcess, wait_until

JSON_LOG = 'log_format = "json"\n'


def log_events(log: str) -> list[dict[str, Any]]:
    """The JSON log lines, parsed, in order; whatever is not a JSON object is left out."""
    events = []
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def events(member: MemberProcess, name: str, **fields: Any) -> list[dict[str, Any]]:
    """The member's events of that name whose fields have the values given."""
    return [
        e
        for e in log_events(member.log)
        if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
    ]


def event_names(member: MemberProcess) -> list[str]:
    return [str(e.get("event")) for e in log_events(member.log)]


async def wait_for_event(
    member: MemberProcess, name: str, timeout_s: float = 20, **fields: Any
) -> dict[str, Any]:
    """The first event of that name (with those fields), waiting for it to be logged."""
    found: list[dict[str, Any]] = await wait_until(
        lambda: events(member, name, **fields), timeout_s=timeout_s, what=f"event {name}"
    )
    return found[0]
