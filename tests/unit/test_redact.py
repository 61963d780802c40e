"""pgjobd.redact: secrets found at field paths, masked in texts and in args shown."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd import job
from pgjobd.redact import (
    MAX_FIELD_BYTES,
    MAX_FIELDS,
    MIN_SECRET_CHARS,
    REDACTED,
    check_fields,
    redact_args,
    redact_text,
    secrets,
)

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
    [
        ("password", TypeError),
        ([""], ValueError),
        (["a..b"], ValueError),
        ([1], TypeError),
        # Stored by every member that declares the kind: at 754c081 a NUL passed here and made
        # the declaration fail ("\u0000 cannot be converted to text"), stopping the member.
        (["a\x00b"], ValueError),
        (["x" * 257], ValueError),
        (["f"] * 101, ValueError),
    ],
)
def test_the_redact_option_is_checked_at_decoration(redact: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="redact"):

        @job(redact=redact)
        def handler(args: dict[str, Any]) -> None: ...


@given(
    st.lists(
        st.one_of(
            st.text(max_size=300),
            st.sampled_from(
                ["\x00", "a\x00b", "\ud800", "a" * 256, "a" * 257, "a.b.c", ".", "a.", "ok"]
            ),
        ),
        max_size=120,
    )
)
def test_redact_takes_only_names_a_member_can_store(fields: list[str]) -> None:
    """What @job(redact=) accepts goes into the kind table when a member declares the
    kind: a NUL, a lone surrogate or an oversized name must be refused at decoration,
    not stop the member that declares it."""
    try:
        checked = check_fields(fields, "handler h")
    except ValueError as e:
        assert "redact" in str(e) and len(str(e)) < 400
        return
    assert len(checked) <= MAX_FIELDS
    for field in checked:
        assert "\x00" not in field and 0 < len(field.encode()) <= MAX_FIELD_BYTES
