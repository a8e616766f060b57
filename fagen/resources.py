"""Where the templates and the shipped `ir/` programs are, read through importlib.resources.

Installed (a wheel, `pip install .`), they are package data: `templates/` is `fagen/templates/` and `ir/` is
`fagen/programs/` (pyproject.toml maps them). In a source checkout run with `PYTHONPATH=.` there is no
`fagen/templates/`, so they are read from the checkout's `templates/` and `ir/`. Either way callers get
`importlib.resources.abc.Traversable`s (`.name`, `.read_text()`), never a path built from a string.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_SOURCE_TREE = Path(__file__).resolve().parent.parent


def _resource_dir(packaged: str, source_dir: str):
    """`fagen/<packaged>` inside the installed package, else `<checkout>/<source_dir>`."""
    installed = importlib.resources.files("fagen").joinpath(packaged)
    if installed.is_dir():
        return installed
    local = _SOURCE_TREE / source_dir
    if local.is_dir():
        return local  # a source checkout (PYTHONPATH=., or an editable install)
    raise FileNotFoundError(
        f"fagen: neither the installed package data fagen/{packaged}/ nor the source tree's "
        f"{source_dir}/ exists; reinstall fagen"
    )


def templates_dir():
    """The Jinja templates (a Traversable)."""
    return _resource_dir("templates", "templates")


def programs_dir():
    """The shipped attention programs (a Traversable)."""
    return _resource_dir("programs", "ir")


def read_template(name: str) -> str | None:
    """The text of template `name` (a plain file name such as 'common.cu.jinja'), or None if there is none."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    entry = templates_dir().joinpath(name)
    return entry.read_text(encoding="utf-8") if entry.is_file() else None


def shipped_programs() -> dict:
    """The shipped programs by name ('causal', ...): Traversables, read with `.read_text()`."""
    found = {e.name[: -len(".ir")]: e for e in programs_dir().iterdir() if e.name.endswith(".ir") and e.is_file()}
    return dict(sorted(found.items()))
