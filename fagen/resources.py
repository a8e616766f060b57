"""Where the templates and the shipped `ir/` programs are: inside the installed package, or the source tree."""
from __future__ import annotations

import importlib.resources
from pathlib import Path

_SOURCE_TREE = Path(__file__).resolve().parent.parent


def _package_dir(package: str, source_dir: str) -> Path:
    local = _SOURCE_TREE / source_dir
    if local.is_dir() and (_SOURCE_TREE / "pyproject.toml").is_file():
        return local                     # running from a checkout (PYTHONPATH=., or an editable install)
    return Path(str(importlib.resources.files(package)))


def templates_dir() -> Path:
    return _package_dir("fagen.templates", "templates")


def programs_dir() -> Path:
    return _package_dir("fagen.programs", "ir")


def shipped_programs() -> dict[str, Path]:
    return {p.stem: p for p in sorted(programs_dir().glob("*.ir"))}
