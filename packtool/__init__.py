"""packtool: offline global sequence packing of Energon multimodal SFT datasets.

Public API: :func:`pack` (a whole run, as ``packtool pack``; returns a :class:`PackSummary`),
:func:`pack_lengths` and :data:`ALGORITHMS` (the planner), :func:`read_packs` (packs -> Megatron-ready batches, each
a :class:`ReaderBatch`) and :func:`to_megatron`. They load lazily so that ``import packtool`` stays light.
"""

from importlib.metadata import PackageNotFoundError, version

try:  # one owner: the version pyproject.toml gives the installed package
    __version__ = version("packtool")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
del PackageNotFoundError, version

_LAZY = {
    "pack": "packtool.api",
    "PackSummary": "packtool.api",
    "pack_lengths": "packtool.packer.algorithms",
    "ALGORITHMS": "packtool.packer.algorithms",
    "read_packs": "packtool.runtime.read",
    "ReaderBatch": "packtool.readkit",
    "to_megatron": "packtool.runtime.megatron_batch",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'packtool' has no attribute {name!r}")
