"""The proof memo: statements proven for given expressions, kept on disk.

The state algebra of the online softmax ((a), (b), (d) and the output half of (c)) reads only the state-update
expressions, which every program with the same rule shares; only the score (c, e) and the mask's key ranges
differ between variants. The statements proven for a given set of expressions are kept here, keyed by those
exact expressions (their srepr), SymPy's version and fagen's files, so that a new variant in a new process
proves only what is new to it. A failed proof raises and keeps nothing. `fagen ir` proves everything afresh
(online_softmax.fresh_proofs).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import store
from ..version import __version__

FORMAT = 1  # the layout of an entry


def proof_memo(expressions: tuple[str, ...], prove, cache_dir=None) -> tuple[tuple[str, str], ...]:
    """The (name, statement) pairs `prove()` returns for `expressions`, from disk when proven before."""
    env = dict(format=FORMAT, fagen=__version__, files=store.fingerprint(), sympy=store.sympy_version())
    k = hashlib.sha256(json.dumps(["proofs", list(expressions), env], sort_keys=True).encode()).hexdigest()
    path = (store.default_cache_dir() if cache_dir is None else Path(cache_dir)) / "proofs" / f"{k[:32]}.json"
    try:
        entry = json.loads(path.read_text())
        if entry.get("key") == k:
            return tuple((str(n), str(s)) for n, s in entry["proven"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    proven = tuple(prove())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        store.atomic_write(path, json.dumps(dict(key=k, proven=[list(p) for p in proven])).encode())
    except OSError:
        pass  # a read-only cache: the proof stands, it is only not kept
    return proven
