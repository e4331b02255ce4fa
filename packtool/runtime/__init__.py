"""The runtime side every family shares: packs to batches (:mod:`.read`), training loaders (:mod:`.loader`),
Megatron / Megatron-Bridge batches (:mod:`.megatron_batch`), NeMo-RL's packed batch (:mod:`.nemo_rl`) and Hugging
Face packed rows (:mod:`.hf`). A family's own reader code (its processors, media tensors, batch fields, rope) lives
in its package under :mod:`packtool.families`, and the runtime reaches it through the family object; the runtime
imports no family module, the registry lookup (:mod:`.registry`) being the one exception. It imports nothing from
:mod:`packtool.packer`, so it can be installed into a training container alone.

Public entry points (loaded lazily, so importing this package stays light): :func:`read_packs`,
:class:`PackTaskEncoder`, :class:`MegatronBridgeTaskEncoder`, :func:`megatron_bridge_batch`.
"""

_LAZY = {
    "read_packs": "packtool.runtime.read",
    "PackTaskEncoder": "packtool.runtime.loader",
    "MegatronBridgeTaskEncoder": "packtool.runtime.loader",
    "megatron_bridge_batch": "packtool.runtime.megatron_batch",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'packtool.runtime' has no attribute {name!r}")
