"""pgjobd's chaos suite: `python -m chaos SCENARIO`; see chaos/README.md."""
