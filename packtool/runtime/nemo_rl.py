"""NeMo-RL reads packtool's packs: its packed SFT batch from pack records, and a task encoder it loads by file.

NeMo-RL's Energon SFT path (``nemo_rl/data/energon/``) packs online: its task encoder selects samples per loader
buffer and ``prepare_packed_sft_batch`` (``multimodal/packing.py``) turns each pack into one batch row. Here the packs
come from packtool, packed offline and globally, and :class:`PacktoolSFTTaskEncoder` yields the same batch:

* ``input_ids`` int64 ``[B, L]``: each pack's samples one after another, each padded with the pad id to a multiple of
  the recipe's ``make_sequence_length_divisible_by`` (cp·2·tp; the pack's alignment, or the ``sequence_multiple``
  option when the pack's alignment is a multiple of it); rows padded with the pad id to the longest row of the batch;
* ``input_lengths`` int32 ``[B]``: each row's length with its samples' padding (not the batch padding);
* ``token_mask`` float32 ``[B, L]``: 1 on each target token (the token a position predicts is the next one), never on
  the first token of a sample nor on padding; under the encoder's ``loss_mode`` option (``sample``, ``square``, or
  sample weights given) each target token's loss weight instead (:mod:`packtool.lossweights`). NeMo-RL's
  ``NLLLoss`` multiplies each token's log-probability by ``token_mask`` and divides by ``global_valid_toks``, the
  sum of ``token_mask`` over the global batch (all micro-batches, all data-parallel ranks): the step is then the
  same samples' unpacked weighted mean under that mode;
* ``sample_mask`` float32 ``[B]``: 1 where the row has a target (of weight above 0);
* ``cu_seqlens`` / ``cu_seqlens_padded``: per pack, int32 ``[S + 1]`` cumulative sums of the real and of the padded
  sample lengths (NeMo-RL's ``PackedTensor`` of them when NeMo-RL is importable, else a list);
* ``source_ids``: per pack, the source keys of its samples;
* ``mm_token_type_ids`` int64 ``[B, L]`` (Qwen2-VL / Qwen2.5-VL packs, whose transformers processor gives it): per
  token 0 text, 1 image, 2 video; 0 on padding;
* media, per pack in placeholder order (NeMo-RL's ``PackedTensor``; without NeMo-RL, per row the list of its
  segments, ``None`` for a row without): Qwen2-VL / Qwen2.5-VL packs give the transformers processor's
  ``pixel_values``, ``image_grid_thw`` (and ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``),
  what NeMo-RL's ``hf_multimodal`` adapter puts in its messages, one segment per pack; Nemotron Omni packs give
  NeMo-RL's ``nemotron_multimodal`` inputs, one segment per image or video: ``pixel_values`` float32
  ``[frames, 3, H, W]`` (the image, or the video frames Energon's ``AVDecoder.get_clips`` decodes at the seconds
  NeMo-RL's frame rule takes, resized with PIL to the stored patch grid, CLIP mean/std), ``imgs_sizes`` int32
  ``[frames, 2]`` (height, width in pixels) and ``num_frames`` int64 ``[1]``; one segment per audio item:
  ``sound_clips`` float32 ``[clips, mel frames, bins]`` (NeMo-RL's 30 s clips, each through the model folder's
  feature extractor, zero-padded to the item's longest) and ``sound_length`` int64 ``[clips]`` (valid mel frames).

The runtime side only: this module imports nothing from packtool's build side, so it runs in a training container
with packtool's reader installed. NeMo-RL names it in its loader configuration as a file-backed task encoder
(``data.energon.task_encoder: {python_file: <this file>, object_name: PacktoolSFTTaskEncoder}``, and the cooker
``cook_packtool_pack`` of the same file); ``examples/nemo_rl/`` holds overlays for its two packing recipes.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, stateless
from megatron.energon.edataclass import edataclass
from megatron.energon.errors import FatalSampleError

from packtool.errors import FormatError
from packtool.format import Manifest, PackRecord
from packtool.lossweights import check_loss_mode, token_scale
from packtool.readkit import mm_token_type_ids
from packtool.runtime.loader import PackSample, _manifest, _reader_processor, cook_pack
from packtool.runtime.read import open_pack, pack_to_batch
from packtool.runtime.registry import Family, FamilyReader, family_class_of, reader_of, registered, spec_of

#: Options of NeMo-RL's own SFT encoders (``nemotron_multimodal``'s keyword arguments) that a recipe may pass. Each
#: is honoured or refused in one line, never accepted and ignored:
#:
#: * :data:`PACKED_RECIPE_OPTIONS` are compared with what the packs were made with (the manifest) when a pack is
#:   read, and a mismatch is refused (``prompt_format`` and ``thinking_trace_format`` as well);
#: * :data:`FIXED_RECIPE_OPTIONS` decide tokens or media at packing time by rules packtool fixed (NeMo-RL's
#:   defaults): any other value is refused when the encoder is built, as are the augmentations of
#:   :data:`OFF_RECIPE_OPTIONS` when on (packs are made once, deterministically) and ``loss_mask_mode`` (the packs
#:   carry their targets). ``None`` means unset and is accepted everywhere.
#:
#: recipe option -> manifest field it must equal (``settings.`` or the Nemotron Omni processor settings)
PACKED_RECIPE_OPTIONS: dict[str, str] = {
    "packing_sequence_length": "settings.pack_size", "patch_dim": "patch_size",
    "temporal_patch_size": "video_temporal_patch_dim", "audio_subsampling_factor": "audio_subsampling_factor",
    "audio_num_mel_bins": "feature_size"}
#: recipe option -> the only value packtool's NeMo-RL rules (``packtool.families.nemo_rl_rules``) pack with.
FIXED_RECIPE_OPTIONS: dict[str, Any] = {
    "video_min_num_frames": 8, "video_max_num_frames": 32, "video_default_fps": 2, "allow_large_videos": False,
    "audio_clip_duration_seconds": 30.0, "min_audio_duration_seconds": 0.1, "max_audio_duration_seconds": 1800.0,
    "relax_thinking_trace_check": False}
#: augmentations and loader-side decoding: refused unless off (false, 0 or unset).
OFF_RECIPE_OPTIONS = frozenset({
    "video_frame_temporal_jitter", "video_aug_scale_frames_up", "video_aug_scale_resolution_up",
    "video_aug_scale_resolution_only", "tiling_augment_prob", "video_decode_thread_count", "loss_mask_mode"})
RECIPE_OPTIONS = frozenset({*PACKED_RECIPE_OPTIONS, *FIXED_RECIPE_OPTIONS, *OFF_RECIPE_OPTIONS,
                            "prompt_format", "thinking_trace_format"})


def check_fixed_recipe_options(options: Mapping[str, Any]) -> None:
    """Refuse, in one line, a recipe option that packtool's packs fixed to another value
    (:data:`FIXED_RECIPE_OPTIONS`, :data:`OFF_RECIPE_OPTIONS`)."""
    for name, fixed in FIXED_RECIPE_OPTIONS.items():
        value = options.get(name)
        if value is not None and value != fixed:
            raise ValueError(f"the recipe sets {name} {value!r}: the packs already fixed it at {fixed!r} (NeMo-RL's "
                             f"default, applied by packtool at packing time): remove it or set it to {fixed!r}")
    for name in sorted(OFF_RECIPE_OPTIONS):
        value = options.get(name)
        if value is not None and value not in (False, 0):
            why = ("the packs carry their targets (set by --preset at packing time)" if name == "loss_mask_mode"
                   else "the packs' media were chosen once at packing time" if name != "video_decode_thread_count"
                   else "packtool's reader decodes the packs' videos itself")
            raise ValueError(f"the recipe sets {name} {value!r}: {why}; remove it")


def check_packed_recipe_options(manifest: Mapping, options: Mapping[str, Any], processors: Any = None) -> None:
    """Refuse a recipe option of :data:`PACKED_RECIPE_OPTIONS` that differs from what the packs were made with
    (``audio_num_mel_bins``: the model folder's feature extractor, checked when the media are read)."""
    given = {k: options[k] for k in PACKED_RECIPE_OPTIONS if options.get(k) is not None}
    if not given:
        return
    for name, value in given.items():
        if PACKED_RECIPE_OPTIONS[name] != "settings.pack_size":
            continue
        packed = manifest.get("settings", {}).get("pack_size")
        if value != packed:
            raise FormatError(f"the recipe sets {name} {value!r}, the packs were made with {packed!r} "
                              f"(settings.pack_size): pack again with the recipe's setting, or set {name} to "
                              f"{packed!r}")
    options = {name: value for name, value in given.items() if PACKED_RECIPE_OPTIONS[name] != "settings.pack_size"}
    if options:  # Nemotron Omni's processor settings, which the packs' family compares
        owner = family_class_of(manifest)
        kind = "text" if owner is Family or owner.name == "none" else owner.name
        try:  # the processor mode is no registered family: its packs take no such option either
            check = spec_of(kind).layouts.function("nemo_rl_recipe")
        except ValueError:
            check = None
        if check is None:  # the packs' family has no such options
            name, value = next(iter(options.items()))
            raise FormatError(f"the recipe sets {name} {value!r}, a Nemotron Omni option, but the packs were made "
                              f"for a {kind} model folder: remove it")
        check(manifest, options, PACKED_RECIPE_OPTIONS, processors)


def prompt_formats() -> frozenset[str]:
    """The NeMo-RL ``prompt_format`` values some registered family's packs are laid out in
    (``TrainerLayouts.nemo_rl_prompt_formats``)."""
    return frozenset(f for spec in registered().values() for f in spec.layouts.nemo_rl_prompt_formats)


def check_thinking_trace_format(manifest: Mapping, recipe_value: str | None) -> None:
    """Refuse a recipe's ``thinking_trace_format`` other than the one the packs' replies were rendered with (the
    packs' family's ``TrainerLayouts.nemo_rl_prompt`` check; a family without one renders no traces)."""
    if recipe_value is None:
        return
    owner = family_class_of(manifest)
    check = spec_of(owner.name).layouts.function("nemo_rl_prompt") if owner is not Family else None
    if check is None:
        raise FormatError(f"the recipe sets thinking_trace_format {recipe_value!r}, but the packs were made "
                          f"without --preset of a NeMo-RL convention that renders the traces")
    check(manifest, recipe_value)


@dataclass(frozen=True)
class NemoRLRow:
    """One pack laid out as a row of NeMo-RL's packed SFT batch (before the batch pads rows to one length)."""

    input_ids: torch.Tensor  # int64 [L]
    token_mask: torch.Tensor  # float32 [L]
    lengths: list[int]  # real length of each sample
    padded: list[int]  # each sample's length padded to the multiple
    keys: list[str]  # source key of each sample
    pack_key: str
    #: media key -> its segments in placeholder order: one tensor per item (Nemotron Omni) or per pack (Qwen).
    media: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: Nemotron Omni: pixels per patch side, for NeMo-RL's patchify mode; None otherwise.
    patch_dim: int | None = None
    #: Qwen2-VL / Qwen2.5-VL packs: the processor's ``mm_token_type_ids`` of ``input_ids`` (int64 [L]); else None.
    token_types: torch.Tensor | None = None


def nemo_rl_row(members: Mapping[str, Any], manifest: Mapping, *, multiple: int | None = None, images: bool = True,
                image_processor=None, source: str = "", loss_mode: str = "token") -> NemoRLRow:
    """One pack record (``{part: bytes, "__key__": key}``) as a row of NeMo-RL's packed batch.

    ``multiple``: pad each sample to this multiple (NeMo-RL's ``make_sequence_length_divisible_by``); default the
    pack's alignment. The pack's alignment must be a multiple of it, so the row still fits the pack size.
    ``images=False`` leaves the media out; ``image_processor`` as in :func:`packtool.runtime.read.pack_to_batch`.
    ``loss_mode``: ``token_mask`` holds each target token's weight under it (the target mask under ``token``
    without sample weights).
    """
    check_loss_mode(loss_mode)
    record, where = open_pack(members, source)
    step = record.align if multiple is None else multiple
    if step < 1 or record.align % step:
        raise FormatError(f"{where}: packed with alignment {record.align}, which is not a multiple of "
                          f"{step} (NeMo-RL's make_sequence_length_divisible_by = cp·2·tp): pack again with "
                          f"`packtool pack --align-for nemo-rl --tp-size TP --cp-size CP`")
    lengths = record.seqlens.astype(np.int64)
    padded = -(-lengths // step) * step
    starts = np.concatenate([[0], np.cumsum(lengths)])
    row_starts = np.concatenate([[0], np.cumsum(padded)])
    seg_of = np.repeat(np.arange(len(lengths)), lengths)
    dest = np.arange(len(record.tokens)) - starts[seg_of] + row_starts[seg_of]
    ids = np.full(int(row_starts[-1]), manifest["pad_token_id"], dtype=np.int64)
    ids[dest] = record.tokens
    mask = np.zeros(len(ids), dtype=np.float32)
    mask[dest] = record.targets
    mask[row_starts[:-1]] = 0.0  # prepare_packed_sft_batch: a sample's first token is never a target
    weights = np.array([s.loss_weight for s in record.segments], np.float64)
    if loss_mode != "token" or (weights != 1.0).any():
        row_seg = np.repeat(np.arange(len(lengths)), padded)
        counts = np.bincount(row_seg, weights=mask, minlength=len(lengths))
        mask = (mask * token_scale(weights, counts, loss_mode)[row_seg]).astype(np.float32)
    reader = reader_of(manifest)
    media = _media(members, record, manifest, reader, where, images, image_processor, source)
    input_ids = torch.from_numpy(ids)
    layouts = spec_of(reader.batch_family()).layouts
    token_types = mm_token_type_ids(input_ids, manifest).long() if layouts.nemo_rl_token_types else None
    patch_dim = layouts.function("nemo_rl_patch_dim")
    return NemoRLRow(input_ids, torch.from_numpy(mask), lengths.tolist(), padded.tolist(),
                     [s.key for s in record.segments], record.key, media,
                     patch_dim(reader) if patch_dim is not None else None, token_types)


def _media(members: Mapping[str, Any], record: PackRecord, manifest: Mapping, reader: FamilyReader, where: str,
           images: bool, image_processor, source: str) -> dict[str, list[torch.Tensor]]:
    """The family's NeMo-RL media inputs (its registered ``TrainerLayouts.nemo_rl_media``), else the reader's media
    fields (the family's reader's :attr:`~packtool.families.reading.FamilyReader.batch_keys`, the transformers
    processor's names that NeMo-RL's ``hf_multimodal`` adapter carries), one tensor per pack."""
    if not images or not record.media_refs:
        return {}
    own = spec_of(reader.batch_family()).layouts.function("nemo_rl_media")
    if own is not None:
        return own(reader, record, image_processor, where)
    batch = pack_to_batch(members, manifest, pad_to="segments", images=True, image_processor=image_processor,
                          source=source)
    return {key: [batch[key]] for key in reader.batch_keys if _present(batch.get(key))}


def _present(value: Any) -> bool:
    """A media field the pack has: not missing, not an empty tensor (no empty video keys in an image-only pack)."""
    return value is not None and (not isinstance(value, torch.Tensor) or value.numel() > 0)


def _packed_media(rows: Sequence[list[torch.Tensor] | None], key: str, patch_dim: int | None):
    """One media key of the batch: per row, its segments (a tensor per media item, or one per pack).

    With NeMo-RL importable this is NeMo-RL's ``PackedTensor`` built as its packed batch builds it (each row's
    segments merged with ``merge_segments``, the rows joined with ``flattened_concat``; Nemotron pixels in its
    ``patchify`` mode where its ``PackedTensor`` has one); without, the per-row lists themselves.
    """
    try:
        from nemo_rl.data.multimodal_utils import PackedTensor
    except ImportError:
        return list(rows)
    kwargs: dict[str, Any] = {}
    params = inspect.signature(PackedTensor.__init__).parameters
    if key == "sound_clips":
        kwargs["pad_to_max_shape"] = True
    if key == "pixel_values" and patch_dim is not None and "preprocess_mode" in params:
        kwargs.update(preprocess_mode="patchify", preprocess_kwargs={"patch_dim": patch_dim})
    packed = [None if segs is None else PackedTensor.merge_segments([PackedTensor(t, dim_to_pack=0, **kwargs)
                                                                      for t in segs]) for segs in rows]
    template = next(p for p in packed if p is not None)
    return PackedTensor.flattened_concat([p if p is not None else PackedTensor.empty_rows_like(template, 1)
                                          for p in packed])


def _boundaries(values: list[torch.Tensor]):
    """Per-pack boundaries as ``prepare_packed_sft_batch`` carries them: ``PackedTensor(values, dim_to_pack=0)``
    with NeMo-RL importable, else the list."""
    try:
        from nemo_rl.data.multimodal_utils import PackedTensor
    except ImportError:
        return values
    return PackedTensor(values, dim_to_pack=0)


#: How NeMo-RL's ``prepare_packed_sft_batch`` lays a pack out: ``capacity`` (NeMo-RL's current ``generic_sft``, with
#: ``loss_mask_mode``): the last sample's padding runs to the pack capacity, so every row is the capacity long and
#: each ``cu_seqlens_padded`` ends at it; ``samples`` (its earlier version): each sample padded to the multiple only.
PACK_LAYOUTS = ("capacity", "samples")


def nemo_rl_batch(rows: Sequence[NemoRLRow], pad_token_id: int, *, capacity: int | None = None) -> dict[str, Any]:
    """NeMo-RL's packed SFT batch of one pack per row (module docstring); with ``capacity`` each row's last sample
    is padded to it (the ``capacity`` layout of :data:`PACK_LAYOUTS`)."""
    if not rows:
        raise ValueError("a NeMo-RL batch needs at least one pack")
    if capacity is not None:
        rows = [_to_capacity(r, capacity, pad_token_id) for r in rows]
    length = max(len(r.input_ids) for r in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.int64)
    token_mask = torch.zeros((len(rows), length), dtype=torch.float32)
    for i, r in enumerate(rows):
        input_ids[i, :len(r.input_ids)] = r.input_ids
        token_mask[i, :len(r.token_mask)] = r.token_mask
    token_types = None
    if any(r.token_types is not None for r in rows):
        token_types = torch.zeros((len(rows), length), dtype=torch.int64)
        for i, r in enumerate(rows):
            if r.token_types is None:
                raise ValueError(f"pack {r.pack_key} has no mm_token_type_ids, the batch's other packs have")
            token_types[i, :len(r.token_types)] = r.token_types

    def cumulative(values: list[int]) -> torch.Tensor:
        return torch.tensor([0, *np.cumsum(values).tolist()], dtype=torch.int32)

    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "input_lengths": torch.tensor([len(r.input_ids) for r in rows], dtype=torch.int32),
        "token_mask": token_mask,
        "sample_mask": token_mask.bool().any(1).float(),
        "cu_seqlens": _boundaries([cumulative(r.lengths) for r in rows]),
        "cu_seqlens_padded": _boundaries([cumulative(r.padded) for r in rows]),
        "source_ids": [list(r.keys) for r in rows],
    }
    if token_types is not None:
        batch["mm_token_type_ids"] = token_types
    for key in sorted({k for r in rows for k in r.media}):
        batch[key] = _packed_media([r.media.get(key) for r in rows], key, rows[0].patch_dim)
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except ImportError:
        return batch
    return BatchedDataDict(batch)


def _to_capacity(row: NemoRLRow, capacity: int, pad_token_id: int) -> NemoRLRow:
    extra = capacity - len(row.input_ids)
    if extra < 0:
        raise FormatError(f"pack {row.pack_key} lays out {len(row.input_ids)} tokens, more than the capacity "
                          f"{capacity}")
    token_types = None if row.token_types is None else torch.cat([row.token_types,
                                                                  torch.zeros(extra, dtype=torch.int64)])
    return replace(row, input_ids=torch.cat([row.input_ids, torch.full((extra,), pad_token_id, dtype=torch.int64)]),
                   token_mask=torch.cat([row.token_mask, torch.zeros(extra, dtype=torch.float32)]),
                   token_types=token_types,
                   padded=[*row.padded[:-1], row.padded[-1] + extra])


# -- the task encoder NeMo-RL loads ------------------------------------------------------------------------------
def _base_encoder() -> type:
    """NeMo-RL's SFT task encoder base where NeMo-RL is installed (its registry accepts only its subclasses), else
    Energon's default task encoder (the same Energon interface)."""
    try:
        from nemo_rl.data.energon.multimodal.task_encoders.base import BaseSFTTaskEncoder
    except ImportError:
        return DefaultTaskEncoder
    return BaseSFTTaskEncoder


def _for_every_model_family(obj):
    """Declare support for every NeMo-RL model family (NeMo-RL's registry checks the declaration)."""
    try:
        from nemo_rl.data.energon.multimodal.model_families import ALL_MODEL_FAMILIES, supports_model_families
    except ImportError:
        return obj
    return supports_model_families(ALL_MODEL_FAMILIES)(obj)


@_for_every_model_family
@stateless
def cook_packtool_pack(sample: dict) -> PackSample:
    """The cooker to configure beside the task encoder (``has_subflavors: {packtool: 1}``): a pack's raw parts."""
    return cook_pack(sample)


@edataclass
class NemoRLPack(Sample):
    """One pack after :func:`nemo_rl_row`."""

    row: Any


_BaseEncoder: Any = _base_encoder()


@_for_every_model_family
class PacktoolSFTTaskEncoder(_BaseEncoder):
    """NeMo-RL's file-backed SFT task encoder for packtool outputs: one pack per batch row, the batch of
    ``prepare_packed_sft_batch`` (module docstring). NeMo-RL builds it with the keyword arguments of its own
    encoders; the loader's online packing must be off (no ``task_encoder.packing``: the packs are made).

    Options (``task_encoder.options``): ``sequence_multiple`` pads samples to this multiple instead of the pack's
    alignment (set it to the policy's ``make_sequence_length_divisible_by``; the pack's alignment must be a
    multiple of it); ``images`` (default true) decodes the media; ``pack_layout`` (:data:`PACK_LAYOUTS`, default
    ``capacity``: NeMo-RL's current batch, every row padded to the capacity, ``max_total_sequence_length``; ``samples``:
    its earlier one); ``loss_mode`` (``token``, default, ``sample`` or ``square``: what ``token_mask`` weighs, see
    the module docstring). The options of NeMo-RL's own encoders that a recipe may pass (:data:`RECIPE_OPTIONS`) are
    compared with the packs' settings or refused unless at the value the packs fixed; any other is an error.
    NeMo-RL's own keyword arguments: ``adapter`` gives ``max_sequence_length``; ``cooker_functions`` must be
    packtool's cooker (or none); ``sequence_length_pad_multiple`` (>1) is taken as ``sequence_multiple`` when that
    is not given, and must equal it when it is; ``tokenizer``'s pad id must be the packs'; ``packer`` and
    ``only_unmask_final`` are refused.
    """

    cookers = [Cooker(cook_packtool_pack, has_subflavors={"packtool": 1})]
    decoder = None  # raw bytes: the packs hold npy/json/original media
    #: NeMo-RL's packing hooks check a sample schema against the encoder's; packs are never packed again.
    sample_schema = "packtool_pack"

    def __init__(self, *, adapter: Any = None, cooker_functions: Sequence[Any] = (), include_source_ids: bool = True,
                 packer: Any = None, tokenizer: Any = None, sequence_length_pad_multiple: int = 1,
                 only_unmask_final: bool = False, sequence_multiple: int | None = None, images: bool = True,
                 pack_layout: str = "capacity", loss_mode: str = "token", **recipe_options: Any) -> None:
        if packer is not None or recipe_options.get("packing_hooks") is not None:
            raise ValueError("packtool packs are made offline: remove data.energon.task_encoder.packing")
        recipe_options.pop("packing_hooks", None)
        if _BaseEncoder is DefaultTaskEncoder:
            super().__init__()
        else:  # NeMo-RL's base: keyword-only cooker functions (and, in some versions, packing hooks)
            params = inspect.signature(_BaseEncoder.__init__).parameters
            base_kwargs: dict[str, Any] = {"cooker_functions": []} if "cooker_functions" in params else {}
            if "packing_hooks" in params:
                base_kwargs["packing_hooks"] = None
            super().__init__(**base_kwargs)
        self.cookers = list(type(self).cookers)  # packs are read by packtool's cooker, whatever else is configured
        if only_unmask_final:
            raise ValueError("packtool packs carry their targets: only_unmask_final cannot change them")
        unknown = sorted(set(recipe_options) - RECIPE_OPTIONS)
        if unknown:
            raise ValueError(f"unknown PacktoolSFTTaskEncoder options: {unknown}")
        check_fixed_recipe_options(recipe_options)
        self.recipe_options = {k: v for k, v in recipe_options.items() if k in PACKED_RECIPE_OPTIONS}
        for cooker in cooker_functions:
            cook = getattr(cooker, "cook", cooker)
            if getattr(cook, "__name__", None) != cook_packtool_pack.__name__:
                raise ValueError(f"cooker {getattr(cook, '__name__', cook)!r}: packtool packs are read by "
                                 f"cook_packtool_pack only (data.energon.cookers)")
        if sequence_length_pad_multiple < 1:
            raise ValueError(f"sequence_length_pad_multiple must be >= 1, got {sequence_length_pad_multiple}")
        if sequence_length_pad_multiple > 1:
            if sequence_multiple is None:
                sequence_multiple = sequence_length_pad_multiple
            elif sequence_multiple != sequence_length_pad_multiple:
                raise ValueError(f"sequence_length_pad_multiple {sequence_length_pad_multiple} and sequence_multiple "
                                 f"{sequence_multiple} differ: give one")
        prompt_format = recipe_options.get("prompt_format")
        if prompt_format is not None and prompt_format not in prompt_formats():
            raise ValueError(f"prompt_format {prompt_format!r}: packtool's packs are laid out in "
                             f"{', '.join(map(repr, sorted(prompt_formats())))}")
        self.thinking_trace_format: str | None = recipe_options.get("thinking_trace_format")
        if sequence_multiple is not None and sequence_multiple < 1:
            raise ValueError(f"sequence_multiple must be >= 1, got {sequence_multiple}")
        if pack_layout not in PACK_LAYOUTS:
            raise ValueError(f"pack_layout must be one of {list(PACK_LAYOUTS)}, got {pack_layout!r}")
        self.pack_layout, self.loss_mode = pack_layout, check_loss_mode(loss_mode)
        self.max_sequence_length = getattr(adapter, "max_sequence_length", None)
        self.include_source_ids, self.tokenizer = include_source_ids, tokenizer
        self.sequence_multiple, self.images = sequence_multiple, images

    # NeMo-RL's base declares the sample steps as pre-encode (before its optional online packing) and post-encode
    # (after it); Energon refuses an encoder that also overrides encode_sample. A pack is read in pre-encode; there
    # is nothing left to do after selection, as no online packing runs.
    @stateless
    def preencode_sample(self, sample: PackSample) -> NemoRLPack:
        info = sample.__sources__[0]
        manifest = _manifest(str(info.dataset_path))
        where = f"{info.dataset_path}/{info.shard_name}"
        try:
            check_thinking_trace_format(manifest, self.thinking_trace_format)
            processors = _reader_processor(str(info.dataset_path)) if self.images else None
            check_packed_recipe_options(manifest, self.recipe_options, processors)
            row = nemo_rl_row({**sample.members, "__key__": sample.__key__}, manifest,
                              multiple=self.sequence_multiple, images=self.images, image_processor=processors,
                              source=where, loss_mode=self.loss_mode)
            if self.max_sequence_length is not None and len(row.input_ids) > self.max_sequence_length:
                raise FormatError(f"{where}: pack {row.pack_key} lays out {len(row.input_ids)} tokens, more than "
                                  f"NeMo-RL's max_total_sequence_length {self.max_sequence_length}: pack with "
                                  f"--pack-size at most that")
        except Exception as exc:  # past Energon's error handler, which would log the pack and skip it
            message = str(exc) or type(exc).__name__
            raise FatalSampleError(f"packtool could not read a pack for NeMo-RL: {message}") from exc
        return NemoRLPack.derive_from(sample, row=row)

    @stateless
    def postencode_sample(self, sample: NemoRLPack) -> NemoRLPack:
        return sample

    @stateless
    def batch(self, samples: list[NemoRLPack]) -> Any:
        manifest: Manifest = _manifest(str(samples[0].__sources__[0].dataset_path))
        pad = manifest["pad_token_id"]
        tokenizer_pad = getattr(self.tokenizer, "pad_token_id", None)
        if self.tokenizer is not None and tokenizer_pad != pad:
            raise ValueError(f"the packs pad with token {pad}, NeMo-RL's tokenizer with {tokenizer_pad}: give NeMo-RL "
                             f"the model folder the packs were made with")
        capacity = None
        if self.pack_layout == "capacity":  # NeMo-RL's capacity: its max_total_sequence_length, else the pack size
            capacity = self.max_sequence_length or int(manifest["settings"]["pack_size"])
        batch = nemo_rl_batch([s.row for s in samples], pad, capacity=capacity)
        if not self.include_source_ids:
            del batch["source_ids"]
        return batch

    @stateless
    def encode_batch(self, batch: Any) -> Any:
        return batch


def encoder_file() -> str:
    """The absolute path NeMo-RL's ``task_encoder.python_file`` (and the cooker's) takes: this module's file."""
    return str(Path(__file__).resolve())


if __name__ == "__main__":  # `python -m packtool.runtime.nemo_rl` prints the path to configure
    print(encoder_file())
