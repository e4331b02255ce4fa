"""Read a pickled list of bytes (Megatron-Bridge's ``jpgs`` convention) without ever running pickled code."""

from __future__ import annotations

import io
import pickle

from packtool.sources.sample import SampleError


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):  # every global is refused: a list of bytes needs none
        raise SampleError(f"pickled member refers to {module}.{name}; only a plain list of bytes is accepted")


def load_bytes_list(data: bytes) -> list[bytes]:
    """The list of bytes in ``data``; raises :class:`SampleError` for anything else."""
    try:
        value = _NoGlobals(io.BytesIO(data)).load()
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(f"unreadable pickled member: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, (bytes, bytearray)) for v in value):
        raise SampleError("pickled member is not a list of bytes")
    return [bytes(v) for v in value]
