"""What fagen's on-disk caches share: where they live, an atomic write, a fingerprint of fagen's own files and
SymPy's version. The cubin cache (fagen.backend.build), the proof memo (fagen.math.memo) and the compile cache
(fagen.cache) all use these, so this module sits below them all: it imports no other fagen module and nothing
heavy (a compile-cache hit reads it)."""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path


def default_cache_dir() -> Path:
    """$FAGEN_CACHE_DIR, else $XDG_CACHE_HOME/fagen, else ~/.cache/fagen."""
    env = os.environ.get("FAGEN_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fagen"


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` through a temporary file and a rename, so that processes writing at once never leave (or read)
    half a file."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _version_in(path: Path) -> str | None:
    try:
        m = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", path.read_text())
    except OSError:
        return None
    return m.group(1) if m else None


@functools.lru_cache(maxsize=1)
def sympy_version() -> str:
    """SymPy's version, read from its release.py without importing SymPy (or from SymPy, if loaded)."""
    import sys

    if "sympy" in sys.modules:
        return sys.modules["sympy"].__version__
    import importlib.util

    spec = importlib.util.find_spec("sympy")
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    for loc in spec.submodule_search_locations:
        version = _version_in(Path(loc) / "release.py")
        if version:
            return version
    import sympy

    return sympy.__version__


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """A hash of fagen's own files that shape a kernel (its modules, tuned.json, the templates, the shipped
    programs), so that a changed template or rule misses in a checkout. The directories are found as
    fagen.resources finds them, without importing importlib.resources (which costs more than a hit)."""
    here = Path(__file__).parent
    tree = here.parent
    files = sorted(p for p in here.rglob("*") if p.suffix in (".py", ".json", ".jinja", ".ir"))
    if (tree / "pyproject.toml").is_file():  # running from a checkout
        for d in (tree / "templates", tree / "ir"):
            try:
                files += sorted(d / n for n in os.listdir(d) if n.endswith((".jinja", ".ir")))
            except OSError:
                continue
    h = hashlib.sha256()
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        h.update(f"{path.parent.name}/{path.name}\0".encode() + hashlib.sha256(data).digest())
    return h.hexdigest()
