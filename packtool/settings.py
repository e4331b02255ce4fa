"""Settings: one typed definition of every option, checked when it is built, before any work starts.

Three groups, by what they decide:

* :class:`EncodeSettings` decide the encode stage (tokens, targets, truncation of each sample). Changing one
  re-encodes.
* :class:`PlanSettings` decide how encoded samples become packs and shards. Changing one re-plans and rewrites,
  reusing the encode work.
* :class:`RunOptions` decide how the run goes (workers, engine, strictness, dry run) and never the bytes.

:meth:`PackSettings.fingerprints` gives the two stamps a rerun compares: the encode stage's and the output's.
The CLI takes its defaults from these classes.

>>> s = PackSettings(EncodeSettings(tokenizer="model", pack_size=4096), PlanSettings(shard_size="1GB"))
>>> s.plan.shard_size
ShardSize(unit='bytes', value=1073741824)
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, InitVar, asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, get_args

from packtool.errors import ConfigError
from packtool.families.conventions import CONVENTIONS, Convention
from packtool.format import row_length

Overlong = Literal["truncate", "drop"]
MediaCheck = Literal["decode", "header"]
MediaTokens = Literal["rule", "processor"]
EngineKind = Literal["local", "ray"]
#: A ``--preset`` name: a key of the conventions' registry (:data:`packtool.families.conventions.CONVENTIONS`),
#: the one list of them (:data:`PRESET_NAMES`); checked when the settings are built.
Preset = str
#: Whose rule derives the per-segment alignment from the parallel sizes (``--align-for``).
AlignFor = Literal["megatron", "nemo-rl"]
ImageResize = Literal["processor", "qwen_vl_utils"]
#: Audio token count of ``--preset megatron-bridge-nemotron-omni``: from the features' valid length (Megatron-Bridge
#: main) or their frame count (0.6.2).
AudioCount = Literal["valid", "frames"]
#: How ``--preset nemo-rl-nemotron-omni`` renders a reply's thinking trace (NeMo-RL's ``thinking_trace_format``).
ThinkingTraceFormat = Literal["normalized", "ultra"]

#: The encode settings each preset sets: those of its convention (:mod:`packtool.families.conventions`).
PRESETS: dict[str, dict[str, Any]] = {name: c.settings() for name, c in CONVENTIONS.items()}
#: Encode settings only some conventions take -> those conventions' names (:attr:`Convention.options`).
CONVENTION_OPTIONS: dict[str, tuple[str, ...]] = {
    name: tuple(c.name for c in CONVENTIONS.values() if name in c.options)
    for name in dict.fromkeys(n for c in CONVENTIONS.values() for n in c.options)}
#: Presets named but not available yet, with the reason.
UNSUPPORTED_PRESETS = {name: c.unsupported for name, c in CONVENTIONS.items() if c.unsupported}
#: Every preset's name, in the registry's order.
PRESET_NAMES: tuple[str, ...] = tuple(CONVENTIONS)

#: Largest pack: boundaries (``cu_seqlens``) are int32.
MAX_PACK_SIZE = 2**31 - 1
#: PIL's default decompression-bomb limit, the default pixel limit.
DEFAULT_PIXEL_LIMIT = 89_478_485
#: Default cap on the bytes of one source sample (all its members).
DEFAULT_MAX_SAMPLE_BYTES = 1 << 30
#: Decoded pixels one sample's media may hand a processor (every image, every frame a processor is given): 2^28
#: pixels are 0.8 GB as RGB bytes before a processor's float copies.
DEFAULT_MAX_SAMPLE_PIXELS = 1 << 28
#: Messages of one conversation: locating the replies renders a prefix per reply, so the work grows with the square
#: of the turns.
DEFAULT_MAX_TURNS = 512


#: Every packing algorithm's name (the ``algorithm`` setting's type; the planner's registry,
#: :mod:`packtool.packer.algorithms.registry`, maps each to its implementation); ``auto`` is the default.
Algorithm = Literal["auto", "bfd", "ffd", "greedy_knapsack", "balanced_greedy_knapsack", "first_fit_shuffle",
                    "sequential"]

_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a Ray cluster address ``host:port`` (``[v6]:port`` too); ConfigError otherwise."""
    m = _ADDRESS.match(address) if isinstance(address, str) else None
    if m is None or not 1 <= int(m["port"]) <= 65535:
        raise ConfigError(f"Ray address {address!r} is not host:port")
    return m["host"].strip("[]"), int(m["port"])

