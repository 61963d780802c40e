"""Import the handler modules of plugin directories into a Registry of kinds.

Only worker processes and `pgjobd check-config` import handler code; the daemon's
supervisor never does.

Each directory becomes a synthetic package, `pgjobd_handlers.<dirname>_<hash>`, and each
of its `*.py` files a module of it, so two directories may both hold `email.py`. Files
whose names start with `_` are not loaded on their own: they are private helpers, which
handler modules import relatively (`from ._common import render`). The directory is never
put on sys.path, so a helper is imported once, under one name, and nothing the handlers
ship can shadow an installed package.

Loading again (SIGHUP, a second check) drops the directory's modules from sys.modules
first and executes the files anew into a fresh Registry; nothing accumulates between
loads, because the specs are found on the loaded modules' attributes.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec

from pgjobd.errors import ConfigError
from pgjobd.handler_api import ArgsError, HandlerSpec, handler_spec, validate_args

if TYPE_CHECKING:
    from pgjobd.config import Config

PACKAGE_ROOT = "pgjobd_handlers"


class Registry(Mapping[str, HandlerSpec]):
    """Handler specs by kind. Two different handlers for one kind are a ConfigError."""

    def __init__(self, specs: Iterable[HandlerSpec] = ()) -> None:
        self._specs: dict[str, HandlerSpec] = {}
        for spec in specs:
            known = self._specs.get(spec.kind)
            if known is None:
                self._specs[spec.kind] = spec
            elif known is not spec:  # the same handler reached twice is fine
                raise ConfigError(
                    f"job kind {spec.kind!r} has two handlers: {known.name} in {known.source} "
                    f"and {spec.name} in {spec.source}"
                )

    @classmethod
    def from_functions(cls, functions: Iterable[Callable[..., Any]]) -> Registry:
        """A registry of functions decorated with `job`, for code that imports its handlers."""
        specs = []
        for fn in functions:
            spec = handler_spec(fn)
            if spec is None:
                raise TypeError(f"{fn!r} is not a handler: decorate it with @job")
            specs.append(spec)
        return cls(specs)

    def kinds(self) -> list[str]:
        return sorted(self._specs)

    def __getitem__(self, kind: str) -> HandlerSpec:
        return self._specs[kind]

    def get(self, kind: str, default: HandlerSpec | None = None) -> HandlerSpec | None:  # type: ignore[override]
        return self._specs.get(kind, default)  # (Mapping's get: a raised KeyError per miss)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"Registry({self.kinds()!r})"


def load_directories(directories: Sequence[Path | str]) -> Registry:
    """Import every handler module of each directory, in order, and register their handlers.

    Raises ConfigError for a missing directory, a module that fails to import and a kind
    with two handlers.
    """
    specs: list[HandlerSpec] = []
    for directory in directories:
        specs.extend(_load_directory(Path(directory)))
    return Registry(specs)


def _load_directory(directory: Path) -> list[HandlerSpec]:
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise ConfigError(f"handler directory {directory} {problem}")
    directory = directory.resolve()
    package = _fresh_package(directory)
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith(("_", ".")):
            continue
        if "." in path.stem:
            raise ConfigError(f"handler module {path}: a module name cannot contain '.'")
        name = f"{package}.{path.stem}"
        if name not in sys.modules:  # else a sibling already imported it relatively
            _import_file(name, path, directory)
    return _specs_in_package(package)


def _fresh_package(directory: Path) -> str:
    """Create the directory's package, dropping the modules of any earlier load."""
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:8]
    readable = re.sub(r"\W", "_", directory.name) or "root"
    name = f"{PACKAGE_ROOT}.{readable}_{digest}"
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    if PACKAGE_ROOT not in sys.modules:
        sys.modules[PACKAGE_ROOT] = _package_module(PACKAGE_ROOT, [])
    sys.modules[name] = _package_module(name, [str(directory)])
    return name


def _package_module(name: str, path: list[str]) -> ModuleType:
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = path
    return importlib.util.module_from_spec(spec)


def _import_file(name: str, path: Path, directory: Path) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # In sys.modules while it runs, as for any import: dataclasses, typing.get_type_hints
    # and relative imports look the module up there.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)
        raise ConfigError(f"cannot import handler module {path}: {_describe(e, directory)}") from e


def _describe(error: BaseException, directory: Path) -> str:
    """The exception and where it was raised, preferring a line in the handler directory."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, SyntaxError):  # str() already names the file and line
        return text
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")
    ]
    ours = [f for f in frames if Path(f.filename).is_relative_to(directory)]
    if not (ours or frames):
        return text
    frame = (ours or frames)[-1]
    return f"{text} (at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()})"


def _specs_in_package(package: str) -> list[HandlerSpec]:
    """Every handler reachable as a module attribute, in import order."""
    specs: list[HandlerSpec] = []
    seen: set[int] = set()
    modules = [m for n, m in list(sys.modules.items()) if n.startswith(package + ".")]
    for module in modules:
        for value in list(vars(module).values()):
            spec = handler_spec(value)
            if spec is not None and id(spec) not in seen:
                seen.add(id(spec))
                specs.append(spec)
    return specs


def check_cron(config: Config, registry: Registry) -> None:
    """ConfigError, one line per problem, unless every [[cron]] entry's kind has a handler
    in `registry` and its args convert to that handler's args type.

    The args take the path a cron job's args take: encoded to JSON as the cron ticker
    stores them, decoded and converted as the worker does (`validate_args`), so a schedule
    that passes here does not end its jobs dead with invalid_args or unknown_kind.
    """
    source = str(config.source) if config.source else "config"
    directories = ", ".join(str(d) for d in config.daemon.handlers) or "none configured"
    problems = []
    for index, entry in enumerate(config.cron):
        where = f'{source}: cron[{index}] (name "{entry.name}")'
        spec = registry.get(entry.kind)
        if spec is None:
            known = ", ".join(registry.kinds()) or "none"
            problems.append(
                f'{where}.kind: no handler for kind "{entry.kind}" in the handler '
                f"directories ({directories}); the kinds they define: {known}"
            )
            continue
        try:
            validate_args(spec, msgspec.json.decode(msgspec.json.encode(entry.args)))
        except ArgsError as e:
            problems.append(
                f"{where}.args: {e} (handler {spec.function.__qualname__} in {spec.source})"
            )
    if problems:
        raise ConfigError("\n".join(problems))
