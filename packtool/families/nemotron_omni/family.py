"""Nemotron Omni media token rules, as transformers' ``nemotron_h_omni`` processor expands its placeholders.

* Image: ``<img>`` + ``<image>``×n + ``</img>``, n from the dynamic-resolution patch grid the image processor picks
  (``get_patch_grid_size``) divided by the pixel-shuffle merge (2×2).
* Video: the frames (sampled when the video processor's settings say so) are resized to one aspect-preserving
  tile near ``video_target_num_patches``; every 2 frames (a tubelet) become one ``<img>…</img>`` chunk, each on
  its own line and preceded by its label, e.g. ``Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.50
  seconds: ``. The processor writes times only when it is given the video's metadata; packtool always gives it
  (frame rate and frame numbers) when the frame rate is known, and the labels are then ``Frame 1 and frame 2: ``
  only for frame lists without a rate. This follows the transformers processor; Megatron-Bridge's own collate path
  writes different labels and canvases (``--preset megatron-bridge-nemotron-omni``: :mod:`.mbridge`).
* Audio: ``<so_start>`` + ``<so_embedding>``×n + ``<so_end>``, n from the waveform length at the processor's
  rate (mel frames ``1 + L // hop``, then the encoder's stride-2 convolutions).

The processor expands one video per call; a sample with several videos is expanded video by video, each as if it
were alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from packtool.errors import ConfigError, SampleError
from packtool.families.base import ExpandsInText, ItemPlan, MediaTokens, knows_exactly, manifest_tokens
from packtool.families.conventions import NEMOTRON_FAMILY, Convention
from packtool.media.audio import AudioFacts, resampled_length
from packtool.media.folder import read_folder, stated_names
from packtool.media.video import VideoFacts

if TYPE_CHECKING:
    from packtool.settings import AudioCount, EncodeSettings


@dataclass(frozen=True)
class NemotronVideoPlan:
    """How the processor turns one video into tokens."""

    #: Frame numbers handed to the processor.
    indices: tuple[int, ...]
    #: Tile every frame is resized to, in patches: ``(height, width)``.
    tile: tuple[int, int]
    #: ``<image>`` tokens in each tubelet chunk.
    tokens_per_tubelet: int
    #: The label before each chunk (one per tubelet).
    labels: tuple[str, ...]

    @property
    def tokens(self) -> int:
        """Placeholder tokens of the whole video (labels and markers not counted)."""
        return self.tokens_per_tubelet * len(self.labels)


@dataclass(frozen=True)
class NemotronOmniSettings:
    """Nemotron Omni processor settings of a model folder, with overrides applied."""

    #: Image processor: patch side, pixel-shuffle ratio, patch budget, and the context length that caps it.
    patch_size: int = 16
    downsample_ratio: float = 0.5
    min_num_patches: int = 1024
    max_num_patches: int = 13312
    max_model_len: int = 16384
    #: Video processor: patch side, pixel-shuffle ratio, tile budget and shape.
    video_patch_size: int = 16
    video_downsample_ratio: float = 0.5
    video_target_num_patches: int = 1024
    video_maintain_aspect_ratio: bool = True
    #: Frames per tubelet (one ``<img>`` chunk).
    video_temporal_patch_dim: int = 2
    #: Frame sampling of the video processor (``do_sample_frames``): by ``fps`` or by ``num_frames``.
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    #: Audio: the processor's sampling rate, mel hop, and the encoder's subsampling.
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_subsampling_factor: int = 8
    audio_conv_kernel_size: int = 3
    audio_conv_stride: int = 2
    #: Audio longer than this is cut to it before counting and feature extraction (``None``: no limit).
    audio_max_seconds: float | None = None
    #: File the video settings came from (``"none"``: class defaults).
    video_config: str = "none"
    image_token: str = "<image>"
    image_start_token: str = "<img>"
    image_end_token: str = "</img>"
    video_token: str = "<video>"
    audio_token: str = "<so_embedding>"
    audio_start_token: str = "<so_start>"
    audio_end_token: str = "<so_end>"

    def __post_init__(self) -> None:
        for name in ("patch_size", "video_patch_size", "min_num_patches", "video_target_num_patches",
                     "video_temporal_patch_dim", "audio_sampling_rate", "audio_hop_length",
                     "audio_subsampling_factor", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_patches < 0:
            raise ConfigError(f"max_num_patches must not be negative, got {self.max_num_patches}")
        if not 0 < self.downsample_ratio <= 1 or not 0 < self.video_downsample_ratio <= 1:
            raise ConfigError("downsample ratios must lie in (0, 1]")
        if self.do_sample_frames and self.fps is not None and self.num_frames is not None:
            raise ConfigError("frame sampling takes a frame rate (fps) or a frame count, not both")
        if self.audio_max_seconds is not None and not self.audio_max_seconds > 0:
            raise ConfigError(f"audio_max_seconds must be positive, got {self.audio_max_seconds}")

    @classmethod
    def from_folder(
        cls,
        folder: str | Path,
        *,
        min_num_patches: int | None = None,
        max_num_patches: int | None = None,
        video_target_num_patches: int | None = None,
        fps: float | None = None,
        num_frames: int | None = None,
        do_sample_frames: bool | None = None,
        audio_max_seconds: float | None = None,
    ) -> NemotronOmniSettings:
        """Settings of a model folder. Overrides win; giving ``fps`` or ``num_frames`` turns sampling on (and
        drops the other one from the folder) unless ``do_sample_frames`` says otherwise."""
        c = read_folder(folder)
        img, vid, aud, proc = c.image, c.video, c.audio, c.processor
        folder_fps, folder_frames = vid.get("fps"), vid.get("num_frames")
        if fps is not None or num_frames is not None:
            folder_fps, folder_frames = fps, num_frames
        sample = do_sample_frames if do_sample_frames is not None else (
            True if (fps is not None or num_frames is not None) else bool(vid.get("do_sample_frames") or False)
        )
        d = cls  # class defaults
        rate = int(proc.get("audio_sampling_rate", d.audio_sampling_rate))
        if aud.get("sampling_rate") is not None and int(aud["sampling_rate"]) != rate:
            raise ConfigError(f"feature extractor expects {aud['sampling_rate']} Hz audio "
                              f"but the processor uses {rate} Hz")
        return cls(
            patch_size=int(img.get("patch_size", d.patch_size)),
            downsample_ratio=float(img.get("downsample_ratio", d.downsample_ratio)),
            min_num_patches=int(min_num_patches if min_num_patches is not None
                                else img.get("min_num_patches", d.min_num_patches)),
            max_num_patches=int(max_num_patches if max_num_patches is not None
                                else img.get("max_num_patches", d.max_num_patches)),
            max_model_len=int(img.get("max_model_len", d.max_model_len)),
            video_patch_size=int(vid.get("patch_size", d.video_patch_size)),
            video_downsample_ratio=float(vid.get("downsample_ratio", d.video_downsample_ratio)),
            video_target_num_patches=int(video_target_num_patches if video_target_num_patches is not None
                                         else vid.get("video_target_num_patches", d.video_target_num_patches)),
            video_maintain_aspect_ratio=bool(vid.get("video_maintain_aspect_ratio", d.video_maintain_aspect_ratio)),
            video_temporal_patch_dim=int(proc.get("video_temporal_patch_dim", d.video_temporal_patch_dim)),
            do_sample_frames=sample,
            fps=None if folder_fps is None else float(folder_fps),
            num_frames=None if folder_frames is None else int(folder_frames),
            audio_sampling_rate=rate,
            audio_hop_length=int(proc.get("audio_hop_length", d.audio_hop_length)),
            audio_subsampling_factor=int(proc.get("audio_subsampling_factor", d.audio_subsampling_factor)),
            audio_conv_kernel_size=int(proc.get("audio_subsampling_conv_kernel_size", d.audio_conv_kernel_size)),
            audio_conv_stride=int(proc.get("audio_subsampling_conv_stride", d.audio_conv_stride)),
            audio_max_seconds=audio_max_seconds,
            video_config=c.video_source,
            **{k: str(c.tokens[k]) for k in ("image_token", "image_start_token", "image_end_token", "video_token",
                                             "audio_token") if k in c.tokens},
        )

    # -- images -------------------------------------------------------------------------------------------------

    def image_grid(self, width: int, height: int, *, n_images: int = 1) -> tuple[int, int]:
        """``(grid_h, grid_w)`` patch grid of one image among ``n_images`` given to the processor in one call
        (the call's patch budget depends on how many images share it)."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image has no pixels ({width}x{height})")
        merge = round(1 / self.downsample_ratio)
        budget = max((self.max_model_len - 4) * merge**2, self.min_num_patches * n_images)
        if self.max_num_patches:
            budget = min(budget, self.max_num_patches)
        budget = max(budget, self.min_num_patches)
        return _patch_grid(height, width, self.patch_size, merge, self.min_num_patches, budget)

    def image_tokens(self, width: int, height: int, *, n_images: int = 1) -> int:
        """``<image>`` tokens of one image."""
        gh, gw = self.image_grid(width, height, n_images=n_images)
        return gh * gw // round(1 / self.downsample_ratio) ** 2

    def image_text(self, width: int, height: int, *, n_images: int = 1) -> str:
        """What the processor writes in place of one ``<image>``."""
        n = self.image_tokens(width, height, n_images=n_images)
        return self.image_start_token + self.image_token * n + self.image_end_token

    # -- video --------------------------------------------------------------------------------------------------

    def sample_indices(self, facts: VideoFacts) -> tuple[int, ...]:
        """Frames the video processor keeps (transformers' default uniform sampler), else all frames."""
        total = facts.frames
        n = self.num_frames if self.do_sample_frames else None
        if self.do_sample_frames and n is None and self.fps is not None:
            if facts.fps is None:
                raise ValueError("video has no frame rate, so it cannot be sampled by frame rate")
            n = max(1, int(total / facts.fps * self.fps))
        if n is None:
            return tuple(range(total))
        if n > total:
            raise ValueError(f"video has {total} frames, fewer than the {n} to sample")
        return tuple(int(i) for i in np.arange(n, dtype=int) * total // n)

    def video_tile(self, width: int, height: int) -> tuple[int, int]:
        """``(h_patches, w_patches)`` tile every frame of a ``width``×``height`` video is resized to."""
        target, div = self.video_target_num_patches, round(1.0 / self.video_downsample_ratio)
        if not self.video_maintain_aspect_ratio:
            side = max(div, int(math.sqrt(target)) // div * div)
            return side, side
        aspect = width / max(height, 1)
        ph, pw = max(round(math.sqrt(target / aspect)), 1), max(round(math.sqrt(target * aspect)), 1)
        if div > 1:
            rem_h, rem_w = ph % div, pw % div
            up_h, up_w = ph + (div - rem_h if rem_h else 0), pw + (div - rem_w if rem_w else 0)
            if up_h * up_w <= target:
                ph, pw = up_h, up_w
            else:
                ph, pw = max(div, ph - rem_h), max(div, pw - rem_w)
        return ph, pw

    def video(self, facts: VideoFacts) -> NemotronVideoPlan:
        """The processor's treatment of one video, given its metadata (frame rate, sampled frame numbers)."""
        indices = self.sample_indices(facts)
        ph, pw = self.video_tile(facts.width, facts.height)
        per_tubelet = ph * pw // round(1.0 / self.video_downsample_ratio) ** 2
        step = self.video_temporal_patch_dim
        labels = []
        for start in range(0, len(indices), step):
            parts = []
            for k in range(start, min(start + step, len(indices))):
                word = "Frame" if k == start else "frame"
                if facts.fps:
                    seconds = indices[k] * int(1000.0 / facts.fps) / 1000.0
                    parts.append(f"{word} {k + 1} sampled at {seconds:.2f} seconds")
                else:
                    parts.append(f"{word} {k + 1}")
            labels.append(" and ".join(parts) + ": ")
        return NemotronVideoPlan(indices, (ph, pw), per_tubelet, tuple(labels))

    def video_text(self, facts: VideoFacts) -> str:
        """What the processor writes in place of one ``<video>``."""
        return self.plan_text(self.video(facts))

    def plan_text(self, plan: NemotronVideoPlan) -> str:
        """What the processor writes in place of the ``<video>`` of a video planned as ``plan``."""
        chunk = self.image_start_token + self.image_token * plan.tokens_per_tubelet + self.image_end_token
        return "\n".join(label + chunk for label in plan.labels)

    def processor_kwargs(self, facts: VideoFacts) -> dict:
        """Keyword arguments that make the processor see the frames of :meth:`video` as this rule does: the sampled
        frames are passed as they are; the metadata (when the rate is known) gives the labels their times. The
        ``video_metadata`` value must be a transformers ``VideoMetadata`` built from this dict."""
        if facts.fps is None:
            return {"do_sample_frames": False}
        plan = self.video(facts)
        return {"do_sample_frames": False, "video_metadata": {**facts.metadata(), "frames_indices": list(plan.indices)}}

    # -- audio --------------------------------------------------------------------------------------------------

    def audio_samples(self, facts: AudioFacts) -> int:
        """Length of the waveform the processor is given: resampled to its rate, cut to ``audio_max_seconds``."""
        n = resampled_length(facts.samples, facts.sample_rate, self.audio_sampling_rate)
        limit = self.max_audio_samples
        return n if limit is None else min(n, limit)

    @property
    def max_audio_samples(self) -> int | None:
        """``audio_max_seconds`` in samples at the processor's rate."""
        if self.audio_max_seconds is None:
            return None
        return int(self.audio_max_seconds * self.audio_sampling_rate)

    def audio_tokens(self, facts: AudioFacts) -> int:
        """``<so_embedding>`` tokens of one clip (at least one)."""
        length = 1 + self.audio_samples(facts) // self.audio_hop_length
        k, stride = self.audio_conv_kernel_size, self.audio_conv_stride
        add_pad = (k - 1) // 2 * 2 - k
        for _ in range(int(math.log2(self.audio_subsampling_factor))):
            length = (length + add_pad) // stride + 1
        return max(1, length)

    def audio_problem(self, facts: AudioFacts) -> str | None:
        """Why a clip cannot be trained on, or None: the feature extractor normalizes each mel bin by its mean and
        sample standard deviation over the clip's ``samples // hop`` frames, so a clip of fewer than two frames
        (under ``2 · hop`` samples at the processor's rate: 20 ms at 16 kHz) gets NaN features."""
        samples = self.audio_samples(facts)
        if samples // self.audio_hop_length >= 2:
            return None
        return (f"audio of {samples} samples at {self.audio_sampling_rate} Hz is shorter than two feature frames "
                f"({2 * self.audio_hop_length} samples): its features would be NaN")

    def audio_text(self, facts: AudioFacts) -> str:
        """What the processor writes in place of one ``<so_embedding>`` placeholder."""
        return self.audio_start_token + self.audio_token * self.audio_tokens(facts) + self.audio_end_token

    # -- text ---------------------------------------------------------------------------------------------------

    def expand(self, text: str, *, images: Sequence[str] = (), videos: Sequence[str] = (),
               audio: Sequence[str] = ()) -> str:
        """``text`` with its placeholders replaced, in order, by the given expansions (from the ``*_text``
        methods), as the processor does it. The number of placeholders of each kind must match."""
        return expand_placeholders(
            text, {self.image_token: images, self.video_token: videos, self.audio_token: audio}
        )

    @classmethod
    def from_manifest(cls, settings: Mapping[str, Any]) -> NemotronOmniSettings:
        """The settings :meth:`manifest` wrote; ``ValueError`` when malformed."""
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in settings.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"malformed Nemotron Omni settings ({exc})") from None

    def manifest(self) -> dict:
        """The settings, for the pack manifest and the reader."""
        return {"family": NEMOTRON_FAMILY, **asdict(self)}


#: The names a Nemotron Omni folder states (transformers' ``nemotron_h_omni``), each checked exactly: a folder that
#: names Nemotron Omni but states another name (another version's processor) is refused, never read by this rule.
NEMOTRON_OMNI_NAMES: dict[str, frozenset[str]] = {
    "processor class": frozenset({"NemotronH_Omni_Reasoning_V3Processor"}),
    "image processor": frozenset({"NemotronH_Omni_Reasoning_V3ImageProcessor"}),
    "video processor": frozenset({"NemotronH_Omni_Reasoning_V3VideoProcessor"}),
    "model type": frozenset({"nemotron_h_omni"}),
}


def is_nemotron_omni(folder: str | Path) -> bool:
    """Whether a model folder names a Nemotron Omni model: any processor class or model type it states does (see
    :data:`NEMOTRON_OMNI_NAMES`; :meth:`NemotronOmni.detect` then requires every name to be the one it knows)."""
    return any(name.startswith(("NemotronH_Omni", "NemotronH_Nano_Omni")) or name in NEMOTRON_OMNI_NAMES["model type"]
               for _, name in stated_names(folder))


def expand_placeholders(text: str, expansions: dict[str, Sequence[str]]) -> str:
    """Replace each occurrence of each placeholder (a key) by the next of its expansions, left to right.

    A placeholder kind with no expansions is left as text (the processors only look for the kinds they were given
    media for); otherwise the counts must match, else ``ValueError``.
    """
    active = {tok: list(rep) for tok, rep in expansions.items() if rep}
    if not active:
        return text
    pattern = re.compile("|".join(re.escape(tok) for tok in sorted(active, key=len, reverse=True)))
    found = {tok: 0 for tok in active}
    out, last = [], 0
    for m in pattern.finditer(text):
        tok = m.group()
        if found[tok] >= len(active[tok]):
            raise ValueError(f"text has more {tok} placeholders than the {len(active[tok])} media given")
        out += [text[last:m.start()], active[tok][found[tok]]]
        found[tok] += 1
        last = m.end()
    for tok, n in found.items():
        if n != len(active[tok]):
            raise ValueError(f"text has {n} {tok} placeholders for {len(active[tok])} media")
    out.append(text[last:])
    return "".join(out)


def _patch_grid(height: int, width: int, patch: int, merge: int, min_patches: int,
                max_patches: int) -> tuple[int, int]:
    """The image processor's grid choice: the image's own patch grid, scaled into the budget, sides made
    multiples of ``merge``."""
    gh, gw = round(height / patch + 0.5), round(width / patch + 0.5)
    factor = min(math.sqrt(max_patches / (gh * gw)), 1.0)
    gh, gw = math.floor(factor * gh), math.floor(factor * gw)
    if gh == 0 or gw == 0:  # the processor divides by zero here
        raise ValueError(f"image of {width}x{height} pixels is too elongated for the processor's patch grid (a "
                         f"side scales to zero patches)")
    if max_patches > min_patches and gh * gw < min_patches:
        factor = math.sqrt(min_patches / (gh * gw))
        gh, gw = math.ceil(factor * gh), math.ceil(factor * gw)
    if rem := gh % merge:
        gh = gh + merge - rem if (gh + merge - rem) * gw <= max_patches else max(merge, gh - rem)
    if rem := gw % merge:
        gw = gw + merge - rem if gh * (gw + merge - rem) <= max_patches else max(merge, gw - rem)
    return gh, gw



@dataclass(frozen=True)
class RunFacts:
    """What a convention's variant of Nemotron Omni takes from the run beside the model folder's rule, given when the
    family is built (the plain family takes none): the tokenizer (where the trainer's encoder measures text), the
    pack size (NeMo-RL's frame budget) and how audio tokens are counted (Megatron-Bridge's ``audio_count``)."""

    tok: Any = None
    pack_size: int = 0
    audio_count: AudioCount = "valid"


class NemotronOmni(ExpandsInText):
    """Nemotron Omni: images, videos and audio by their exact rules, each expansion written into the text as
    transformers' ``nemotron_h_omni`` processor writes it."""

    name = NEMOTRON_FAMILY
    kinds = ("image", "video", "audio")
    #: Settings only Qwen2-VL's rules (or a fixed image count) read: an error with a Nemotron Omni folder.
    QWEN_SETTINGS = ("min_pixels", "max_pixels", "image_tokens", "video_min_frames", "video_max_frames",
                     "video_min_pixels", "video_max_pixels")

    def __init__(self, tokens: MediaTokens, convention: Convention, folder: str, rule: NemotronOmniSettings,
                 run: RunFacts | None = None) -> None:
        super().__init__(tokens, convention, folder)
        self.rule = rule
        self.run = run if run is not None else RunFacts()

    # -- what a convention's variant changes (the plain family: nothing) ------------------------------------------
    @classmethod
    def variant_rule(cls, rule: NemotronOmniSettings, settings: EncodeSettings) -> NemotronOmniSettings:
        """The folder's rule as the variant's trainer applies it (:class:`ConfigError` for one it cannot take)."""
        return rule

    @classmethod
    def run_facts(cls, settings: EncodeSettings, tok: Any) -> RunFacts:
        """What the variant takes from the run it packs for."""
        return RunFacts()

    @classmethod
    def recorded_facts(cls, manifest: Mapping) -> RunFacts:
        """The same, as the run recorded them in its manifest (what verify and the reader re-derive with)."""
        return RunFacts()

    @classmethod
    def detect(cls, folder: Path, settings: EncodeSettings) -> bool:
        """A folder that names Nemotron Omni with every name this rule knows; one that names it with another
        (another version's processor) is a :class:`ConfigError` naming the processor mode (nothing in
        that mode: its own processor counts the tokens)."""
        return is_nemotron_omni(folder) and knows_exactly(folder, settings, NEMOTRON_OMNI_NAMES, "Nemotron Omni")

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> NemotronOmni:
        """Nemotron Omni's rules with the video and audio settings applied. Its tokenizer must hold the media
        tokens as added tokens (each one token)."""
        st = settings
        given = [name for name in cls.QWEN_SETTINGS if getattr(st, name) is not None]
        if given:
            raise ConfigError(f"{st.tokenizer}: {', '.join(given)} do not apply to a Nemotron Omni model folder")
        try:
            rule = NemotronOmniSettings.from_folder(st.tokenizer, fps=st.video_fps, num_frames=st.video_frames,
                                                    audio_max_seconds=st.audio_max_seconds)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{st.tokenizer}: unreadable Nemotron Omni processor settings ({exc})") from None
        names = (rule.image_token, rule.image_start_token, rule.image_end_token, rule.audio_token,
                 rule.audio_start_token, rule.audio_end_token)
        missing = [t for t in names if t not in tok.added_tokens_encoder]
        if missing:
            raise ConfigError(f"{st.tokenizer}: the tokenizer lacks the Nemotron Omni media tokens {missing}")
        vocab = tok.get_vocab()
        tokens = MediaTokens(image_token=rule.image_token, image_token_id=vocab[rule.image_token],
                             vision_start_id=vocab[rule.image_start_token], vision_end_id=vocab[rule.image_end_token],
                             video_text=rule.video_token, audio_text=rule.audio_token,
                             audio_token_id=vocab[rule.audio_token], audio_start_id=vocab[rule.audio_start_token],
                             audio_end_id=vocab[rule.audio_end_token])
        return cls(tokens, convention, str(st.tokenizer), cls.variant_rule(rule, st), cls.run_facts(st, tok))

    @classmethod
    def owns(cls, manifest: Mapping) -> bool:
        entry = manifest.get("image_processor")
        return isinstance(entry, Mapping) and entry.get("family") == NEMOTRON_FAMILY

    @classmethod
    def from_manifest(cls, manifest: Mapping, convention: Convention) -> NemotronOmni:
        return cls(manifest_tokens(manifest), convention, "",
                   NemotronOmniSettings.from_manifest(manifest["image_processor"]), cls.recorded_facts(manifest))

    def plan_image(self, width: int, height: int, n_images: int) -> ItemPlan:
        r = self.rule
        gh, gw = r.image_grid(width, height, n_images=n_images)
        return ItemPlan(r.image_tokens(width, height, n_images=n_images), (1, gh, gw),
                        text=r.image_text(width, height, n_images=n_images))

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        """Grid: the frames given to the processor, then the tile in patches."""
        plan = self.rule.video(facts)
        return ItemPlan(plan.tokens, (len(plan.indices), *plan.tile), plan.indices, None,
                        text=self.rule.plan_text(plan))

    def plan_audio(self, facts: AudioFacts, part: str) -> ItemPlan:
        self.refuse_audio(facts, part)
        return ItemPlan(self.rule.audio_tokens(facts), samples=self.rule.audio_samples(facts),
                        text=self.rule.audio_text(facts))

    def refuse_audio(self, facts: AudioFacts, part: str) -> None:
        """A clip the feature extractor cannot give features for is that sample's error."""
        if problem := self.rule.audio_problem(facts):
            raise SampleError(f"media {part!r}: {problem}")

    def placeholders(self) -> dict[str, tuple[str, str]]:
        r = self.rule
        return {"image": (r.image_token, r.image_token), "video": (r.video_token, r.image_token),
                "audio": (r.audio_token, r.audio_token)}

    def placeholder_ids(self) -> dict[str, int | None]:
        """``<image>`` for images and video chunks, ``<so_embedding>`` for audio."""
        image = self.tokens.image_token_id
        return {"image": image, "video": image, "audio": self.tokens.audio_token_id}

    # -- verify -----------------------------------------------------------------------------------------------
    #: The processor's patch budget depends on how many images the sample gives it in one call.
    shared_image_budget = True

    def audio_input(self) -> tuple[int, int | None] | None:
        return self.rule.audio_sampling_rate, self.rule.max_audio_samples

    def manifest_entries(self) -> dict[str, Any]:
        t = self.tokens
        return {"image_token_id": t.image_token_id, "vision_start_token_id": t.vision_start_id,
                "vision_end_token_id": t.vision_end_id, "image_processor": self.rule.manifest(),
                "video_token_id": None, "video_processor": None, "audio_token_id": t.audio_token_id,
                "audio_start_token_id": t.audio_start_id, "audio_end_token_id": t.audio_end_id}