def resolve_align(align: int | None, align_for: AlignFor = "megatron", cp_size: int = 1, tp_size: int = 1,
                  sequence_parallel: bool = False) -> int:
    """The alignment to pack with: ``align`` when given, which must then be a multiple of what the parallel
    sizes need (:func:`alignment_for`), else that."""
    need = alignment_for(align_for, cp_size=cp_size, tp_size=tp_size, sequence_parallel=sequence_parallel)
    if align is None:
        return need
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align % need:
        raise ConfigError(f"align {align!r} conflicts with cp_size {cp_size}, tp_size {tp_size}, sequence_parallel "
                          f"{sequence_parallel}: they need a multiple of {need}; give a multiple or leave align unset")
    return align


def derive_align(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Segment alignment Megatron needs: lcm(2*cp if cp > 1, cp*tp if sequence parallel and tp > 1); else 1.

    Context parallelism splits each sequence into ``2*cp`` chunks (load-balanced causal halves); sequence
    parallelism splits it across the ``cp*tp`` ranks that share it.
    """
    for name, value in (("cp_size", cp_size), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    cp, tp = cp_size, tp_size
    align = 1
    if cp > 1:
        align = math.lcm(align, 2 * cp)
    if sequence_parallel and tp > 1:
        align = math.lcm(align, cp * tp)
    return align


def nemo_rl_align(cp_size: int = 1, tp_size: int = 1) -> int:
    """The alignment a NeMo-RL recipe needs: its policy's ``make_sequence_length_divisible_by`` for Megatron,
    tp·cp·2 (16 at TP4/CP2, where :func:`derive_align` gives 4, 8 with sequence parallelism), which its packed
    SFT batch pads every sample to."""
    for name, value in (("cp_size", cp_size), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return 2 * cp_size * tp_size


def alignment_for(align_for: AlignFor, cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """The per-segment alignment ``align_for``'s trainer needs at these parallel sizes."""
    _check_choice(align_for, AlignFor, "align_for")
    if align_for == "nemo-rl":
        return nemo_rl_align(cp_size=cp_size, tp_size=tp_size)
    return derive_align(cp_size=cp_size, tp_size=tp_size, sequence_parallel=sequence_parallel)


def default(cls: type, name: str) -> Any:
    """The default of field ``name`` of settings class ``cls`` (for the CLI)."""
    f = next(f for f in fields(cls) if f.name == name)
    if f.default is not MISSING:
        return f.default
    if callable(f.default_factory):
        return f.default_factory()
    raise ValueError(f"{cls.__name__}.{name} has no default")


def setting(default: Any = MISSING, *, help: str, factory: Callable[[], Any] | None = None) -> Any:
    """A settings field, declared once: its name, type and default are the field's, ``help`` its line in
    ``packtool pack --help`` (the command's options are generated from the fields, :mod:`packtool.config`), its
    checks the class's own (``__post_init__``)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def help_of(cls: type, name: str) -> str:
    """The ``--help`` line of field ``name`` of settings class ``cls``."""
    return str(next(f for f in fields(cls) if f.name == name).metadata["help"])


def choices(literal: Any) -> tuple[str, ...]:
    return tuple(get_args(literal))


def _check_choice(value: str, literal: Any, name: str) -> None:
    if value not in get_args(literal):
        raise ConfigError(f"unknown {name} {value!r}; choose one of {', '.join(get_args(literal))}")


def _check_int(value: Any, name: str, *, low: int = 1, high: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, not {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"{name} must be {bounds}, not {value}")


@dataclass(frozen=True)
class ShardSize:
    """How big an output shard may grow: a byte estimate or a number of packs."""

    unit: Literal["bytes", "packs"]
    value: int

    _UNITS = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40, "B": 1}

    @classmethod
    def parse(cls, text: str | int | ShardSize) -> ShardSize:
        """``"1000"`` or ``1000`` -> 1000 packs; ``"512MB"`` -> 512·2^20 bytes (KB, MB, GB, TB: powers of 1024)."""
        if isinstance(text, ShardSize):
            return text
        if isinstance(text, int) and not isinstance(text, bool) and text > 0:
            return cls("packs", text)
        t = str(text).strip().upper().replace(" ", "")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(KB|MB|GB|TB|B)", t)
        if m:
            size = int(float(m.group(1)) * cls._UNITS[m.group(2)])
            if size >= 1:
                return cls("bytes", size)
        if t.isdigit() and int(t) > 0:
            return cls("packs", int(t))
        raise ConfigError(f"shard size must be a pack count or a size like 512MB, not {text!r}")

    def __str__(self) -> str:
        if self.unit == "packs":
            return str(self.value)
        for suffix in ("TB", "GB", "MB", "KB"):
            if self.value % self._UNITS[suffix] == 0:
                return f"{self.value // self._UNITS[suffix]}{suffix}"
        return f"{self.value}B"


@dataclass(frozen=True)
class EncodeSettings:
    """Every setting that changes how one sample is encoded."""

    #: Local model folder: tokenizer.json, tokenizer_config.json, chat template, optional preprocessor_config.json.
    tokenizer: str = setting(help="Model folder, or a model id in the local Hugging Face cache, or "
                                  "msc://PROFILE/path (tokenizer, chat template, processor config).")
    #: Tokens per pack; also the longest a sample may stay.
    pack_size: int = setting(help="Tokens per pack.")
    #: Each segment's length is rounded up to a multiple of this (context/sequence parallelism).
    align: int = setting(1, help="Per-segment alignment (default: from --cp-size etc.).")
    #: What happens to a sample longer than the pack (or over a per-pack media cap): cut at a safe point, or drop.
    overlong: Overlong = setting("truncate", help="truncate (cut at a safe boundary) or drop.")
    #: Override the image processor's pixel bounds.
    min_pixels: int | None = setting(None, help="Override the processor's min_pixels.")
    max_pixels: int | None = setting(None, help="Override the processor's max_pixels.")
    #: Fixed tokens per image (models without Qwen2-VL's rule).
    image_tokens: int | None = setting(None, help="Fixed tokens per image (non-Qwen models).")
    #: Per-pack caps on media items and their placeholder tokens, every kind counted (images, videos, audio); also
    #: applied to single samples (a sample over one is cut or dropped, never inside a media span).
    max_images: int | None = setting(None, help="At most this many media items (images, videos, audio) per pack.")
    max_image_tokens: int | None = setting(None, help="At most this many media tokens per pack.")
    #: Video frame sampling, overriding the model folder's video processor: a rate in frames per second, or a
    #: frame count (one of the two; giving either turns sampling on), and the frame-count bounds of rate sampling.
    video_fps: float | None = setting(None, help="Sample video frames at this rate (overrides the model folder).")
    video_frames: int | None = setting(None, help="Sample this many frames per video.")
    video_min_frames: int | None = setting(None, help="Fewest frames rate sampling keeps.")
    video_max_frames: int | None = setting(None, help="Most frames rate sampling keeps.")
    #: Override the video processor's pixel bounds per frame.
    video_min_pixels: int | None = setting(None, help="Override the video processor's min pixels per frame.")
    video_max_pixels: int | None = setting(None, help="Override the video processor's max pixels per frame.")
    #: Audio clips longer than this many seconds are cut to it before their tokens are counted and their features
    #: extracted (Nemotron Omni); ``None``: no limit.
    audio_max_seconds: float | None = setting(None, help="Cut audio clips to this many seconds (Nemotron Omni).")
    #: ``module:function`` turning a raw sample into a conversation.
    adapter: str | None = setting(None, help="Custom adapter module:function.")
    #: Read pickled media lists through the restricted unpickler.
    allow_pickle: bool = setting(False, help="Read pickled media lists (through a restricted unpickler).")
    #: Images with more pixels are quarantined (decompression bombs).
    pixel_limit: int = setting(DEFAULT_PIXEL_LIMIT, help="Images with more pixels are quarantined.")
    #: How media placeholders become tokens: ``rule`` counts them from the media's headers with packtool's exact rules
    #: (Qwen2-VL / Qwen2.5-VL, Nemotron Omni, or a fixed image count); ``processor`` calls the model folder's own
    #: transformers processor on every sample with media (any family; exact by construction, slower: every media
    #: item is decoded).
    media_tokens: MediaTokens = setting("rule", help="rule (packtool's exact rules from media headers) or processor "
                                                     "(the model folder's own processor on every sample; any "
                                                     "family, slower).")
    #: ``decode`` proves every image decodes; ``header`` reads sizes only.
    media_check: MediaCheck = setting("decode", help="decode (prove every image decodes) or header (size only).")
    #: User text of captioning samples.
    caption_prompt: str = setting("", help="User text for captioning datasets.")
    #: The date templates see through ``strftime_now``, fixed so reruns on another day give the same tokens.
    template_date: str = setting("2026-01-01", help="Date the chat template sees (strftime_now), fixed for "
                                                    "reproducible output.")
    #: Samples whose members hold more bytes are quarantined before they are parsed, and so are samples whose
    #: media members written into the pack would hold more (a pickled list can name one image many times).
    max_sample_bytes: int = setting(DEFAULT_MAX_SAMPLE_BYTES, help="Samples with more bytes (read, or media "
                                                                   "written) are quarantined.")
    #: Samples whose media hand their processor more decoded pixels (images and frames together) are quarantined.
    max_sample_pixels: int = setting(DEFAULT_MAX_SAMPLE_PIXELS, help="Samples whose media give a processor more "
                                                                     "decoded pixels (images and frames together) "
                                                                     "are quarantined.")
    #: Conversations with more messages are quarantined before they are rendered.
    max_turns: int = setting(DEFAULT_MAX_TURNS, help="Conversations with more messages are quarantined.")
    #: Also train on the newline token the chat template emits right after each reply's end-of-turn token.
    target_newline_after_eot: bool = setting(False, help="Also train on the newline after each end-of-turn token.")
    #: Move the image tags of each turn before its text; the text pieces around a tag lose their edge spaces.
    media_first: bool = setting(False, help="Move each turn's images before its text.")
    #: How an image is resized before its patches are cut: ``processor``, once by the processor's rule;
    #: ``qwen_vl_utils``, first by qwen_vl_utils' ``fetch_image`` (sides to multiples of patch·merge within its
    #: own bounds, 4 to 16,384 tokens), then by the processor's rule (Megatron-Bridge's Qwen-VL path: other grids
    #: for many images, and the reader resamples twice too).
    image_resize: ImageResize = setting("processor", help=f"{', '.join(choices(ImageResize))}: resize by the "
                                                          "processor's rule alone, or qwen_vl_utils' fetch_image "
                                                          "first (Megatron-Bridge).")
    #: A sample with more images, or whose images and videos take more placeholder tokens (each image counted by
    #: the processor's rule from its stored size), is dropped (Megatron-Bridge's ``max_num_images`` and
    #: ``max_visual_tokens``, which skip the sample); unlike ``max_images`` and ``max_image_tokens`` nothing is cut.
    sample_max_images: int | None = setting(None, help="Drop samples with more images.")
    sample_max_visual_tokens: int | None = setting(None, help="Drop samples whose images and videos take more "
                                                              "tokens.")
    #: Only the first this many frames of each video are kept (Megatron-Bridge's ``max_num_frames``).
    video_keep_frames: int | None = setting(None, help="Keep only the first N frames of each video.")
    #: With ``--preset megatron-bridge-nemotron-omni``: each clip's ``<so_embedding>`` count and ``sound_length``
    #: from the Parakeet features' valid length (``valid``, Megatron-Bridge main) or their frame count, one more
    #: (``frames``, Megatron-Bridge 0.6.2).
    audio_count: AudioCount = setting("valid", help=f"{', '.join(choices(AudioCount))}: audio tokens of --preset "
                                                    "megatron-bridge-nemotron-omni from the features' valid length "
                                                    "(Megatron-Bridge main) or frame count (0.6.2).")
    #: With ``--preset nemo-rl-nemotron-omni``: NeMo-RL's ``thinking_trace_format``: ``normalized`` renders a trace
    #: ``<think>\n…\n</think>\n`` before the answer, ``ultra`` (its Nemotron Omni recipe) ``<think>\n…</think>``
    #: with the answer right after. None: the preset's default (``ultra``, what that recipe trains).
    thinking_trace_format: ThinkingTraceFormat | None = setting(
        None, help=f"{', '.join(choices(ThinkingTraceFormat))}: a reply's thinking trace under --preset "
                   "nemo-rl-nemotron-omni, as NeMo-RL's thinking_trace_format renders it (default: its Nemotron "
                   "Omni recipe's, ultra).")
    #: A named set of the settings above (:data:`PRESETS`): it fills those still at their default, and any of them
    #: given a different value is an error, so the recorded preset always means what it says.
    preset: Preset | None = setting(None, help=f"Named conventions: {', '.join(PRESET_NAMES)}.")
    #: Which settings were given (by a flag or a config file), and where each came from (its config file): the one
    #: application of the preset (:meth:`_apply_preset`) refuses a given value the preset sets otherwise, and names
    #: the file. Without ``given``, the values other than their default count as given. Not settings themselves.
    given: InitVar[Collection[str] | None] = None
    origin: InitVar[Mapping[str, str] | None] = None

    def __post_init__(self, given: Collection[str] | None = None, origin: Mapping[str, str] | None = None) -> None:
        self._apply_preset(given, origin or {})
        _check_int(self.pack_size, "pack_size", high=MAX_PACK_SIZE)
        _check_int(self.align, "align")
        if self.align > self.pack_size:
            raise ConfigError(f"pack_size {self.pack_size} is smaller than the alignment {self.align}")
        _check_choice(self.overlong, Overlong, "overlong")
        _check_choice(self.media_check, MediaCheck, "media_check")
        _check_choice(self.media_tokens, MediaTokens, "media_tokens")
        _check_choice(self.image_resize, ImageResize, "image_resize")
        _check_choice(self.audio_count, AudioCount, "audio_count")
        if self.thinking_trace_format is not None:
            _check_choice(self.thinking_trace_format, ThinkingTraceFormat, "thinking_trace_format")
        for name, owners in CONVENTION_OPTIONS.items():  # a convention's own settings, with it only
            if getattr(self, name) != default(EncodeSettings, name) and self.preset not in owners:
                raise ConfigError(f"{name} applies to --preset {' or '.join(owners)} only")
        for name in ("min_pixels", "max_pixels", "image_tokens", "max_images", "max_image_tokens", "video_frames",
                     "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels",
                     "sample_max_images", "sample_max_visual_tokens", "video_keep_frames"):
            _check_int(getattr(self, name), name, optional=True)
        for lo, hi in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels"),
                       ("video_min_frames", "video_max_frames")):
            if getattr(self, lo) and getattr(self, hi) and getattr(self, lo) > getattr(self, hi):
                raise ConfigError(f"{lo} {getattr(self, lo)} exceeds {hi} {getattr(self, hi)}")
        if self.video_fps is not None:
            if isinstance(self.video_fps, bool) or not isinstance(self.video_fps, (int, float)) or \
                    not 0 < self.video_fps < math.inf:
                raise ConfigError(f"video_fps must be a positive number, not {self.video_fps!r}")
            if self.video_frames is not None:
                raise ConfigError("give video_fps or video_frames, not both")
        if self.audio_max_seconds is not None and (
                isinstance(self.audio_max_seconds, bool) or not isinstance(self.audio_max_seconds, (int, float))
                or not 0 < self.audio_max_seconds < math.inf):
            raise ConfigError(f"audio_max_seconds must be a positive number, not {self.audio_max_seconds!r}")
        _check_int(self.pixel_limit, "pixel_limit")
        _check_int(self.max_sample_bytes, "max_sample_bytes")
        _check_int(self.max_sample_pixels, "max_sample_pixels")
        _check_int(self.max_turns, "max_turns")
        if self.adapter is not None and not re.fullmatch(r"[\w.]+:\w+", self.adapter):
            raise ConfigError(f"adapter must be module:function, not {self.adapter!r}")
        try:
            datetime.date.fromisoformat(self.template_date)
        except (TypeError, ValueError):
            raise ConfigError(f"template_date must be YYYY-MM-DD, not {self.template_date!r}") from None

    def _apply_preset(self, given: Collection[str] | None, origin: Mapping[str, str]) -> None:
        """The preset's one application: every setting its convention sets takes the convention's value; one given
        another value (explicitly, or in a config file: ``origin``) is an error naming where it came from."""
        if self.preset is None:
            return
        if self.preset not in CONVENTIONS:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of {', '.join(CONVENTIONS)}")
        if self.preset in UNSUPPORTED_PRESETS:
            raise ConfigError(f"preset {self.preset!r} is not supported yet: {UNSUPPORTED_PRESETS[self.preset]}")
        for name, value in PRESETS[self.preset].items():
            current = getattr(self, name)
            stated = name in given if given is not None else current != default(EncodeSettings, name)
            if stated and current != value:
                where = (f" (given in {origin[name]})" if name in origin
                         else " (given explicitly)" if given is not None else "")
                raise ConfigError(f"preset {self.preset!r} sets {name} to {value!r}, not {current!r}{where}; leave it "
                                  "unset or drop the preset")
            object.__setattr__(self, name, value)
        for name, value in CONVENTIONS[self.preset].option_defaults().items():  # its own options: defaults
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    @cached_property
    def convention(self) -> Convention:
        """The convention these settings ask for (:meth:`Convention.of`), built once: the family takes it and the
        manifest records it."""
        return Convention.of(self)

    @property
    def max_tokens(self) -> int:
        """Longest sample that fits a pack once its length is rounded up to the alignment."""
        return row_length(self.pack_size, self.align)


#: Encode settings added after the manifest's fields were fixed: recorded (manifest, stamps) only when they differ
#: from their default, so an output made without them keeps its bytes and its stamps.
RECORDED_WHEN_SET = ("image_resize", "sample_max_images", "sample_max_visual_tokens", "video_keep_frames",
                     "audio_count", "thinking_trace_format")


def _recorded(encode: EncodeSettings) -> dict[str, Any]:
    values = asdict(encode)
    for name in RECORDED_WHEN_SET:
        if values[name] == default(EncodeSettings, name):
            del values[name]
    return values


#: What a preset's own option meant in manifests that do not record it (written before the preset had a default of
#: its own): ``thinking_trace_format`` was ``normalized``.
UNRECORDED_OPTIONS = {"thinking_trace_format": "normalized"}


def recorded_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Encode settings as a manifest records them, ready for :class:`EncodeSettings`: a preset's own option the
    manifest lacks takes the value it had then (:data:`UNRECORDED_OPTIONS`), not the preset's default now."""
    names = {f.name for f in fields(EncodeSettings)}
    kw = {k: v for k, v in settings.items() if k in names}
    preset = kw.get("preset")
    for name in (CONVENTIONS[preset].option_defaults() if preset in CONVENTIONS else {}):
        if name in UNRECORDED_OPTIONS:
            kw.setdefault(name, UNRECORDED_OPTIONS[name])
    return kw


@dataclass(frozen=True)
class PlanSettings:
    """Every setting that changes which samples share a pack and how packs are ordered and cut into shards."""

    #: Packing algorithm; ``auto`` keeps the best of best-fit decreasing and a seeded shuffled first fit.
    algorithm: Algorithm = setting("auto", help=f"{', '.join(choices(Algorithm))}.")
    #: Extra packs ``balanced_greedy_knapsack`` opens up front.
    balanced_delta: int = setting(0, help="Extra packs for balanced_greedy_knapsack.")
    #: At most this many samples per pack.
    max_segments: int | None = setting(None, help="At most this many samples per pack.")
    #: Seed of the seeded algorithms and of the data-parallel ordering.
    seed: int = setting(0, help="Seed for seeded algorithms (and of the --val-* draw).")
    #: Output shard size (a pack count, or bytes like ``"512MB"``), parsed when the settings are built.
    shard_size: ShardSize = setting(factory=lambda: ShardSize.parse("512MB"),
                                    help="Output shard size: bytes (512MB) or a pack count (1000).")
    #: Order packs so each group of this many consecutive packs (one step on as many ranks) balances compute.
    balance_dp: int | None = setting(None, help="Order packs so each group of N ranks balances.")

    def __post_init__(self) -> None:
        _check_choice(self.algorithm, Algorithm, "algorithm")
        _check_int(self.balanced_delta, "balanced_delta", low=0)
        _check_int(self.max_segments, "max_segments", optional=True)
        _check_int(self.seed, "seed", low=0)
        _check_int(self.balance_dp, "balance_dp", optional=True)
        object.__setattr__(self, "shard_size", ShardSize.parse(self.shard_size))


@dataclass(frozen=True)
class Holdout:
    """A validation split held out of the source's ``train`` split: ``ratio`` of its kept samples (rounded half
    up), or ``count`` of them (all, when it has fewer). Which samples: those whose digest of (seed, source shard,
    sample key) is smallest, so the choice depends on no worker count, order or rerun."""

    ratio: float | None = None
    count: int | None = None

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.count is None):
            raise ConfigError("give one of val_ratio and val_count")
        if self.ratio is not None and (isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float))
                                       or not 0.0 < self.ratio < 1.0):
            raise ConfigError(f"val_ratio must be between 0 and 1 (both excluded), not {self.ratio!r}")
        _check_int(self.count, "val_count", optional=True)

    def size(self, kept: int) -> int:
        """How many of ``kept`` samples go to the validation split."""
        if self.count is not None:
            return min(self.count, kept)
        assert self.ratio is not None
        return min(kept, math.floor(self.ratio * kept + 0.5))

    def describe(self) -> dict[str, float | int]:
        return {"val_ratio": self.ratio} if self.ratio is not None else {"val_count": int(self.count or 0)}


