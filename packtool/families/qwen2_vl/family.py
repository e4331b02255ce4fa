"""Qwen2-VL / Qwen2.5-VL media token rules: an image's or a video's patch grid and token count from its facts.

The image rule is transformers' ``smart_resize``: sides rounded to multiples of patch·merge, then scaled into
``[min_pixels, max_pixels]``; the model folder's ``preprocessor_config.json`` gives the numbers. The video rule
(:class:`Qwen2VLSettings`) adds ``Qwen2VLVideoProcessor``'s frame sampling, temporal patches and
``second_per_grid_ts``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from packtool.errors import ConfigError
from packtool.families.base import Family, ItemPlan, MediaTokens, knows_exactly, manifest_tokens
from packtool.families.conventions import Convention
from packtool.media.folder import read_folder
from packtool.media.video import VideoFacts

if TYPE_CHECKING:
    from packtool.item import MediaItem
    from packtool.settings import EncodeSettings


@dataclass(frozen=True)
class ImageRule:
    """How many tokens an image costs. Either the Qwen2-VL resize rule or a fixed count per image."""

    #: ``"qwen2_vl"`` or ``"fixed"``.
    type: str
    min_pixels: int = 3136
    max_pixels: int = 1003520
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    #: Tokens per image for ``type == "fixed"``.
    fixed_tokens: int = 0
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    #: A first resize before the processor's (qwen_vl_utils' ``fetch_image``, as Megatron-Bridge's Qwen-VL path
    #: does): sides to multiples of ``prefit_factor`` within ``[prefit_min_pixels, prefit_max_pixels]``,
    #: resampled bicubic; then the rule above applies to the resized image. ``0``: no first resize.
    prefit_factor: int = 0
    prefit_min_pixels: int = 0
    prefit_max_pixels: int = 0
    #: transformers' image processor backend the reader uses: ``pil`` (the same numbers with or without
    #: torchvision) or ``torchvision`` (transformers' default where torchvision is installed, as Megatron-Bridge's
    #: Qwen-VL path uses it; its resampling differs from PIL's by a level here and there).
    backend: str = "pil"

    def prefit(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of the image the processor is given: after the first resize, if any."""
        if not self.prefit_factor:
            return width, height
        h, w = fetch_image_resize(height, width, self.prefit_factor, self.prefit_min_pixels, self.prefit_max_pixels)
        return w, h

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of one image (Qwen2-VL); ``(1, 1, 1)`` for fixed-count models."""
        if self.type == "fixed":
            return (1, 1, 1)
        width, height = self.prefit(width, height)
        h, w = qwen_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return (1, h // self.patch_size, w // self.patch_size)

    def tokens(self, width: int, height: int) -> int:
        """Tokens the image occupies in the text."""
        if self.type == "fixed":
            return self.fixed_tokens
        _, gh, gw = self.grid(width, height)
        return gh * gw // (self.merge_size**2)

    @classmethod
    def from_manifest(cls, settings: Mapping[str, Any]) -> ImageRule:
        """The rule :meth:`manifest` wrote; ``ValueError`` for another type or malformed settings."""
        names = {f.name for f in fields(cls)}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if k in names}
        if kw.get("type") not in ("qwen2_vl", "fixed"):
            raise ValueError(f"unsupported image processor type {kw.get('type')!r}")
        try:
            return cls(**kw)  # type: ignore[arg-type]  # value types are checked where the rule is used
        except TypeError as exc:
            raise ValueError(f"malformed image processor ({exc})") from None

    def manifest(self) -> dict:
        """The settings a reader needs to reproduce pixel values."""
        return {
            "type": self.type,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "fixed_tokens": self.fixed_tokens,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            **({"prefit_factor": self.prefit_factor, "prefit_min_pixels": self.prefit_min_pixels,
                "prefit_max_pixels": self.prefit_max_pixels} if self.prefit_factor else {}),
            **({"backend": self.backend} if self.backend != "pil" else {}),
        }


def qwen_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize: sides to multiples of ``factor`` (nearest), then scaled into [min_pixels, max_pixels]."""
    if min(height, width) <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fetch_image_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """qwen_vl_utils' resize (``fetch_image``): like :func:`qwen_resize`, but a side rounds to at least ``factor``
    first and a downscaled side may reach 0 (its own rounding, which differs for very thin images)."""
    if min(height, width) <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if min(h_bar, w_bar) <= 0:
        raise ValueError(f"image of {width}x{height} pixels resizes to no pixels")
    return h_bar, w_bar


