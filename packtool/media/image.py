"""Image facts from bytes: size from the header, optionally a full decode to prove the image is whole."""

from __future__ import annotations

import io
import warnings

from PIL import Image

#: Part-name endings treated as images.
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"})
#: The only formats PIL may identify (PIL's names): nothing else is ever handed to a decoder (PIL would pass
#: EPS to Ghostscript when it is installed).
PIL_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def open_image(data: bytes) -> Image.Image:
    """The image in ``data``, opened lazily by PIL restricted to :data:`PIL_FORMATS`; no EXIF rotation is applied
    (packtool counts tokens from, and readers decode, the pixels as stored)."""
    return Image.open(io.BytesIO(data), formats=PIL_FORMATS)


def image_size(data: bytes, *, max_pixels: int, decode: bool) -> tuple[int, int, str]:
    """``(width, height, format)`` of an encoded image; raises ``ValueError`` with a reason if it is unusable.

    Only the header is read unless ``decode``: then the whole image is decoded once to prove it is not truncated
    or corrupt. ``max_pixels`` guards against decompression bombs, checked before any decode.
    """
    if not data:
        raise ValueError("empty image member")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = open_image(data)
        width, height = img.size
        fmt = (img.format or "").lower()
    except Image.DecompressionBombError as exc:
        raise ValueError(f"image exceeds the pixel limit: {exc}") from None
    except Exception as exc:  # PIL raises many types for bad data
        raise ValueError(f"undecodable image: {type(exc).__name__}: {exc}") from None
    if width * height > max_pixels:
        raise ValueError(f"image of {width}x{height} pixels exceeds the limit of {max_pixels}")
    if decode:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                if fmt == "jpeg":  # a scaled DCT decode still reads every byte of the stream, at a fraction of the work
                    img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
                img.load()
        except Exception as exc:
            raise ValueError(f"undecodable image: {type(exc).__name__}: {exc}") from None
    return width, height, fmt
