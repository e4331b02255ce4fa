"""Read Megatron-Bridge's pickled media members (``jpgs``, ``videos``) without ever running pickled code.

Bridge's converters pickle a list of encoded image bytes (``prepare_mantis_energon.py``), or a list of numpy
arrays (``convert_to_qwenvl_wds.py``: ``[np.array(pil_image), ...]`` for ``jpgs``, one list of frame arrays per
video for ``videos``). :func:`safe_loads` runs such a pickle through an unpickler that resolves no global at all:
the few names numpy's own pickles use are mapped to packtool's constructors, which accept only arrays of plain
numeric dtypes (bool, signed and unsigned integers, floats) and check dtype, shape and data length before an
array is made. Every other global (``os.system``, ``copyreg._reconstructor``, an ``ndarray`` subclass, a numpy
scalar, ...) is refused by name. The numpy names accepted, for numpy 1.x (``numpy.core``) and 2.x
(``numpy._core``) pickles, at protocols 2 to 5:

- ``numpy.dtype``: the dtype, from its type code and its state (byte order);
- ``numpy[._]core.multiarray._reconstruct`` (protocols 2-4), with ``numpy.ndarray`` as its class and the array
  state (shape, dtype, raw bytes) applied afterwards; protocol 2 spells those bytes ``_codecs.encode(str,
  "latin1")`` and empty bytes ``bytes()``, the only other names accepted;
- ``numpy[._]core.numeric._frombuffer`` (protocol 5): buffer, dtype, shape, order.

An image given as an array becomes media packtool handles by being re-encoded as PNG (:func:`png_bytes`): the
image's pixels are kept exactly; the bytes written to a pack are derived, not a copy of a source member. A video
given as a list of encoded frames (:func:`video_frames`) is packed as a frame list, each frame's bytes as stored;
a video of decoded frames is refused (:func:`encoded_videos` says why).
"""

from __future__ import annotations

import io
import math
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from packtool.media.image import open_image
from packtool.packer.sources.sample import SampleError

#: Type codes numpy pickles plain numeric dtypes with: bool, ints and uints of 1-8 bytes, floats of 2-8 bytes.
_NUMERIC = re.compile(r"(b1|[iu][1248]|f[248])")
#: Deepest nesting of lists, tuples and dicts accepted around the arrays.
_MAX_DEPTH = 16
#: numpy's own limit on the number of dimensions.
_MAX_NDIM = 64


class _Refused:
    """Base of the stand-ins handed to the pickle machine: state can never be set on them by ``BUILD``."""

    __slots__ = ()

    def __setstate__(self, state) -> None:
        raise SampleError(f"pickled member sets state on {type(self).__name__.strip('_')}")


class _Dtype(_Refused):
    """A checked plain numeric dtype; ``BUILD`` may set its byte order (numpy's dtype state, version 3)."""

    __slots__ = ("dtype", "built")

    def __init__(self, code=None, align=False, copy=True, *rest) -> None:
        if not isinstance(code, str) or not _NUMERIC.fullmatch(code) or rest \
                or not isinstance(align, bool) or not isinstance(copy, bool):
            raise SampleError(f"pickled array has dtype {str(code)[:20]!r}; only bool, int, uint and float "
                              "dtypes are accepted")
        self.dtype = np.dtype(code)
        self.built = False

    def __setstate__(self, state) -> None:
        if self.built or not isinstance(state, tuple) or len(state) != 8 or state[0] != 3 \
                or state[1] not in ("<", ">", "|", "=") or state[2:5] != (None, None, None) \
                or state[5:] not in ((-1, -1, 0), (self.dtype.itemsize, self.dtype.alignment, 0)):
            raise SampleError(f"pickled dtype {self.dtype.str!r} has a state that is not a plain numeric dtype's")
        if state[1] == "|" and self.dtype.itemsize != 1:
            raise SampleError(f"pickled dtype {self.dtype.str!r} has no byte order")
        self.dtype = self.dtype.newbyteorder(state[1]) if state[1] in "<>" else self.dtype
        self.built = True


def _array(data, dtype, shape, order: str = "C", axes=None) -> np.ndarray:
    """The array over ``data``, built only once dtype, shape and data length agree (nothing is allocated)."""
    if not isinstance(dtype, _Dtype):
        raise SampleError("pickled array has no plain numeric dtype")
    if not isinstance(data, (bytes, bytearray)):
        raise SampleError(f"pickled array data is {type(data).__name__}, not raw bytes")
    if not isinstance(shape, tuple) or len(shape) > _MAX_NDIM \
            or not all(type(n) is int and n >= 0 for n in shape):
        raise SampleError(f"pickled array has an invalid shape {str(shape)[:60]}")
    if order not in ("C", "F", "K"):
        raise SampleError(f"pickled array has an invalid order {str(order)[:10]!r}")
    if axes is not None and (order != "K" or not isinstance(axes, tuple) or sorted(axes) != list(range(len(shape)))
                             or not all(type(a) is int for a in axes)):
        raise SampleError("pickled array has an invalid axis order")
    expected = math.prod(shape) * dtype.dtype.itemsize
    if len(data) != expected:
        raise SampleError(f"pickled array of shape {shape} and dtype {dtype.dtype.str} needs {expected} bytes, "
                          f"has {len(data)}")
    flat = np.frombuffer(bytes(data), dtype=dtype.dtype)
    if axes is not None:  # numpy's 'K' order: the bytes in memory order, then the axes put back
        return flat.reshape(shape).transpose(axes)
    return flat.reshape(shape, order="F" if order == "F" else "C")


