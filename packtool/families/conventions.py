"""Conventions: the same model family under another trainer's data path.

A :class:`Convention` is a value a family takes. transformers' processor is the default convention
(:data:`TRANSFORMERS`); ``--preset NAME`` names another one (:data:`CONVENTIONS`), and the settings a preset fills
(:data:`packtool.settings.PRESETS`) are the convention's :meth:`Convention.settings`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from packtool.errors import SampleError
from packtool.families.nemo_rl_rules import assistant_text
from packtool.format import MEDIA_TAGS, TAG_PATTERN, tag_kinds

#: The preset of NeMo-RL's Nemotron Omni conventions.
NEMO_RL_NEMOTRON = "nemo-rl-nemotron-omni"
#: The Nemotron Omni family's name (its packs' ``image_processor.family``), which its conventions are registered for.
NEMOTRON_FAMILY = "nemotron_omni"

if TYPE_CHECKING:
    from packtool.settings import EncodeSettings


@dataclass(frozen=True)
class Convention:
    """The choices a trainer's data path makes around a family's media and targets.

    Fields are the choices every family shares (each one also an encode setting, so it can be given alone);
    what a convention changes about one family's media (its resize rule, frame sampling, frame labels and
    canvas, audio counts, the text around media) is a subclass of that family registered for the convention
    (see :mod:`packtool.families`)."""

    #: ``--preset`` name; ``transformers`` for the default.
    name: str = "transformers"
    #: Which tokens are targets: also the newline token after each reply's end-of-turn token.
    target_newline_after_eot: bool = False
    #: Headers and joins around media: each turn's media before its text, the text pieces stripped of edge spaces.
    media_first: bool = False
    #: The image resize rule's pixel bounds (None: the model folder's).
    min_pixels: int | None = None
    max_pixels: int | None = None
    #: The image resize: ``processor`` (its rule alone) or ``qwen_vl_utils`` (its ``fetch_image`` first).
    image_resize: str = "processor"
    #: Per-sample limits: a sample with more images, or more visual tokens, is dropped.
    sample_max_images: int | None = None
    sample_max_visual_tokens: int | None = None
    #: Only the first this many frames of each video are kept.
    video_keep_frames: int | None = None
    #: What happens to a sample longer than the pack: ``truncate`` (cut at a safe boundary) or ``drop``, as the
    #: trainer's own path treats it.
    overlong: str = "truncate"
    #: Why the ledger notes a sample whose media had no tags in the text (packtool places them before the first
    #: user text, which this trainer's path would not); empty: no note.
    untagged_note: str = ""
    #: Why the ledger notes a sample with a video file (packtool decodes it and treats its frames as a frame
    #: list, which this trainer's path cannot do); empty: no note.
    video_file_note: str = ""
    #: Why this trainer's model cannot take context parallelism > 1 with these packs (None: it can).
    no_context_parallel: str | None = None
    #: Whether a ``ChatMLWebdataset``'s ``audio`` member is taken: one clip, never tagged in the text (the family
    #: places it); False: such a sample is refused.
    chatml_audio: bool = False
    #: Why the convention cannot be used yet (None: it can).
    unsupported: str | None = None
    #: The family the convention is for (its ``name``; None: any).
    family: str | None = None
    #: The trainer's Energon decoder (``pilrgb``) hands images over as ``convert("RGB")`` gives them: alpha dropped
    #: without compositing, palette and CMYK converted by PIL; the reader feeds its processor the same.
    rgb_decode: bool = False
    #: How a reply's thinking trace is rendered (NeMo-RL's ``thinking_trace_format``; its Nemotron convention only).
    thinking_trace_format: str = "normalized"
    #: Encode settings only this convention takes (besides the fields above): given with another convention, or
    #: none, a value other than their default is an error (``audio_count``, ``thinking_trace_format``). Those that
    #: are fields of the convention take its value when nobody gives one (:meth:`option_defaults`).
    options: tuple[str, ...] = ()

    def settings(self) -> dict[str, Any]:
        """The encode settings this convention sets (those that differ from the default convention); its own
        options are defaults, not set (:meth:`option_defaults`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("name", "unsupported", "family", "untagged_note", "video_file_note",
                                  "no_context_parallel", "chatml_audio", "rgb_decode", "options", *self.options)
                and getattr(self, f.name) != getattr(TRANSFORMERS, f.name)}

    def option_defaults(self) -> dict[str, Any]:
        """The values of this convention's own options when none is given (its trainer's recipe's)."""
        names = {f.name for f in fields(self)}
        return {name: getattr(self, name) for name in self.options if name in names}

    @classmethod
    def of(cls, settings: EncodeSettings) -> Convention:
        """The convention the settings ask for, with the choices given one by one (or filled by the preset): every
        field of the convention that is also an encode setting takes the setting's value (found by name, none
        copied by hand); a convention's own option left unset (None) keeps the convention's value. Built once per
        settings: :attr:`packtool.settings.EncodeSettings.convention`."""
        base = CONVENTIONS[settings.preset] if settings.preset else TRANSFORMERS
        ours = {f.name for f in fields(base)}
        options = {name for c in CONVENTIONS.values() for name in c.options}
        given = {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in ours}
        return replace(base, **{name: value for name, value in given.items()
                                if value is not None or name not in options})

    def record(self) -> dict[str, Any]:
        """The convention as it took effect, for the manifest (:func:`from_record` reads it back)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    # -- what the encoder asks of it ------------------------------------------------------------------------------
    def turn_text(self, text: str, role: str = "user") -> str:
        """A turn's text (of a ``role`` turn) as this convention lays it out around its media tags."""
        return media_first(text) if self.media_first else text

    def mark_targets(self, ids: np.ndarray, targets: np.ndarray, special: np.ndarray, newline_id: int | None) -> None:
        """Extra targets this convention trains on (in place): the newline token right after each reply's
        end-of-turn token (the token after a run of targets that ends on a special token)."""
        if not self.target_newline_after_eot:
            return
        t = targets.astype(bool)
        after = np.flatnonzero(t[:-1] & ~t[1:]) + 1
        ends_on_eot = np.isin(ids[after - 1], special)
        targets[after[ends_on_eot & (ids[after] == newline_id)]] = 1


