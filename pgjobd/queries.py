"""Named statements from ``pgjobd/sql/*.sql``, rendered for one schema, each run by
its typed method (see pgjobd.statements): ``await q.job_get(conn, job_id)``."""

from __future__ import annotations

from functools import cache

from pgjobd import sql_text
from pgjobd.statements.admin import AdminStatements
from pgjobd.statements.cron import CronStatements
from pgjobd.statements.job import JobStatements
from pgjobd.statements.leader import LeaderStatements
from pgjobd.statements.maintenance import MaintenanceStatements
from pgjobd.statements.member import MemberStatements
from pgjobd.statements.testing import TestingStatements
from pgjobd.statements.web import WebStatements

QUERY_FILES = (
    "job.sql",
    "member.sql",
    "leader.sql",
    "cron.sql",
    "maintenance.sql",
    "admin.sql",
    "web.sql",
    "testing.sql",
)


class Queries(
    JobStatements,
    MemberStatements,
    LeaderStatements,
    CronStatements,
    MaintenanceStatements,
    AdminStatements,
    WebStatements,
    TestingStatements,
):
    """The package's named statements with the schema spliced in."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._rendered = {
            name: sql_text.render(text, schema) for name, text in _all_blocks().items()
        }

    def sql(self, name: str) -> str:
        """The rendered text of statement `name` (for its method, and for EXPLAIN)."""
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


def all_blocks() -> dict[str, str]:
    """Every named statement's text, schema token unrendered, by name."""
    return dict(_all_blocks())


@cache
def for_schema(schema: str) -> Queries:
    return Queries(schema)
