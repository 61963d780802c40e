"""Named queries from ``pgjobd/sql/*.sql``, rendered for one schema."""

from __future__ import annotations

from functools import cache

from pgjobd import sql_text

QUERY_FILES = ("job.sql", "member.sql", "leader.sql", "cron.sql", "maintenance.sql", "admin.sql")


class Queries:
    """The package's named queries with the schema spliced in: ``q["job_get"]``."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._rendered = {
            name: sql_text.render(text, schema) for name, text in _all_blocks().items()
        }

    def __getitem__(self, name: str) -> str:
        try:
            return self._rendered[name]
        except KeyError:
            raise KeyError(f"no query named {name!r} in {', '.join(QUERY_FILES)}") from None


@cache
def _all_blocks() -> dict[str, str]:
    blocks: dict[str, str] = {}
    for file_name in QUERY_FILES:
        for name, text in sql_text.named_blocks(file_name).items():
            if name in blocks:
                raise ValueError(f"query {name!r} is defined in two files")
            blocks[name] = text
    return blocks


@cache
def for_schema(schema: str) -> Queries:
    return Queries(schema)