@dataclass(frozen=True)
class NemoRLChat(Convention):
    """NeMo-RL's ``hf_multimodal`` adapter: each assistant message as the chat template adds it is a target, so
    besides the reply, its end-of-turn token and the newline after it (``target_newline_after_eot``), its role
    header: the tokens from the special token that opens the turn (``<|im_start|>``) to the reply."""

    def mark_targets(self, ids: np.ndarray, targets: np.ndarray, special: np.ndarray, newline_id: int | None) -> None:
        super().mark_targets(ids, targets, special, newline_id)
        t = targets.astype(bool)
        starts = np.flatnonzero(t & ~np.concatenate([[False], t[:-1]]))
        opens = np.flatnonzero(np.isin(ids, special))
        for start, k in zip(starts.tolist(), (np.searchsorted(opens, starts) - 1).tolist()):
            if k >= 0:
                targets[opens[k]:start] = 1


@dataclass(frozen=True)
class NemoRLNemotron(Convention):
    """NeMo-RL's ``nemotron_multimodal`` encoder (prompt format ``nemotron6-moe``): replies laid out as it renders
    them (:func:`packtool.families.nemo_rl_rules.assistant_text`); its media: the Nemotron Omni variant
    (:mod:`packtool.families.nemotron_omni.nemo_rl`). Targets: each reply through its end-of-turn token, as by
    default."""

    def turn_text(self, text: str, role: str = "user") -> str:
        text = super().turn_text(text, role)
        if role != "assistant":
            return text
        try:
            return assistant_text(text, ultra=self.thinking_trace_format == "ultra")
        except ValueError as exc:
            raise SampleError(str(exc)) from None


def trainer_image(image, convention: Convention):
    """An image as the convention's trainer hands it to its processor: ``image.convert("RGB")`` where its Energon
    decoder is ``pilrgb`` (:attr:`Convention.rgb_decode`), else unchanged (the processor composites alpha onto
    white)."""
    return image.convert("RGB") if convention.rgb_decode else image


