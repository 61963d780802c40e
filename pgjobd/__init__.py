"""pgjobd: a job scheduler daemon on PostgreSQL."""

from __future__ import annotations

__version__ = "0.1.0"
