"""Args fields a handler declares secret (`@job(redact=["password", "card.number"])`):
kept out of logs, error texts and the admin CLI's output.

A field is a key of the args object, or a dotted path into nested objects. Its value
(every string and number inside it, when it is an object or a list) is a secret: in
error texts and tracebacks a worker stores, and in the lines logged while the job runs,
each occurrence of a secret's text is replaced by REDACTED; in args shown by the admin
commands the field's value is. Texts shorter than MIN_SECRET_CHARS are not searched for
(they would blank out unrelated characters); such a value is still masked in args.
The stored args themselves are the application's: `pgjobd scrub` overwrites them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pgjobd.names import shown, text_problem

REDACTED = "[redacted]"
MIN_SECRET_CHARS = 3


MAX_FIELDS = 100
MAX_FIELD_BYTES = 256


def check_fields(fields: object, where: str) -> tuple[str, ...]:
    """The `redact` option as a tuple of field paths; TypeError/ValueError naming `where`."""
    if isinstance(fields, str) or not isinstance(fields, Iterable):
        raise TypeError(f"{where}: redact takes a list of args field names, not {fields!r}")
    checked = []
    for field in fields:
        if not isinstance(field, str):
            raise TypeError(f"{where}: redact: field names are str, not {field!r}")
        if not field or any(not part for part in field.split(".")):
            raise ValueError(f"{where}: redact: {shown(field)} is not a field name or dotted path")
        # Members store the list in the kind table: it must be text PostgreSQL keeps.
        if problem := text_problem("redact field", field, MAX_FIELD_BYTES):
            raise ValueError(f"{where}: redact: {problem}")
        checked.append(field)
    if len(checked) > MAX_FIELDS:
        raise ValueError(f"{where}: redact: {len(checked)} fields, over the limit of {MAX_FIELDS}")
    return tuple(checked)


def _values_at(args: Any, path: str) -> list[Any]:
    node = args
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return []
        node = node[part]
    return [node]


def _leaves(value: Any) -> Iterable[str]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, str):
        yield value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield str(value)


def secrets(args: Any, fields: Sequence[str]) -> tuple[str, ...]:
    """The texts to keep out of logs and errors, longest first."""
    found = {
        text
        for field in fields
        for value in _values_at(args, field)
        for text in _leaves(value)
        if len(text) >= MIN_SECRET_CHARS
    }
    return tuple(sorted(found, key=len, reverse=True))


def redact_text(text: str | None, hidden: Sequence[str]) -> str | None:
    """`text` with every occurrence of each secret replaced by REDACTED."""
    if not text or not hidden:
        return text
    for secret in hidden:
        text = text.replace(secret, REDACTED)
    return text


def redact_args(args: Any, fields: Sequence[str] | None) -> Any:
    """A copy of `args` with each field's value replaced by REDACTED (for display)."""
    if not fields or not isinstance(args, dict):
        return args
    shown: dict[str, Any] = dict(args)
    for field in fields:
        parts = field.split(".")
        node = shown
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                break
            node[part] = node = dict(child)
        else:
            if parts[-1] in node:
                node[parts[-1]] = REDACTED
    return shown
