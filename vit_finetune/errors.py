"""The one exception type that the CLI turns into a short message instead of a traceback, and its hint."""
from __future__ import annotations

import difflib
from typing import Iterable


class VitftError(Exception):
    """A user-facing error: one line that says what is wrong and how to fix it."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """' (did you mean a, b?)' naming up to three close candidates, for an error about an unknown `name`."""
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""
