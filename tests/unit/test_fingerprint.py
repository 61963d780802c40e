"""Error fingerprints: what varies between occurrences of one error does not count."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pgjobd.fingerprint import LENGTH, fingerprint, normalised


def test_ids_numbers_addresses_and_quoted_values_are_taken_out() -> None:
    assert normalised("user 42 at 0x7f3a2c not found in 'acme' (3.5 s)") == (
        "user <n> at <addr> not found in <str> (<n> s)"
    )
    assert normalised("order 1b4e28ba-2fa1-11d2-883f-0016d3cca427 / deadbeef12") == (
        "order <uuid> / <id>"
    )
    assert normalised("  spread \n over   lines ") == "spread over lines"


def test_the_same_error_elsewhere_or_of_another_class_differs() -> None:
    base = fingerprint("ValueError", "bad id 7", "mod:handler")
    assert base == fingerprint("ValueError", "bad id 8123", "mod:handler")
    assert base != fingerprint("KeyError", "bad id 7", "mod:handler")
    assert base != fingerprint("ValueError", "bad id 7", "mod:other")
    assert base != fingerprint("ValueError", "worse id 7", "mod:handler")
    assert len(base) == LENGTH and int(base, 16) >= 0


@given(st.text(max_size=200), st.integers(), st.integers())
def test_numbers_in_a_message_never_change_its_fingerprint(text: str, a: int, b: int) -> None:
    assert fingerprint("E", f"{text} {a}", None) == fingerprint("E", f"{text} {b}", None)


@given(st.text(max_size=2000))
def test_any_message_has_a_fingerprint(text: str) -> None:
    assert len(fingerprint(None, text)) == LENGTH
