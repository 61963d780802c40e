"""One typed method per named statement of ``pgjobd/sql/*.sql``.

Each method runs its statement on the connection it is given and returns typed rows
(NamedTuples whose fields are the statement's result columns, in order). The methods
are grouped in one class per SQL file; `pgjobd.queries.Queries` combines them, so a
caller holding the queries writes ``await q.job_claim(conn, queue, limit, member, lease)``.

A statement and its method cannot drift apart: tests/integration/test_statements.py
prepares every named statement on a migrated schema and checks its parameters and
result columns against the method's declaration, with these conventions:

- The method's parameters after ``conn`` are the statement's ``$1..$n`` in order. A
  parameter typed ``Sequence[R]``, R a NamedTuple, stands for one array parameter per
  field of R (the rows are passed as columns).
- The return type says how the statement is run: ``list[R]`` fetch, ``R | None``
  fetchrow, ``R`` fetchrow of a statement that always returns one row, a plain value
  (``int``, ``bool | None``, ...) fetchval of the first column, ``None`` execute.

Methods hold no SQL of their own and add no round trip: each is one asyncpg call with
the rendered text, so asyncpg's prepared statement cache works as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import asyncpg

# What a statement runs on: a connection, or a pool (one connection for the call).
Conn = asyncpg.Connection | asyncpg.Pool

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

# The attribute `statement` sets on a method: the name of the statement it runs.
STATEMENT_NAME = "__statement__"


def statement(name: str) -> Callable[[F], F]:
    """Marks a method as the wrapper of the named statement `name`."""

    def mark(method: F) -> F:
        setattr(method, STATEMENT_NAME, name)
        return method

    return mark


class Rendered(Protocol):
    def sql(self, name: str) -> str: ...


def _maker(row_type: type[R]) -> Callable[[Iterable[Any]], R]:
    """A NamedTuple class's `_make`: half the cost of ``row_type(*record)``."""
    make: Callable[[Iterable[Any]], R] = row_type._make  # type: ignore[attr-defined]
    return make


def rows_of(row_type: type[R], records: Iterable[asyncpg.Record]) -> list[R]:
    make = _maker(row_type)
    return [make(record) for record in records]


def row_of(row_type: type[R], record: asyncpg.Record | None) -> R | None:
    return None if record is None else _maker(row_type)(record)


def one_row(name: str, row_type: type[R], record: asyncpg.Record | None) -> R:
    if record is None:
        raise AssertionError(f"statement {name} returned no row")
    return _maker(row_type)(record)


def columns(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows as columns, for the array parameters of a batch statement."""
    if not rows:
        return [[] for _ in range(width)]
    return [list(column) for column in zip(*rows, strict=True)]


__all__ = [
    "STATEMENT_NAME",
    "Conn",
    "Rendered",
    "columns",
    "one_row",
    "row_of",
    "rows_of",
    "statement",
]
