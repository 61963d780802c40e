"""Every named statement against its typed method (pgjobd.statements): prepared on a
migrated schema, its parameters and result columns must be what the method declares,
so the SQL files and the Python that runs them cannot drift apart."""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, get_args, get_origin, get_type_hints

import asyncpg
import pytest

from pgjobd.queries import Queries, all_blocks, for_schema
from pgjobd.statements import STATEMENT_NAME

pytestmark = pytest.mark.anyio

# The PostgreSQL types a Python type may stand for (as asyncpg encodes and decodes it).
_SCALARS: dict[type, set[str]] = {
    int: {"int2", "int4", "int8", "oid"},
    float: {"float4", "float8"},
    str: {"text", "varchar", "name", "regclass", "jsonb", "json"},
    bool: {"bool"},
    datetime: {"timestamptz"},
    timedelta: {"interval"},
}


def methods() -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for attribute in dir(Queries):
        method = getattr(Queries, attribute)
        name = getattr(method, STATEMENT_NAME, None)
        if name is not None:
            assert name == attribute, f"method {attribute} runs statement {name}"
            found[name] = method
    return found


def _non_null(annotation: Any) -> Any:
    if get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        assert len(rest) == 1, annotation
        return rest[0]
    return annotation


def _is_row_type(annotation: Any) -> bool:
    return (
        isinstance(annotation, type)
        and issubclass(annotation, tuple)
        and hasattr(annotation, "_fields")
    )


def pg_types(annotation: Any) -> set[str]:
    """The PostgreSQL type names `annotation` may stand for."""
    annotation = _non_null(annotation)
    if get_origin(annotation) in (list, Sequence):
        (element,) = get_args(annotation)
        return {f"{name}[]" for name in pg_types(element)}
    if annotation is type(None):
        return {"void"}
    return _SCALARS[annotation]


def declared_parameters(method: Callable[..., Any]) -> list[tuple[str, Any]]:
    """(name, annotation) of $1..$n: the method's parameters after conn, a
    Sequence[NamedTuple] standing for one array per field."""
    hints = get_type_hints(method)
    declared: list[tuple[str, Any]] = []
    for name in list(inspect.signature(method).parameters)[2:]:  # self, conn
        annotation = hints[name]
        if get_origin(annotation) is Sequence and _is_row_type(get_args(annotation)[0]):
            row_type = get_args(annotation)[0]
            for field, field_type in get_type_hints(row_type).items():
                declared.append((f"{name}.{field}", Sequence[field_type]))  # type: ignore[valid-type]
        else:
            declared.append((name, annotation))
    return declared


def declared_columns(method: Callable[..., Any]) -> list[tuple[str | None, Any]] | None:
    """(name, annotation) of the result columns the method reads; None name: any name
    (a value read by position); None: the method reads no result."""
    returned = get_type_hints(method)["return"]
    if returned is type(None):
        return None
    shape = _non_null(returned)
    if get_origin(shape) is list:
        (shape,) = get_args(shape)
        if not _is_row_type(shape):
            return [(None, shape)]  # one value per row
    if _is_row_type(shape):
        return list(get_type_hints(shape).items())
    return [(None, returned)]  # fetchval: the first column


def legend_positions(text: str) -> set[int]:
    legend = "\n".join(line for line in text.splitlines() if line.startswith("--"))
    return {int(n) for n in re.findall(r"\$(\d+)", legend)}


def test_every_statement_has_one_method_and_every_method_a_statement() -> None:
    assert sorted(methods()) == sorted(all_blocks())


async def test_statements_match_their_methods(conn: asyncpg.Connection, schema: str) -> None:
    q = for_schema(schema)
    problems: list[str] = []
    for name, method in sorted(methods().items()):
        prepared = await conn.prepare(q.sql(name))
        parameters = [p.name for p in prepared.get_parameters()]
        declared = declared_parameters(method)
        if len(parameters) != len(declared):
            problems.append(
                f"{name}: the statement takes {len(parameters)} parameters "
                f"({', '.join(parameters)}), the method {len(declared)} "
                f"({', '.join(n for n, _ in declared)})"
            )
        else:
            for position, (pg_type, (param, annotation)) in enumerate(
                zip(parameters, declared, strict=True), start=1
            ):
                if pg_type not in pg_types(annotation):
                    problems.append(f"{name}: ${position} is {pg_type}, {param} is {annotation}")
        if missing := set(range(1, len(parameters) + 1)) - legend_positions(all_blocks()[name]):
            problems.append(f"{name}: its legend does not name ${', $'.join(map(str, missing))}")
        columns = [(a.name, a.type.name) for a in prepared.get_attributes()]
        wanted = declared_columns(method)
        if wanted is None:
            continue
        if wanted[0][0] is None:  # a value by position: the first column
            if not columns or columns[0][1] not in pg_types(wanted[0][1]):
                problems.append(f"{name}: returns {columns}, the method reads {wanted[0][1]}")
            if (
                get_origin(_non_null(get_type_hints(method)["return"])) is list
                and len(columns) != 1
            ):
                problems.append(f"{name}: returns {columns}, the method reads one column")
            continue
        if [c for c, _ in columns] != [w for w, _ in wanted]:
            problems.append(
                f"{name}: returns columns {[c for c, _ in columns]}, "
                f"its row type has {[w for w, _ in wanted]}"
            )
            continue
        for (column, pg_type), (_, annotation) in zip(columns, wanted, strict=True):
            if pg_type not in pg_types(annotation):
                problems.append(f"{name}: column {column} is {pg_type}, declared {annotation}")
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_drift() -> None:
    """The comparison itself: a wrong type or count is reported, not passed over."""
    assert "int8" not in pg_types(str)
    assert pg_types(Sequence[int] | None) == {"int2[]", "int4[]", "int8[]", "oid[]"}
    fail_many = methods()["job_fail_many"]
    names = [n for n, _ in declared_parameters(fail_many)]
    assert names[:3] == ["rows.id", "rows.fence", "rows.verdict"] and names[-1] == "member_id"
    assert ("waited_s", float) in declared_columns(methods()["job_claim"])  # type: ignore[operator]
    assert declared_columns(methods()["member_leave"]) is None
