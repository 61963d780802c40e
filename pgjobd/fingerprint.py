"""Error fingerprints (contract §14): one short id for "the same error" across jobs.

A fingerprint hashes the error's class, its message with what varies between
occurrences taken out (numbers, ids, hex addresses, UUIDs, quoted values), and the top
frame of the handler's code the error passed through ("module:function", without line
numbers, which move with every edit elsewhere in the file). Two jobs that failed on the
same line for the same reason share one, whatever ids their messages named.
"""

from __future__ import annotations

import hashlib
import re

_VARYING = [
    (re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
     "<uuid>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<addr>"),
    # A hex run holding a digit and a letter: a hash, a token, an object id.
    (re.compile(r"\b(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"), "<id>"),
    (re.compile(r"'[^']*'|\"[^\"]*\""), "<str>"),
    (re.compile(r"-?\d+(?:\.\d+)?"), "<n>"),
]  # fmt: skip
MAX_MESSAGE_CHARS = 500
LENGTH = 16  # hex digits


def normalised(message: str | None) -> str:
    """The message without what varies between occurrences of one error."""
    text = (message or "")[:MAX_MESSAGE_CHARS]
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return " ".join(text.split())


def fingerprint(error_class: str | None, message: str | None, frame: str | None = None) -> str:
    """The fingerprint of an error: LENGTH hex digits."""
    key = "\x1f".join((error_class or "", normalised(message), frame or ""))
    return hashlib.blake2b(key.encode(), digest_size=LENGTH // 2).hexdigest()


# Every attempt the reaper ends because its member stopped renewing the lease: one
# fingerprint, whichever member it was (its name is in the message, not in the key).
LEASE_EXPIRED = fingerprint("LeaseExpired", "member stopped renewing the lease")