def media_first(text: str) -> str:
    """The turn text with its media tags moved before the text pieces (in their order), each piece stripped of
    edge spaces (how Megatron-Bridge's Qwen-VL task encoder orders a turn); text without tags is unchanged."""
    kinds = tag_kinds(text)
    if not kinds:
        return text
    return "".join(MEDIA_TAGS[k] for k in kinds) + "".join(p.strip(" ") for p in TAG_PATTERN.split(text))


#: transformers' processor: replies plus their end-of-turn token are targets, media stay where their tags are,
#: pixel bounds come from the model folder.
TRANSFORMERS = Convention()

#: Every named convention (``--preset``), each registered once (:func:`register_convention`).
CONVENTIONS: dict[str, Convention] = {}


def add_variant(owner: type, variants: dict[str, Any], convention: str, variant: type) -> None:
    """Add ``variant`` (a subclass of ``owner``: a family, or a family's reader) to ``owner``'s ``variants`` under
    ``convention``; a class that is no subclass, or a convention registered twice for one owner, is refused."""
    if not (isinstance(variant, type) and issubclass(variant, owner)):
        raise TypeError(f"{variant!r} is not a subclass of {owner.__name__}")
    if convention in variants:
        raise ValueError(f"{owner.__name__} already has a variant for {convention!r}: {variants[convention].__name__}")
    variants[convention] = variant


def register_convention(convention: Convention) -> Convention:
    """Add a named convention (``--preset`` takes its names from here); a name registered twice is refused."""
    if convention.name in CONVENTIONS or convention.name == TRANSFORMERS.name:
        raise ValueError(f"a convention called {convention.name!r} is already registered")
    CONVENTIONS[convention.name] = convention
    return convention


def from_record(record: Mapping[str, Any]) -> Convention:
    """The convention a manifest recorded (:meth:`Convention.record`): the registered convention's class of that
    name (its rules), with the recorded values (so packs read as they were made, whatever this packtool's value
    of the convention is now); fields the record lacks keep the class's defaults, unknown ones are ignored."""
    base = CONVENTIONS.get(str(record.get("name")), TRANSFORMERS)
    names = {f.name: f for f in fields(base)}
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k in names}
    return type(base)(**values)


# Megatron-Bridge's QwenVLTaskEncoder: its ``build_assistant_loss_mask`` (the newline after each reply's end-of-turn
# token is a target), media first, its two-step image resize (qwen_vl_utils' ``fetch_image``, then the processor with
# its pixel bounds) and its per-sample limits (``max_num_images`` 10, ``max_visual_tokens`` 16,384); an over-long
# sample makes its encoder raise, and Energon skips it (dropped here).
register_convention(Convention(
    "megatron-bridge-qwen-vl", target_newline_after_eot=True, rgb_decode=True, media_first=True, min_pixels=200_704,
    max_pixels=1_003_520, image_resize="qwen_vl_utils", sample_max_images=10, sample_max_visual_tokens=16_384,
    video_keep_frames=60, overlong="drop",
    untagged_note="Megatron-Bridge's Qwen-VL path would leave them out and train the text only",
    video_file_note="Megatron-Bridge's Qwen-VL Energon path cannot read video files and skips such a sample",
    no_context_parallel="Megatron-Bridge's Qwen2.5-VL model does not split sequences across context-parallel ranks "
                        "(its recipes use CP 1)"))
# NeMo-RL's Qwen2.5-VL path (generic_sft + hf_multimodal): whole assistant messages are targets; an over-long sample
# becomes a stub with loss weight 0, which trains on nothing (dropped here).
register_convention(NemoRLChat("nemo-rl-qwen-vl", target_newline_after_eot=True, overlong="drop", rgb_decode=True))
# NeMo-RL's Nemotron Omni recipe sets ``thinking_trace_format: ultra``: the preset's default (``normalized`` when
# given).
register_convention(NemoRLNemotron(NEMO_RL_NEMOTRON, family=NEMOTRON_FAMILY, rgb_decode=True,
                                   thinking_trace_format="ultra", options=("thinking_trace_format",)))
# Megatron-Bridge's Nemotron Omni Energon path: packtool.families.nemotron_omni.mbridge registers it.
