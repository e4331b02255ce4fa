"""packtool: offline global sequence packing of Energon multimodal SFT datasets.

Public API: :func:`pack_lengths` and :data:`ALGORITHMS` (the planner), :func:`read_packs` (packs -> Megatron-ready
batches) and :func:`to_megatron`. They load lazily so that ``import packtool`` stays light.
"""

__version__ = "0.1.0"

_LAZY = {
    "pack_lengths": "packtool.build.algorithms",
    "ALGORITHMS": "packtool.build.algorithms",
    "read_packs": "packtool.runtime.read",
    "to_megatron": "packtool.runtime.megatron_batch",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'packtool' has no attribute {name!r}")