#: qwen_vl_utils' own bounds of ``fetch_image``, in tokens (times ``factor``² for pixels).
FETCH_IMAGE_TOKENS = (4, 16384)
#: qwen_vl_utils' bounds of ``fetch_video`` per frame, in tokens, and its total budget (``MODEL_SEQ_LEN``).
FETCH_VIDEO_TOKENS = (128, 768)
FETCH_VIDEO_TOTAL_TOKENS = 128000


#: ``image_processor_type`` values of Qwen2-VL's image processor (its backends, and Qwen2.5-VL's names for it).
QWEN2_VL_IMAGE_PROCESSORS = frozenset({
    "Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil",
    "Qwen2_5_VLImageProcessor", "Qwen2_5_VLImageProcessorFast",
})


# ---------------------------------------------------------------------------------------------------------------
# Video (Qwen2VLVideoProcessor, as Qwen2_5_VLProcessor uses it)
# ---------------------------------------------------------------------------------------------------------------

#: Frame rate transformers assumes for a video whose metadata gives none (``VideoMetadata.sampled_fps``).
UNKNOWN_FPS = 24


def frame_steps(total: int, n: float) -> tuple[int, ...]:
    """``torch.arange(0, total, total / n).int()``, the processor's sampling arithmetic, without torch (importing it
    costs a worker about 1.7 s): as torch does on the CPU, the count is ``ceil(total / step)``, each value
    ``i * step`` in double precision rounded to float32, then truncated."""
    step = total / n
    return tuple(int(i) for i in
                 (np.arange(math.ceil(total / step), dtype=np.float64) * step).astype(np.float32).astype(np.int64))


@dataclass(frozen=True)
class QwenVideoPlan:
    """How the processor turns one video into tokens: the frames it is given and what they become."""

    #: Frame numbers handed to the processor (all frames unless the settings sample).
    indices: tuple[int, ...]
    #: ``(t, h, w)`` patch grid (``video_grid_thw``).
    grid_thw: tuple[int, int, int]
    #: ``<|video_pad|>`` tokens the video occupies.
    tokens: int
    #: Seconds one temporal patch spans (``second_per_grid_ts``, used by mRoPE).
    second_per_grid_ts: float
    #: Frame size after the resize, ``(height, width)``.
    resized: tuple[int, int]


