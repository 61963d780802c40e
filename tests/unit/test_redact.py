"""pgjobd.redact: secrets found at field paths, masked in texts and in args shown."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd import job
from pgjobd.redact import MIN_SECRET_CHARS, REDACTED, redact_args, redact_text, secrets

json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(secret=json_values, other=st.dictionaries(st.text(max_size=5), json_values, max_size=4),
       text=st.text(max_size=60))  # fmt: skip
def test_no_secret_text_survives_in_a_redacted_text(secret: Any, other: dict[str, Any],
                                                    text: str) -> None:  # fmt: skip
    args = {**other, "password": secret}
    hidden = secrets(args, ["password"])
    out = redact_text(text + " ".join(hidden) + text, hidden) or ""
    # What is left between the markers holds no secret.
    assert not [s for s in hidden for part in out.split(REDACTED) if s in part]
    shown = redact_args(args, ["password"])
    assert shown["password"] == REDACTED
    assert {k: v for k, v in shown.items() if k != "password"} == other


def test_dotted_paths_reach_nested_fields_and_missing_ones_are_ignored() -> None:
    args = {"card": {"number": "4111111111111111", "brand": "visa"}, "n": 12345}
    assert secrets(args, ["card.number", "n", "absent", "card.absent"]) == (
        "4111111111111111", "12345",
    )  # fmt: skip
    shown = redact_args(args, ["card.number", "absent.x"])
    assert shown == {"card": {"number": REDACTED, "brand": "visa"}, "n": 12345}
    assert args["card"]["number"] == "4111111111111111"  # the original is untouched


def test_short_values_are_masked_in_args_but_not_searched_for_in_texts() -> None:
    assert secrets({"pin": "12"}, ["pin"]) == ()
    assert len("12") < MIN_SECRET_CHARS
    assert redact_args({"pin": "12"}, ["pin"]) == {"pin": REDACTED}


@pytest.mark.parametrize(
    ("redact", "error"),
    [("password", TypeError), ([""], ValueError), (["a..b"], ValueError), ([1], TypeError)],
)
def test_the_redact_option_is_checked_at_decoration(redact: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="redact"):

        @job(redact=redact)
        def handler(args: dict[str, Any]) -> None: ...