@dataclass(frozen=True)
class Parallel:
    """The parallel sizes a run's alignment was derived from (``--align-for``, ``--cp-size``, ``--tp-size``,
    ``--sequence-parallel``): recorded in the run's config only when one differs from its default, so the config
    ``inspect --config`` writes sets them and leaves the alignment they derive as a comment."""

    align_for: AlignFor = setting("megatron", help=f"{', '.join(choices(AlignFor))}: whose rule derives the "
                                                   "alignment from the parallel sizes: megatron (2·cp, cp·tp with "
                                                   "SP) or nemo-rl (make_sequence_length_divisible_by, tp·cp·2).")
    cp_size: int = setting(1, help="Context-parallel size (align = 2·cp when cp > 1).")
    tp_size: int = setting(1, help="Tensor-parallel size (with --sequence-parallel).")
    sequence_parallel: bool = setting(False, help="Sequence parallelism (align includes cp·tp).")

    def __post_init__(self) -> None:
        _check_choice(self.align_for, AlignFor, "align_for")
        _check_int(self.cp_size, "cp_size")
        _check_int(self.tp_size, "tp_size")

    @property
    def align(self) -> int:
        """The alignment these sizes need (:func:`alignment_for`)."""
        return alignment_for(self.align_for, self.cp_size, self.tp_size, self.sequence_parallel)

    def describe(self) -> dict[str, Any]:
        """The sizes that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


@dataclass(frozen=True)
class PackSettings:
    """Everything that decides the bytes of an OUTPUT."""

    encode: EncodeSettings
    plan: PlanSettings = field(default_factory=PlanSettings)
    #: Splits to pack; empty = every split of ``split.yaml``.
    splits: tuple[str, ...] = ()
    #: A validation split held out of ``train`` (``val``); None: the source's splits as they are.
    holdout: Holdout | None = None
    #: The parallel sizes ``encode.align`` was derived from, when given (recorded in the run's config; the
    #: alignment alone decides the bytes, so they are in no fingerprint).
    parallel: Parallel | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "splits", tuple(self.splits))
        if self.holdout is not None and not isinstance(self.holdout, Holdout):
            raise ConfigError(f"holdout must be a Holdout, not {self.holdout!r}")

    def _holdout(self) -> dict:
        """The hold-out's settings, recorded only when set (outputs without one keep their bytes)."""
        return {"holdout": self.holdout.describe()} if self.holdout is not None else {}

    def fingerprints(self, source: Path, tokenizer_fingerprint: str) -> dict[str, dict]:
        """``{"encode": ..., "output": ...}`` as JSON values (so a stamp read back compares equal): the encode
        stamp covers the source, the model files and the encode settings; the output stamp adds the plan and
        the splits."""
        encode = {**_recorded(self.encode), "tokenizer": tokenizer_fingerprint, "source": str(source)}
        plan = {**asdict(self.plan), "shard_size": str(self.plan.shard_size)}
        output = {"encode": encode, "plan": plan, "splits": list(self.splits), **self._holdout()}
        return json.loads(json.dumps({"encode": encode, "output": output}))

    def describe(self) -> dict:
        """Every setting as plain values, for the manifest."""
        return {**_recorded(self.encode), "tokenizer": Path(self.encode.tokenizer).name,
                **asdict(self.plan), "shard_size": str(self.plan.shard_size), "splits": list(self.splits),
                **self._holdout()}


