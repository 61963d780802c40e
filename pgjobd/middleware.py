"""Middleware: code that wraps every handler call in a worker (`[daemon] middleware`).

A middleware is `async def mw(ctx: JobContext, call_next) -> Any`: `await call_next()`
runs the rest of the chain (the next middleware, finally the handler) and returns the
handler's value, or raises what it raised (Retry, Snooze and Discard included). What the
middleware returns or raises becomes the attempt's outcome, as if the handler had.

Named in the config as "module:callable" (a dotted attribute path after the colon),
imported from sys.path by each worker process when it boots, outermost first. A name
that does not import, or that is not an async function, is a configuration error: the
worker fails to boot (`run` and `check-config` exit 78; a SIGHUP reload is rejected).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pgjobd.errors import ConfigError
from pgjobd.handler_api import JobContext

Middleware = Callable[[JobContext, Callable[[], Awaitable[Any]]], Awaitable[Any]]

_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)


def name_problem(name: object) -> str | None:
    """Why `name` is not a "module:callable" middleware name, or None."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return f'expected "module:callable" (like "myapp.jobs:timing"), got {name!r}'
    return None


def load(names: Sequence[str]) -> list[Middleware]:
    """Import each named middleware, in order; ConfigError naming the first that fails."""
    return [_load_one(name) for name in names]


def _load_one(name: str) -> Middleware:
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"middleware: {problem}")
    module_name, _, path = name.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:
        raise ConfigError(
            f"middleware {name!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    for attribute in path.split("."):
        try:
            value = getattr(value, attribute)
        except AttributeError:
            raise ConfigError(
                f"middleware {name!r}: module {module_name!r} has no attribute {path!r}"
            ) from None
    if not inspect.iscoroutinefunction(value):
        raise ConfigError(
            f"middleware {name!r} must be an async function (async def mw(ctx, call_next)), "
            f"not {type(value).__name__}"
        )
    try:
        inspect.signature(value).bind(None, None)
    except TypeError:
        raise ConfigError(f"middleware {name!r} must take two arguments (ctx, call_next)") from None
    return value  # type: ignore[no-any-return]
