"""PlanError: bad planner input, and close-name suggestions for it.

A PlanError is a ``UsageError``: the CLI prints its one-line message on stderr and
exits 2. Every message names the bad value, says why, and suggests a valid one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from shardlm.errors import UsageError

SUGGESTION_CUTOFF = 0.5
"""difflib similarity below which a known name is not offered as "did you mean" (difflib's
default is 0.6; 0.5 also catches 'llama3-70b' -> 'llama-3-70b')."""


class PlanError(UsageError):
    """Planner input that cannot work, with the reason and a way forward."""


def close_names(name: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Known names that look like ``name`` (case and punctuation do not matter)."""
    known = list(known)

    def norm(s: str) -> str:
        return "".join(ch for ch in s.lower() if ch.isalnum())

    by_norm = {norm(k): k for k in known}
    hits = difflib.get_close_matches(norm(name), list(by_norm), n=n, cutoff=SUGGESTION_CUTOFF)
    hits = [by_norm[h] for h in hits]
    hits += [k for k in known if norm(name) and norm(name) in norm(k) and k not in hits]
    return hits[:n]


def unknown(kind: str, name: str, known: Iterable[str], hint: str = "") -> PlanError:
    """``unknown 'gpu' 'h10'``: a PlanError that suggests close names and lists the rest."""
    known = sorted(known)
    close = close_names(name, known)
    did = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return PlanError(f"unknown {kind} {name!r}: {did}known {kind}s: {', '.join(known)}{hint}")