@dataclass(frozen=True)
class RunOptions:
    """How a run goes; never what it writes."""

    #: Worker processes (local engine); 1 runs everything in this process.
    workers: int = setting(1, help="Worker processes (default: all cores).")
    engine: EngineKind = setting("local", help="local or ray.")
    #: Ray cluster address (``host:port``) with ``engine="ray"``; None starts a local Ray.
    ray_address: str | None = setting(None, help="Ray cluster address host:port (with --engine ray).")
    #: Stop at the first bad sample instead of quarantining it.
    strict: bool = setting(False, help="Stop at the first bad sample.")
    #: Stop after planning: ledger and statistics only.
    dry_run: bool = setting(False, help="Stop after planning: ledger and plan statistics.")
    #: Replace an OUTPUT made with other settings (or not made by packtool).
    overwrite: bool = setting(False, help="Replace an OUTPUT made with other settings.")
    progress: bool = setting(True, help="Show progress bars.")
    #: Above this fraction of error rows the run fails (after writing the ledger; as soon as it is certain, during
    #: the encode stage).
    max_error_rate: float = setting(0.01, help="Exit 3 above this share of error samples.")
    #: The same for samples dropped (too long, or no training targets left).
    max_drop_rate: float = setting(0.05, help="Exit 3 above this share of dropped samples.")
    #: The same for samples truncated.
    max_truncate_rate: float = setting(0.5, help="Exit 3 above this share of truncated samples.")
    #: This many samples in a row (of one shard) failing (error or dropped) stop the run at once: the cause is
    #: systematic (a setting, the model folder, the data's layout); 0 never stops.
    max_failures_in_a_row: int = setting(100, help="Stop at once when this many samples in a row fail (0: never).")
    #: This many samples of one shard's range failing with the very same reason (one that names no property of a
    #: sample, such as a media kind the model folder has no rule for) stop the run at once; 0 never stops.
    max_same_failures: int = setting(20, help="Stop at once when this many samples of a shard range fail for the "
                                              "same reason (0: never).")

    def __post_init__(self) -> None:
        _check_int(self.workers, "workers")
        _check_choice(self.engine, EngineKind, "engine")
        if self.ray_address is not None:
            split_address(self.ray_address)
        for name in ("max_error_rate", "max_drop_rate", "max_truncate_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be between 0 and 1, not {value!r}")
        _check_int(self.max_failures_in_a_row, "max_failures_in_a_row", low=0)
        _check_int(self.max_same_failures, "max_same_failures", low=0)

    def limits(self) -> dict[str, float]:
        """Ledger status -> the largest fraction of a run's samples it may have."""
        return {"error": self.max_error_rate, "dropped": self.max_drop_rate, "truncated": self.max_truncate_rate}
