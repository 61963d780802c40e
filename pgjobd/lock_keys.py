"""Advisory lock keys, derived from the schema name so that two pgjobd schemas in one
database never contend for each other's locks.

Keys use the two-int form ``(purpose, hash of schema)``; in ``pg_locks`` they show as
``classid = purpose, objid = schema hash, objsubid = 2``.
"""

from __future__ import annotations

import zlib

# Purposes: arbitrary constants, spelled "pgj" + a digit so they stand out in pg_locks.
MIGRATE = 0x70676A01
LEADER = 0x70676A02
# Flow control's per-scope claim locks, taken in SQL only (flow_lock, migration 0007):
# (FLOW, hashtext(schema || ' ' || scope)), transaction-scoped.
FLOW = 0x70676A03


def lock_key(purpose: int, schema: str) -> tuple[int, int]:
    """The advisory lock key for `purpose` in `schema`, as two signed 32-bit ints."""
    return _signed32(purpose), _signed32(zlib.crc32(schema.encode()))


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value