class _PendingArray(_Refused):
    """What ``_reconstruct`` returns: an empty array that the following ``BUILD`` fills with its state."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def __setstate__(self, state) -> None:
        # numpy's ndarray state: (version 1, shape, dtype, is_fortran, raw data)
        if self.array is not None or not isinstance(state, tuple) or len(state) != 5 or state[0] != 1 \
                or not isinstance(state[3], bool):
            raise SampleError("pickled array has an invalid state")
        self.array = _array(state[4], state[2], state[1], "F" if state[3] else "C")


class _Global(_Refused):
    """An accepted global: calling it runs packtool's checked constructor, never the named function."""

    __slots__ = ("name", "build")

    def __init__(self, name: str, build) -> None:
        self.name, self.build = name, build

    def __call__(self, *args):
        return self.build(*args)

    def __setstate__(self, state) -> None:
        raise SampleError(f"pickled member sets state on {self.name}")


def _reconstruct(cls=None, shape=None, typecode=None, *rest) -> _PendingArray:
    if cls is not _NDARRAY or shape != (0,) or typecode != b"b" or rest:
        raise SampleError("pickled _reconstruct is not numpy's plain ndarray reconstruction")
    return _PendingArray()


def _ndarray(*args):
    raise SampleError("pickled numpy.ndarray is called directly")


def _empty_bytes(*args) -> bytes:
    if args:
        raise SampleError("pickled bytes() call has arguments")
    return b""


def _latin1(text=None, encoding=None, *rest) -> bytes:
    if not isinstance(text, str) or encoding != "latin1" or rest:
        raise SampleError("pickled _codecs.encode is not the latin1 spelling of bytes")
    return text.encode("latin1")


_NDARRAY = _Global("numpy.ndarray", _ndarray)
_RECONSTRUCT = _Global("_reconstruct", _reconstruct)
_FROMBUFFER = _Global("_frombuffer", _array)
_ALLOWED = {
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _Global("numpy.dtype", _Dtype),
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("_codecs", "encode"): _Global("_codecs.encode", _latin1),
    ("__builtin__", "bytes"): _Global("bytes", _empty_bytes),
    ("builtins", "bytes"): _Global("bytes", _empty_bytes),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return _ALLOWED[(module, name)]
        except (KeyError, TypeError):
            raise SampleError(f"pickled member refers to {module}.{name}; only lists of image bytes and numpy "
                              "arrays of plain numeric dtypes are accepted") from None

    def persistent_load(self, pid):
        raise SampleError("pickled member uses a persistent id")


_KEYS = (str, int, bytes)


def _finish(value):
    """``value`` with every filled placeholder replaced by its array; anything else not plain data refused.

    Containers are rebuilt once each however often they are referred to, so shared references cannot blow up.
    """
    done: dict[int, object] = {}
    busy = object()

    def walk(v, depth: int):
        if isinstance(v, _PendingArray):
            if v.array is None:
                raise SampleError("pickled array has no state")
            return v.array
        if type(v) in (np.ndarray, bytes, str, int, float, bool, type(None)):
            return v
        if type(v) is bytearray:
            return bytes(v)
        if type(v) not in (list, tuple, dict):
            raise SampleError(f"pickled member holds a {type(v).__name__.strip('_')}")
        if done.get(id(v)) is busy or depth >= _MAX_DEPTH:
            raise SampleError("pickled member refers to itself or is nested too deeply")
        if id(v) not in done:
            done[id(v)] = busy
            if type(v) is dict:
                if not all(type(k) in _KEYS for k in v):
                    raise SampleError("pickled dict has a key that is not a string, number or bytes")
                done[id(v)] = {k: walk(x, depth + 1) for k, x in v.items()}
            else:
                done[id(v)] = type(v)(walk(x, depth + 1) for x in v)
        return done[id(v)]

    return walk(value, 0)


def safe_loads(data: bytes):
    """The plain value pickled in ``data``: bytes, str, numbers, ``None``, numpy arrays of plain numeric dtypes,
    and lists, tuples and dicts of those. Raises :class:`SampleError` naming what was refused."""
    try:
        value = _Unpickler(io.BytesIO(data)).load()
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(f"unreadable pickled member: {type(exc).__name__}: {exc}") from None
    return _finish(value)


def png_bytes(array: np.ndarray) -> bytes:
    """A decoded image (uint8, ``HxW``, ``HxWx1``, ``HxWx3`` RGB or ``HxWx4`` RGBA) as PNG bytes.

    Fixed settings (zlib level 6, no filter search, no metadata chunks) make the bytes a function of the pixels
    alone for a given Pillow and zlib; decoding them gives back exactly these pixels.
    """
    from PIL import Image

    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)) \
            or 0 in array.shape:
        raise SampleError(f"pickled image array of shape {array.shape} and dtype {array.dtype} is not an 8-bit "
                          "HxW, HxWx3 or HxWx4 image")
    pixels = np.ascontiguousarray(array[:, :, 0] if array.ndim == 3 and array.shape[2] == 1 else array)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=6, optimize=False)
    return out.getvalue()


