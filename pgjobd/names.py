"""What a schema name, a queue name and a job kind may look like."""

from __future__ import annotations

import re
from functools import lru_cache

# A schema name is spliced into SQL as an identifier, so it is kept to the characters
# that never need quoting, and to 48 of them so that derived names (partitions,
# "<schema>.job_ready" NOTIFY channels, role names) fit PostgreSQL's 63-byte limit.
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,47}")
# Queue names appear in TOML tables, metric labels and NOTIFY payloads.
QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
KIND_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,127}")


@lru_cache(maxsize=4096)
def schema_name_problem(name: str) -> str | None:
    if SCHEMA_NAME.fullmatch(name):
        return None
    return (
        f"invalid schema name {name!r}: expected 1-48 characters of a-z, 0-9 and _, "
        "not starting with a digit"
    )


@lru_cache(maxsize=4096)
def queue_name_problem(name: str) -> str | None:
    if QUEUE_NAME.fullmatch(name):
        return None
    return (
        f"invalid queue name {name!r}: expected 1-64 characters of letters, digits, "
        "'_', '.' and '-', starting with a letter or digit"
    )


@lru_cache(maxsize=4096)
def kind_name_problem(name: str) -> str | None:
    if KIND_NAME.fullmatch(name):
        return None
    return (
        f"invalid job kind {name!r}: expected 1-128 characters of letters, digits, "
        "'_', '.', ':' and '-', starting with a letter or '_'"
    )