@dataclass(frozen=True)
class Qwen2VLSettings:
    """Qwen2-VL / Qwen2.5-VL image and video settings of a model folder, with overrides applied.

    Video settings follow ``Qwen2VLVideoProcessor``: its own config when the folder has one, else the image
    processor's config (then its pixel bounds are the image bounds and it does not sample frames), else the
    processor's class defaults.
    """

    #: Rule for still images.
    image: ImageRule
    #: Video pixel bounds per frame (``size.shortest_edge`` / ``size.longest_edge``).
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    video_patch_size: int = 14
    video_merge_size: int = 2
    video_temporal_patch_size: int = 2
    #: Whether frames are sampled (``do_sample_frames``); by ``fps`` or ``num_frames`` (not both).
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    #: Bounds of the frame count when sampling by ``fps``.
    min_frames: int = 4
    max_frames: int = 768
    #: Bound a video's total pixels by ``max_video_tokens`` (the reference implementation's cap).
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    #: File the video settings came from (``"none"``: class defaults).
    video_config: str = "none"
    #: Megatron-Bridge's Qwen-VL path: frames first go through qwen_vl_utils' ``fetch_video`` (each frame resized
    #: as an image at twice the factor, the last frame repeated to an even count, then the video resized within
    #: qwen_vl_utils' video bounds), then through this processor rule, which is not told their frame rate
    #: (``second_per_grid_ts`` as at :data:`UNKNOWN_FPS`). ``keep_frames``: only the first frames.
    fetch_video: bool = False
    keep_frames: int | None = None
    image_token: str = "<|image_pad|>"
    video_token: str = "<|video_pad|>"

    def __post_init__(self) -> None:
        if not 0 < self.video_min_pixels <= self.video_max_pixels:
            raise ConfigError(f"video pixel bounds {self.video_min_pixels}..{self.video_max_pixels} are not ordered")
        if self.do_sample_frames:
            if (self.fps is None) == (self.num_frames is None):
                raise ConfigError("frame sampling needs exactly one of a frame rate (fps) or a frame count")
            if self.fps is not None and not self.fps > 0:
                raise ConfigError(f"sampling frame rate {self.fps} is not positive")
            if self.num_frames is not None and self.num_frames <= 0:
                raise ConfigError(f"sampled frame count {self.num_frames} is not positive")
        if not 0 < self.min_frames <= self.max_frames:
            raise ConfigError(f"frame bounds {self.min_frames}..{self.max_frames} are not ordered")

    @classmethod
    def from_folder(
        cls,
        folder: str | Path,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
        fps: float | None = None,
        num_frames: int | None = None,
        min_frames: int | None = None,
        max_frames: int | None = None,
        do_sample_frames: bool | None = None,
        fetch_video: bool = False,
        keep_frames: int | None = None,
    ) -> Qwen2VLSettings:
        """Settings of a model folder. Overrides win; giving ``fps`` or ``num_frames`` turns sampling on (and
        drops the other one from the folder) unless ``do_sample_frames`` says otherwise."""
        configs = read_folder(folder)
        image = _image_rule(configs.image, min_pixels, max_pixels)
        video = configs.video
        size = dict(video.get("size") or {})
        lo: Any = video.get("min_pixels", size.get("shortest_edge", cls.video_min_pixels))
        hi: Any = video.get("max_pixels", size.get("longest_edge", cls.video_max_pixels))
        folder_fps, folder_frames = video.get("fps"), video.get("num_frames")
        if fps is not None or num_frames is not None:
            folder_fps, folder_frames = fps, num_frames
        sample = do_sample_frames if do_sample_frames is not None else (
            True if (fps is not None or num_frames is not None) else bool(video.get("do_sample_frames", False))
        )
        return cls(
            image=image,
            video_min_pixels=int(video_min_pixels if video_min_pixels is not None else lo),
            video_max_pixels=int(video_max_pixels if video_max_pixels is not None else hi),
            video_patch_size=int(video.get("patch_size", cls.video_patch_size)),
            video_merge_size=int(video.get("merge_size", cls.video_merge_size)),
            video_temporal_patch_size=int(video.get("temporal_patch_size", cls.video_temporal_patch_size)),
            do_sample_frames=sample,
            fps=None if folder_fps is None else float(folder_fps),
            num_frames=None if folder_frames is None else int(folder_frames),
            min_frames=int(min_frames if min_frames is not None else video.get("min_frames", cls.min_frames)),
            max_frames=int(max_frames if max_frames is not None else video.get("max_frames", cls.max_frames)),
            cap_pixels_per_frame=bool(video.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(video.get("max_video_tokens", cls.max_video_tokens)),
            video_config=configs.video_source,
            image_token=str(configs.tokens.get("image_token", cls.image_token)),
            video_token=str(configs.tokens.get("video_token", cls.video_token)),
            fetch_video=fetch_video,
            keep_frames=keep_frames,
        )

    def sample_indices(self, facts: VideoFacts) -> tuple[int, ...]:
        """Frames the processor keeps: ``Qwen2VLVideoProcessor.sample_frames`` when sampling, else all."""
        total = facts.frames
        if not self.do_sample_frames:
            return tuple(range(total))
        tps = self.video_temporal_patch_size
        if self.num_frames is not None:
            n: float = round(self.num_frames / tps) * tps
        else:
            if facts.fps is None or self.fps is None:
                raise ValueError("video has no frame rate, so it cannot be sampled by frame rate")
            cap = math.floor(min(self.max_frames, total) / tps) * tps
            n = min(max(total / facts.fps * self.fps, self.min_frames), cap, total)
            n = math.floor(n / tps) * tps
        if n > total:
            raise ValueError(f"video has {total} frames, fewer than the {n} to sample")
        if n <= 0:
            raise ValueError(f"video of {total} frames is too short to sample (needs {tps})")
        return frame_steps(total, n)

    def fetched_size(self, height: int, width: int, frames: int) -> tuple[int, int]:
        """``(height, width)`` of the frames qwen_vl_utils' ``fetch_video`` hands on (``frames``: their count)."""
        factor = self.video_patch_size * self.video_merge_size
        h, w = fetch_image_resize(height, width, 2 * factor, 4 * (2 * factor) ** 2, 16384 * (2 * factor) ** 2)
        lo = FETCH_VIDEO_TOKENS[0] * factor**2
        hi = max(min(FETCH_VIDEO_TOKENS[1] * factor**2, FETCH_VIDEO_TOTAL_TOKENS * factor**2 * 0.9 / frames * 2),
                 int(lo * 1.05))
        return fetch_image_resize(h, w, factor, lo, hi)

    def video(self, facts: VideoFacts) -> QwenVideoPlan:
        """The processor's treatment of one video, from its facts alone."""
        indices = self.sample_indices(facts)
        if self.keep_frames is not None:
            indices = indices[:self.keep_frames]
        height, width = facts.height, facts.width
        if self.fetch_video:  # its frame count: the last frame repeated to an even count, as the processor does
            height, width = self.fetched_size(height, width, len(indices) + len(indices) % 2)
        n = len(indices)
        factor = self.video_patch_size * self.video_merge_size
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total_pixels * self.video_temporal_patch_size // n), int(self.video_min_pixels * 1.05)
            )
        h, w = qwen_resize(height, width, factor, self.video_min_pixels, max_pixels)
        grid = (-(-n // self.video_temporal_patch_size), h // self.video_patch_size, w // self.video_patch_size)
        tokens = grid[0] * grid[1] * grid[2] // self.video_merge_size**2
        # qwen_vl_utils' fetch_video hands the processor its frames without their rate (Megatron-Bridge's path).
        sampled_fps = n / facts.frames * facts.fps if facts.fps and not self.fetch_video else UNKNOWN_FPS
        return QwenVideoPlan(indices, grid, tokens, self.video_temporal_patch_size / sampled_fps, (h, w))

    def video_text(self, facts: VideoFacts) -> str:
        """What the processor writes in place of one ``<|video_pad|>``."""
        return self.video_token * self.video(facts).tokens

    def image_text(self, width: int, height: int) -> str:
        """What the processor writes in place of one ``<|image_pad|>``."""
        return self.image_token * self.image.tokens(width, height)

    def processor_kwargs(self, facts: VideoFacts) -> dict:
        """Video keyword arguments that make the processor see the frames of :meth:`video` as this rule does:
        the sampled frames are passed as they are, with their metadata."""
        plan = self.video(facts)
        return {"do_sample_frames": False, "video_metadata": {**facts.metadata(), "frames_indices": list(plan.indices)}}

    @classmethod
    def from_manifest(cls, settings: Mapping[str, Any]) -> Qwen2VLSettings:
        """The settings :meth:`manifest` wrote; ``ValueError`` for another family or malformed settings."""
        image = settings.get("image")
        if settings.get("family") != "qwen2_vl" or not isinstance(image, Mapping):
            raise ValueError(f"unsupported video processor family {settings.get('family')!r}")
        names = {f.name for f in fields(cls)} - {"image"}
        try:
            return cls(image=ImageRule.from_manifest(image), **{k: v for k, v in settings.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"malformed video processor ({exc})") from None

    def manifest(self) -> dict:
        """The settings, for the pack manifest and the reader."""
        out = {k: v for k, v in asdict(self).items() if k != "image"}
        for name in ("fetch_video", "keep_frames"):  # written only when set: other manifests keep their bytes
            if out[name] == getattr(Qwen2VLSettings, name):
                del out[name]
        return {"family": "qwen2_vl", "image": self.image.manifest(), **out}


def _image_rule(cfg: dict, min_pixels: int | None, max_pixels: int | None, prefit: bool = False) -> ImageRule:
    """The image rule of an image-processor config dict (keys as in ``preprocessor_config.json``); ``prefit``:
    images are first resized as qwen_vl_utils' ``fetch_image`` does (:attr:`ImageRule.prefit_factor`), and read
    with transformers' default (torchvision) backend, as Megatron-Bridge's Qwen-VL path does."""
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", ImageRule.min_pixels)))
    hi = cfg.get("max_pixels", size.get("longest_edge", size.get("max_pixels", ImageRule.max_pixels)))
    patch = int(cfg.get("patch_size", ImageRule.patch_size))
    merge = int(cfg.get("merge_size", ImageRule.merge_size))
    factor = patch * merge if prefit else 0
    return ImageRule(
        type="qwen2_vl",
        min_pixels=int(min_pixels if min_pixels is not None else lo),
        max_pixels=int(max_pixels if max_pixels is not None else hi),
        patch_size=patch,
        merge_size=merge,
        prefit_factor=factor,
        prefit_min_pixels=FETCH_IMAGE_TOKENS[0] * factor**2,
        prefit_max_pixels=FETCH_IMAGE_TOKENS[1] * factor**2,
        backend="torchvision" if prefit else "pil",
        temporal_patch_size=int(cfg.get("temporal_patch_size", ImageRule.temporal_patch_size)),
        image_mean=tuple(cfg.get("image_mean", ImageRule.image_mean)),
        image_std=tuple(cfg.get("image_std", ImageRule.image_std)),
    )


#: Processor classes whose folders the Qwen2-VL rules are exact for (transformers' ``processor_class``).
QWEN2_VL_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor"})
#: Video processor classes the Qwen2-VL video rule is exact for.
QWEN2_VL_VIDEO_PROCESSORS = frozenset({"Qwen2VLVideoProcessor", "Qwen2VLVideoProcessorFast"})
#: ``model_type`` values of ``config.json`` the Qwen2-VL rules are exact for.
QWEN2_VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})


#: The names a Qwen2-VL / Qwen2.5-VL folder may state besides its image processor, each checked exactly.
QWEN2_VL_NAMES: dict[str, frozenset[str]] = {
    "processor class": QWEN2_VL_PROCESSORS, "video processor": QWEN2_VL_VIDEO_PROCESSORS,
    "model type": QWEN2_VL_MODEL_TYPES,
}


def _json_file(path: Path) -> dict:
    """A JSON object file as a dict; ``{}`` when absent or not an object (``read_folder`` reports unreadable
    processor files; these two are only looked at for the names they state)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------------------------------------------
# The family
# ---------------------------------------------------------------------------------------------------------------

class Qwen2VL(Family):
    """Qwen2-VL / Qwen2.5-VL: images and videos by their exact rules, each placeholder token repeated in the ids."""

    name = "qwen2_vl"
    kinds = ("image", "video")

    def __init__(self, tokens: MediaTokens, convention: Convention, folder: str, image: ImageRule,
                 video: Qwen2VLSettings | None, video_config: dict | None = None) -> None:
        super().__init__(tokens, convention, folder)
        self.image = image
        self.video = video
        self.video_config = video_config

    @classmethod
    def detect(cls, folder: Path, settings: EncodeSettings) -> bool:
        """A folder whose image processor is Qwen2-VL's (wherever the folder keeps its settings), or any folder
        given pixel bounds. Another family's image processor is a :class:`ConfigError` (its tokens follow other
        rules), except in the processor mode."""
        configs = read_folder(folder)
        image = configs.image
        if not image and not configs.video:
            return settings.min_pixels is not None or settings.max_pixels is not None
        kind = image.get("image_processor_type")
        if kind is not None and kind not in QWEN2_VL_IMAGE_PROCESSORS:
            if settings.media_tokens == "processor":
                return False
            raise ConfigError(f"{folder}: image processor {kind!r} is no Qwen2-VL one, so packtool has no token rule "
                              f"for its images; use the processor mode (the folder's own processor counts them) or "
                              f"image_tokens (a fixed count per image)")
        # A newer Qwen family ships Qwen2-VL's image processor under its own processor and video processor: its
        # tokens follow other rules, so the nearest rule is never applied to it.
        return knows_exactly(folder, settings, QWEN2_VL_NAMES, "Qwen2-VL or Qwen2.5-VL")

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> Qwen2VL:
        tokens = MediaTokens.from_vocab(tok.get_vocab())
        st = settings
        image = _image_rule(read_folder(st.tokenizer).image, st.min_pixels, st.max_pixels,
                            prefit=st.image_resize == "qwen_vl_utils")
        video = None
        if tokens.video_token_id is not None:
            try:
                # Megatron-Bridge hands the processor its image bounds, which bound the video frames too.
                fetch = st.image_resize == "qwen_vl_utils"
                video_min = st.video_min_pixels if st.video_min_pixels is not None or not fetch else image.min_pixels
                video_max = st.video_max_pixels if st.video_max_pixels is not None or not fetch else image.max_pixels
                video = Qwen2VLSettings.from_folder(
                    st.tokenizer, min_pixels=st.min_pixels, max_pixels=st.max_pixels,
                    video_min_pixels=video_min, video_max_pixels=video_max, fps=st.video_fps,
                    num_frames=st.video_frames, min_frames=st.video_min_frames, max_frames=st.video_max_frames,
                    fetch_video=fetch, keep_frames=st.video_keep_frames)
            except (ValueError, OSError) as exc:
                raise ConfigError(f"{st.tokenizer}: unreadable video settings ({exc})") from None
        config = read_folder(st.tokenizer).video if video is not None else None
        return cls(tokens, convention, str(st.tokenizer), image, video, config)

    @classmethod
    def owns(cls, manifest: Mapping) -> bool:
        entry = manifest.get("image_processor")
        return isinstance(entry, Mapping) and entry.get("type") == "qwen2_vl" and "family" not in entry

    @classmethod
    def from_manifest(cls, manifest: Mapping, convention: Convention) -> Qwen2VL:
        video = manifest.get("video_processor")
        return cls(manifest_tokens(manifest), convention, "", ImageRule.from_manifest(manifest["image_processor"]),
                   None if video is None else Qwen2VLSettings.from_manifest(video),
                   None if video is None else video.get("config"))

    def plan_image(self, width: int, height: int, n_images: int) -> ItemPlan:
        return ItemPlan(self.image.tokens(width, height), self.image.grid(width, height))

    def limit_tokens(self, item: MediaItem) -> int:
        """An image counts by the processor's rule from its stored size, without a first resize: Megatron-Bridge's
        Qwen-VL task encoder gives its raw images to the processor for its ``max_visual_tokens`` limit."""
        if item.kind != "image":
            return super().limit_tokens(item)
        return replace(self.image, prefit_factor=0).tokens(item.width, item.height)

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        if self.video is None:
            return super().plan_video(facts, part)
        plan = self.video.video(facts)
        return ItemPlan(plan.tokens, plan.grid_thw, plan.indices, plan.second_per_grid_ts)

    def manifest_entries(self) -> dict[str, Any]:
        t = self.tokens
        return {"image_token_id": t.image_token_id, "vision_start_token_id": t.vision_start_id,
                "vision_end_token_id": t.vision_end_id, "image_processor": self.image.manifest(),
                "video_token_id": t.video_token_id if self.video else None,
                "video_processor": {**self.video.manifest(), "config": self.video_config} if self.video else None,
                "audio_token_id": None, "audio_start_token_id": None, "audio_end_token_id": None}