class ImageList(Sequence[bytes]):
    """The images of a pickled ``jpgs`` member, as encoded image bytes.

    Items stored as bytes are returned as stored; items stored as decoded arrays are re-encoded as PNG
    (:func:`png_bytes`) when asked for, one at a time, since a reader usually wants one item of the list.
    """

    def __init__(self, items: list) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            raise TypeError("ImageList takes one index")
        item = self._items[i]
        return item if isinstance(item, bytes) else png_bytes(item)


def load_bytes_list(data: bytes) -> ImageList:
    """The images of a pickled list (``jpgs``); raises :class:`SampleError` for anything else."""
    value = safe_loads(data)
    if not isinstance(value, (list, tuple)):
        raise SampleError("pickled member is not a list of images")
    for i, item in enumerate(value):
        if not isinstance(item, (bytes, np.ndarray)):
            raise SampleError(f"pickled image {i} is {type(item).__name__}, not image bytes or an array")
    return ImageList(list(value))


@dataclass(frozen=True)
class PickledVideo:
    """One video of a pickled ``videos`` member: its frames as stored, encoded bytes or decoded arrays.

    ``convert_to_qwenvl_wds.py`` stores each frame as a float32 ``CxHxW`` array (the Qwen video reader's
    resized frames, values 0-255); other converters store encoded JPEG frames.
    """

    #: The frames in order.
    frames: tuple

    def __str__(self) -> str:
        first = self.frames[0] if self.frames else None
        if isinstance(first, np.ndarray):
            return f"{len(self.frames)} frames of {'x'.join(map(str, first.shape))} {first.dtype}"
        return f"{len(self.frames)} encoded frames"


def load_videos(data: bytes) -> list[PickledVideo]:
    """The videos of a pickled list of frame lists (``videos``, ``mp4s``); raises :class:`SampleError` otherwise."""
    value = safe_loads(data)
    if not isinstance(value, (list, tuple)):
        raise SampleError("pickled videos member is not a list of videos")
    videos = []
    for i, frames in enumerate(value):
        if not isinstance(frames, (list, tuple)) or not all(isinstance(f, (bytes, np.ndarray)) for f in frames):
            raise SampleError(f"pickled video {i} is not a list of frames")
        videos.append(PickledVideo(tuple(frames)))
    return videos


def encoded_videos(data: bytes) -> list[PickledVideo]:
    """The videos of a pickled ``videos`` member, each a list of encoded frames; raises :class:`SampleError` for a
    video with no frames or with decoded frames.

    Decoded frames (``convert_to_qwenvl_wds.py``'s float arrays) were already resampled and resized by the
    converter, at a rate it does not record: the model's frame sampling cannot be re-derived from them.
    """
    videos = load_videos(data)
    for i, video in enumerate(videos):
        if not video.frames:
            raise SampleError(f"pickled video {i} has no frames")
        if not all(isinstance(f, bytes) for f in video.frames):
            raise SampleError(f"pickled video {i} holds {video}: videos of decoded frames are not supported, only "
                              "lists of encoded images")
    return videos


def video_frames(data: bytes, part: str, video: int) -> list[tuple[str, bytes]]:
    """The frames of video ``video`` of the pickled member ``part``, as stored, each with the name
    ``<part>.<video>.<frame>.<ext>`` (``ext`` from the image format): a pack keeps them, byte for byte, as the
    members of a frame list."""
    videos = encoded_videos(data)
    if not 0 <= video < len(videos):
        raise SampleError(f"media {part}[{video}] referenced but missing")
    return [(f"{part}.{video}.{i}.{_image_ext(frame)}", frame) for i, frame in enumerate(videos[video].frames)]


def _image_ext(data: bytes) -> str:
    """The member extension of an encoded image's format (``bin`` when it is none packtool reads: the frame is
    then quarantined by its measurement)."""
    try:
        fmt = (open_image(data).format or "").lower()
    except Exception:  # PIL raises many types for bad data; the frame's probe gives the reason
        return "bin"
    return {"jpeg": "jpg", "tiff": "tif"}.get(fmt, fmt or "bin")
