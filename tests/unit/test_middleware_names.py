"""`[daemon] middleware` names: "module:callable", checked by the config (the key path in
the message) and loaded in the worker with an error naming the middleware."""

from __future__ import annotations

import keyword
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd import middleware
from pgjobd.config import loads
from pgjobd.errors import ConfigError

IDENTIFIER = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s)
)
DOTTED = st.lists(IDENTIFIER, min_size=1, max_size=3).map(".".join)


@given(module=DOTTED, attribute=DOTTED)
def test_every_module_colon_attribute_name_is_accepted(module: str, attribute: str) -> None:
    assert middleware.name_problem(f"{module}:{attribute}") is None


@given(st.text(max_size=30) | st.from_regex(r"[\w.:]{1,20}", fullmatch=True))
def test_a_name_is_accepted_only_in_its_form(name: str) -> None:
    module, colon, attribute = name.partition(":")
    parts = [*module.split("."), *attribute.split(".")] if colon else []
    well_formed = bool(colon) and all(p.isidentifier() and p.isascii() for p in parts)
    assert (middleware.name_problem(name) is None) == well_formed


def test_the_config_names_the_bad_entry() -> None:
    with pytest.raises(ConfigError, match=r"daemon\.middleware\[1\].*module:callable"):
        loads('[daemon]\nmiddleware = ["a.b:c", "a b"]\n', Path("/x/pgjobd.toml"))
    config = loads('[daemon]\nmiddleware = ["a.b:c.d"]\n', Path("/x/pgjobd.toml"))
    assert config.daemon.middleware == ("a.b:c.d",)


def test_loading_names_the_middleware_that_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mw_sample.py").write_text(
        "async def ok(ctx, call_next):\n    return await call_next()\n"
        "async def one_arg(ctx):\n    return None\n"
        "raise_on_import = None\n"
    )
    (tmp_path / "mw_broken.py").write_text("raise RuntimeError('half-deployed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [f.__name__ for f in middleware.load(["mw_sample:ok"])] == ["ok"]
    for name, expected in [
        ("mw_broken:ok", "cannot import module 'mw_broken': RuntimeError: half-deployed"),
        ("mw_sample:one_arg", "must take two arguments"),
        ("mw_sample:raise_on_import", "must be an async function"),
    ]:
        with pytest.raises(ConfigError, match=expected) as e:
            middleware.load(["mw_sample:ok", name])
        assert name in str(e.value)
    sys.modules.pop("mw_broken", None)
