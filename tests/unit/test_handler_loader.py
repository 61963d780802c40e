from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pgjobd.errors import ConfigError
from pgjobd.handler_api import job
from pgjobd.handler_loader import PACKAGE_ROOT, Registry, load_directories

REPO = Path(__file__).resolve().parents[2]

HEADER = "from pgjobd.handler_api import job, JobContext\n"


def plugin_dir(root: Path, name: str, files: dict[str, str]) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    for filename, source in files.items():
        (directory / filename).write_text(textwrap.dedent(source))
    return directory


@pytest.fixture(autouse=True)
def _forget_loaded_handlers() -> Any:
    yield
    for name in [m for m in sys.modules if m.startswith(PACKAGE_ROOT + ".")]:
        del sys.modules[name]


def test_loads_every_module_in_sorted_order(tmp_path: Path) -> None:
    directory = plugin_dir(
        tmp_path,
        "handlers",
        {
            "b.py": HEADER + "ORDER = []\n@job\ndef beta(args): ...\n",
            "a.py": """
            from pgjobd.handler_api import job, JobContext

            @job(queue="email")
            async def alpha(args: dict, ctx: JobContext) -> None: ...

            def not_a_handler(args): ...
            """,
            "notes.txt": "not python",
        },
    )
    registry = load_directories([directory])
    assert registry.kinds() == ["alpha", "beta"]
    assert list(registry) == ["alpha", "beta"]  # a.py was imported first
    assert len(registry) == 2
    alpha = registry["alpha"]
    assert alpha.queue == "email" and alpha.is_async and alpha.takes_ctx
    assert alpha.source == str(directory / "a.py")
    assert registry.get("beta") is not None
    assert registry.get("missing") is None
    assert "alpha" in registry


def test_private_helpers_are_imported_relatively_not_loaded_alone(tmp_path: Path) -> None:
    directory = plugin_dir(
        tmp_path,
        "handlers",
        {
            "_common.py": "LOADS = []\nLOADS.append(1)\ndef greet(name): return 'hi ' + name\n",
            "_unused.py": "raise RuntimeError('never imported')\n",
            "greet.py": """
            from pgjobd.handler_api import job
            from ._common import greet as render, LOADS
            from . import _common
            LOADS.append(2)

            @job
            def greet(args): return render(args["name"])
            """,
        },
    )
    registry = load_directories([directory])
    spec = registry["greet"]
    assert spec.function({"name": "x"}) == "hi x"
    common = sys.modules[spec.function.__module__.rsplit(".", 1)[0] + "._common"]
    assert common.LOADS == [1, 2]  # one module, imported once


def test_handler_reexported_from_another_module_counts_once(tmp_path: Path) -> None:
    directory = plugin_dir(
        tmp_path,
        "handlers",
        {
            "a.py": HEADER + "@job\ndef shared(args): ...\n",
            "b.py": "from .a import shared\n",
        },
    )
    assert load_directories([directory]).kinds() == ["shared"]


def test_same_file_name_in_two_directories(tmp_path: Path) -> None:
    one = plugin_dir(tmp_path, "one", {"email.py": HEADER + "@job\ndef welcome(args): ...\n"})
    two = plugin_dir(tmp_path, "two", {"email.py": HEADER + "@job\ndef goodbye(args): ...\n"})
    registry = load_directories([one, two])
    assert registry.kinds() == ["goodbye", "welcome"]
    assert registry["welcome"].source == str(one / "email.py")
    assert registry["goodbye"].source == str(two / "email.py")
    assert registry["welcome"].function.__module__ != registry["goodbye"].function.__module__


def test_duplicate_kind_names_both_files_and_functions(tmp_path: Path) -> None:
    directory = plugin_dir(
        tmp_path,
        "handlers",
        {
            "a.py": HEADER + "@job(kind='send')\ndef send_a(args): ...\n",
            "b.py": HEADER + "@job(kind='send')\ndef send_b(args): ...\n",
        },
    )
    with pytest.raises(ConfigError) as info:
        load_directories([directory])
    message = str(info.value)
    assert "job kind 'send' has two handlers" in message
    assert str(directory / "a.py") in message and str(directory / "b.py") in message
    assert ".a.send_a" in message and ".b.send_b" in message


