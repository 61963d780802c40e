"""pgjobd: a job scheduler daemon on PostgreSQL."""

from __future__ import annotations

__version__ = "0.1.0"

from pgjobd.client import Client, JobInfo, JobSpec, SyncClient
from pgjobd.errors import DuplicateJob, EnqueueError, PgjobdError
from pgjobd.handler import Discard, JobContext, Retry, Snooze, job

__all__ = [
    "Client",
    "Discard",
    "DuplicateJob",
    "EnqueueError",
    "JobContext",
    "JobInfo",
    "JobSpec",
    "PgjobdError",
    "Retry",
    "Snooze",
    "SyncClient",
    "__version__",
    "job",
]
