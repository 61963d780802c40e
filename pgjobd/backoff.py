"""Retry and reconnect delays: exponential backoff with full jitter."""

from __future__ import annotations

import random

# Jitter spreads retries over time; nothing about it is a secret.
_rng = random.Random()  # nosec B311


def retry_delay_s(attempt: int, base_s: float, max_s: float, rng: random.Random = _rng) -> float:
    """Delay before retrying after failed attempt number `attempt` (1 for the first run):
    uniform in [0, min(max_s, base_s * 2**attempt)] ("full jitter"), so that jobs that
    failed together don't all come back together."""
    ceiling = max_s if attempt >= 64 else min(max_s, base_s * 2.0**attempt)
    return rng.uniform(0.0, ceiling)


def jittered(seconds: float, spread: float = 0.2, rng: random.Random = _rng) -> float:
    """`seconds` give or take `spread` of it, to keep a fleet's periodic work apart."""
    return seconds * rng.uniform(1.0 - spread, 1.0 + spread)
