"""Megatron-Bridge's own data code, imported on CPU for the comparison tests.

`make` installs the ``megatron-bridge`` wheel (pure Python) and ``qwen-vl-utils`` with ``--no-deps`` into
``.venv/mbridge`` (next to the interpreter; nothing is fetched while tests run). Megatron-Bridge's package
``__init__`` files import every model bridge, megatron.core and Transformer Engine, none of which the data modules
use. So :func:`load` imports the data modules with two stubs, and nothing else changed:

* every ``megatron.bridge`` *package* is an empty package pointing at its folder (its ``__init__.py`` is not run);
  every *module* is Megatron-Bridge's own file, run as is;
* ``megatron.core`` and ``megatron.training`` (Megatron-LM, not installable on CPU): any name imported from them is
  a placeholder class that raises when called. The compared modules import these names at the top of shared files
  (file readers, distributed helpers, ``PackedSeqParams``) and never call them on the compared paths (a call would
  raise, so a test that needed one fails loudly). :data:`STUBBED` lists the names actually imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

#: Where `make` installs the wheels (``PACKTOOL_MBRIDGE_DIR`` names another folder laid out the same way).
MBRIDGE_DIR = Path(os.environ.get("PACKTOOL_MBRIDGE_DIR") or Path(sys.prefix) / "mbridge")
#: Fully qualified names taken from the stubbed Megatron-LM packages.
STUBBED: set[str] = set()
_STUB_ROOTS = (("megatron", "core"), ("megatron", "training"))


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        parts = tuple(name.split("."))
        folder = self.root.joinpath(*parts)
        if parts[:2] == ("megatron", "bridge") and folder.is_dir():
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        if parts[:2] in _STUB_ROOTS:
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if tuple(module.__name__.split("."))[:2] not in _STUB_ROOTS:
            return  # a megatron.bridge package: its __init__ is not run

        def placeholder(attr: str, owner: str = module.__name__) -> type:
            if attr.startswith("__"):
                raise AttributeError(attr)
            STUBBED.add(f"{owner}.{attr}")

            def called(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError(f"{owner}.{attr} is a stub (Megatron-LM is not installed)")

            return type(attr, (), {"__init__": called, "__call__": called})

        module.__getattr__ = placeholder  # type: ignore[method-assign]


def available(root: Path | None = None) -> bool:
    root = root or MBRIDGE_DIR
    return (root / "megatron" / "bridge").is_dir() and (root / "qwen_vl_utils").is_dir()


def load(module: str, root: Path | None = None) -> ModuleType:
    """Import ``megatron.bridge.<module>`` from the installed wheel (``root``: a folder laid out the same way,
    by default :data:`MBRIDGE_DIR`; skips the test where `make` has not run). One process imports from one folder."""
    root = root or MBRIDGE_DIR
    if not available(root):
        pytest.skip(_missing(root))
    loaded = [f for f in sys.meta_path if isinstance(f, _Stubs)]
    if loaded and loaded[0].root != root:
        pytest.skip(f"this process imported Megatron-Bridge from {loaded[0].root}, not {root}")
    if not loaded:
        sys.path.append(str(root))  # qwen_vl_utils
        sys.meta_path.insert(0, _Stubs(root))
    return importlib.import_module(f"megatron.bridge.{module}")


def _missing(root: Path) -> str:
    """Why the wheel is not at ``root``, and how to get it there, as one line."""
    pins = Path(sys.prefix).parent / ".venv-mbridge"
    if Path(sys.prefix) != pins and available(pins / "mbridge"):
        return (f"Megatron-Bridge's wheel is installed for its pins environment only ({pins / 'mbridge'}): these "
                f"comparisons run there (`make test` runs them with {pins / 'bin/python'}); PACKTOOL_MBRIDGE_DIR "
                f"names a folder to use here")
    return (f"Megatron-Bridge's wheel is not in {root} (`make test` installs it into .venv-mbridge/mbridge and runs "
            f"these comparisons there; PACKTOOL_MBRIDGE_DIR names another folder)")


def version(root: Path | None = None) -> str:
    found = sorted((root or MBRIDGE_DIR).glob("megatron_bridge-*.dist-info"))
    return found[-1].name.split("-")[1] if found else "unknown"
