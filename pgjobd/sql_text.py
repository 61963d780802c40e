"""The package's SQL files: reading them and naming the schema in them.

SQL lives only under ``pgjobd/sql/``. Files spell the configured schema as
``{{schema}}``; `render` splices in the real name, which `names.SCHEMA_NAME` keeps to
characters that never need quoting. Query files hold ``-- name: noun_verb`` blocks.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from pgjobd.names import schema_name_problem

# A placeholder in the SQL files, not a password (bandit B105).
SCHEMA_TOKEN = "{{schema}}"  # nosec B105
_NAME_LINE = re.compile(r"^-- name: (\w+)[^\n]*\n", re.MULTILINE)


def render(sql: str, schema: str) -> str:
    problem = schema_name_problem(schema)
    if problem:
        raise ValueError(problem)
    return sql.replace(SCHEMA_TOKEN, schema)


def read(relative_path: str) -> str:
    return resources.files("pgjobd").joinpath("sql", relative_path).read_text("utf-8")


@cache
def named_blocks(relative_path: str) -> dict[str, str]:
    """The ``-- name: x`` blocks of one query file, by name, schema token unrendered."""
    text = read(relative_path)
    blocks: dict[str, str] = {}
    matches = list(_NAME_LINE.finditer(text))
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following else len(text)
        name = match.group(1)
        if name in blocks:
            raise ValueError(f"{relative_path}: query {name!r} is defined twice")
        blocks[name] = text[match.end() : end].strip().rstrip(";")
    return blocks