def test_duplicate_kind_across_directories(tmp_path: Path) -> None:
    one = plugin_dir(tmp_path, "one", {"x.py": HEADER + "@job\ndef send(args): ...\n"})
    two = plugin_dir(tmp_path, "two", {"y.py": HEADER + "@job\ndef send(args): ...\n"})
    with pytest.raises(ConfigError, match="job kind 'send' has two handlers"):
        load_directories([one, two])


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "import no_such_module_xyz\n",
            "ModuleNotFoundError: No module named 'no_such_module_xyz' (at {path}:1: "
            "import no_such_module_xyz)",
        ),
        ("x = 1\ndef broken(:\n", "SyntaxError: invalid syntax"),
        ("\n\nraise RuntimeError('boom')\n", "RuntimeError: boom (at {path}:3: raise RuntimeError"),
        ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
        (HEADER + "@job(kind='no spaces')\ndef h(args): ...\n", "ValueError: @job on "),
    ],
)
def test_import_failure_names_the_file_and_the_error(
    tmp_path: Path, source: str, expected: str
) -> None:
    directory = plugin_dir(tmp_path, "handlers", {"bad.py": source})
    path = directory / "bad.py"
    with pytest.raises(ConfigError) as info:
        load_directories([directory])
    message = str(info.value)
    assert message.startswith(f"cannot import handler module {path}: ")
    assert expected.format(path=path) in message


def test_error_in_a_helper_points_at_the_helper_line(tmp_path: Path) -> None:
    directory = plugin_dir(
        tmp_path,
        "handlers",
        {
            "_helper.py": "X = 1\nY = 1 / 0\n",
            "main.py": "from . import _helper\n",
        },
    )
    with pytest.raises(ConfigError) as info:
        load_directories([directory])
    assert f"ZeroDivisionError: division by zero (at {directory / '_helper.py'}:2:" in str(
        info.value
    )


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"handler directory {tmp_path / 'nope'} does not exist"):
        load_directories([tmp_path / "nope"])
    (tmp_path / "file.py").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        load_directories([tmp_path / "file.py"])


def test_reload_executes_again_into_a_fresh_registry(tmp_path: Path) -> None:
    directory = plugin_dir(
        tmp_path,
        "handlers",
        {
            "a.py": HEADER + "@job\ndef first(args): ...\n",
        },
    )
    before = load_directories([directory])
    (directory / "a.py").write_text(HEADER + "@job\ndef second(args): ...\n")
    (directory / "b.py").write_text(HEADER + "@job\ndef third(args): ...\n")
    after = load_directories([directory])
    assert before.kinds() == ["first"]
    assert after.kinds() == ["second", "third"]
    again = load_directories([directory])
    assert again.kinds() == ["second", "third"]
    assert again["second"] is not after["second"]


def test_failed_module_is_not_left_in_sys_modules(tmp_path: Path) -> None:
    directory = plugin_dir(tmp_path, "handlers", {"bad.py": "raise RuntimeError('x')\n"})
    with pytest.raises(ConfigError):
        load_directories([directory])
    assert not [m for m in sys.modules if m.startswith(PACKAGE_ROOT + ".") and m.endswith(".bad")]


def test_handler_modules_may_use_future_annotations_and_dataclasses(tmp_path: Path) -> None:
    directory = plugin_dir(
        tmp_path,
        "handlers",
        {
            "typed.py": """
            from __future__ import annotations
            from dataclasses import dataclass
            from pgjobd.handler_api import job, JobContext

            @dataclass
            class Args:
                n: int

            @job
            def count(args: Args, ctx: JobContext) -> int:
                return args.n
            """,
        },
    )
    spec = load_directories([directory])["count"]
    assert spec.args_type.__name__ == "Args"
    assert spec.takes_ctx


def test_registry_from_functions() -> None:
    @job
    def one(args: dict[str, Any]) -> None: ...

    @job(kind="one")
    def other(args: dict[str, Any]) -> None: ...

    def plain(args: dict[str, Any]) -> None: ...

    registry = Registry.from_functions([one, one])
    assert registry.kinds() == ["one"]
    assert registry["one"].function is one
    with pytest.raises(ConfigError, match="job kind 'one' has two handlers"):
        Registry.from_functions([one, other])
    with pytest.raises(TypeError, match="is not a handler: decorate it with @job"):
        Registry.from_functions([plain])


def test_example_handlers_directory() -> None:
    registry = load_directories([REPO / "handlers"])
    assert registry.kinds() == ["build_report", "flaky_webhook", "hello"]
    assert registry["hello"].is_async
    assert not registry["build_report"].is_async
    assert issubclass(registry["hello"].args_type, msgspec.Struct)
