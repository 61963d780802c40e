"""What a schema name, a queue name and a job kind may look like, and what any other
text option (a tenant, a unique key, a group) must be for PostgreSQL to store it."""

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
        f"invalid schema name {shown(name)}: expected 1-48 characters of a-z, 0-9 and _, "
        "not starting with a digit"
    )


@lru_cache(maxsize=4096)
def queue_name_problem(name: str) -> str | None:
    if QUEUE_NAME.fullmatch(name):
        return None
    return (
        f"invalid queue name {shown(name)}: expected 1-64 characters of letters, digits, "
        "'_', '.' and '-', starting with a letter or digit"
    )


@lru_cache(maxsize=4096)
def kind_name_problem(name: str) -> str | None:
    if KIND_NAME.fullmatch(name):
        return None
    return (
        f"invalid job kind {shown(name)}: expected 1-128 characters of letters, digits, "
        "'_', '.', ':' and '-', starting with a letter or '_'"
    )


# A tenant as the job tables store it (migration 0005's domain).
MAX_TENANT_BYTES = 256


def text_problem(name: str, value: object, max_bytes: int) -> str | None:
    """Why `value` cannot be stored as the text option `name`, or None."""
    if not isinstance(value, str):
        return f"{name} must be a str, got {shown(value)}"
    if "\x00" in value:
        return f"{name} must not contain NUL characters, which PostgreSQL cannot store"
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        return f"{name} is not valid Unicode (it holds a lone surrogate): {shown(value)}"
    if size == 0:
        return f"{name} must not be empty (leave it out for none)"
    if size > max_bytes:
        return f"{name} is {size} bytes, over the {max_bytes}-byte limit"
    return None


def shown(value: object, limit: int = 80) -> str:
    """repr(value), cut short: an error message must not echo megabytes back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"
