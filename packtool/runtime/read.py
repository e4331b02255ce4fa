"""Read packed shards at training time: one pack record -> one Megatron-ready micro-batch row.

The core is `pack_to_batch`, a pure function from a record's raw members to tensors; `read_packs` walks a split
in on-disk order; loaders (`packtool.runtime.loader`) reuse the same function. What differs by model family (its
processors, media tensors, rope) lives in the family's package (`packtool.families.qwen2_vl.reader`,
`packtool.families.nemotron_omni.reader`, ...); this module asks the family's reader for it
(`packtool.families.reading.FamilyReader`: `read_media`, `processor`, `batch_keys`) and finds the reader through
`packtool.runtime.registry`.

Boundary conventions (all offsets are token indices into the row):

* Segment `i` holds its real tokens at `[cu_seqlens_padded[i], cu_seqlens_padded[i] + seqlen_i)`, followed by
  its alignment padding up to `cu_seqlens_padded[i + 1]`. `cu_seqlens_unpadded` counts real tokens only.
* No key is called plain `cu_seqlens`: Megatron-Bridge reads a batch key of that name as the PADDED boundaries
  (its legacy format), so either meaning would be misread by some consumer. The two names used here mean the same
  in Megatron-Bridge (`cu_seqlens_unpadded`: real) and Megatron-Core (`cu_seqlens_padded`: physical). For a batch
  Megatron-Bridge's training steps consume directly, see `packtool.runtime.megatron_batch.megatron_bridge_batch`.
* `pad_to="pack"` makes every row the same length `L = pack_size` rounded down to a multiple of `align` (equal to
  `pack_size` whenever it is a multiple, the normal case). The tail padding is absorbed into the LAST segment:
  `cu_seqlens_padded[-1] == L`, so both arrays keep `S + 1` entries (the segment keys line up with them), every
  boundary stays divisible by `align`, and the padded boundaries cover the whole row as Transformer Engine's THD
  kernels expect. This is safe for any attention that uses only the padded boundaries too: padding follows the
  real tokens and attention is causal, so real tokens never see it; its labels are -100.
  `pad_to="segments"` stops at the last segment's aligned end (variable row length).
* `position_ids` restart at 0 for each segment and keep counting through its padding (the tail included).
* `max_seqlen` is the largest padded segment, i.e. `max(diff(cu_seqlens_padded))`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packtool.errors import FormatError
from packtool.format import (
    TOKENIZER_DIR,
    PackRecord,
    aligned_lengths,
    arrays_digest,
    load_manifest,
    row_length,
    sha256,
    span_problems,
    split_shard_paths,
)
from packtool.lossweights import check_loss_mode, token_scale
from packtool.mediapart import MediaPart
from packtool.readkit import LOSS_MODE, ROW_FIELDS, WHOLE_WEIGHTS, ReaderBatch, layout_context
from packtool.runtime.registry import FamilyReader, reader_of
from packtool.shards import iter_records
from packtool.storage import local_copy, location

IGNORE_INDEX = -100
PAD_TO = ("pack", "segments")
#: Batch fields shaped `[1, L]` (one value per token of the row).
ROW_KEYS = ROW_FIELDS
__all__ = ["IGNORE_INDEX", "LOSS_MODE", "PAD_TO", "ROW_KEYS", "WHOLE_WEIGHTS", "ReaderBatch", "batch_to",
           "open_pack", "pack_to_batch", "processor_for_output", "read_packs"]


def whole_weights(manifest: Mapping) -> bool:
    """Whether every loss weight of the output is a whole number (True where the manifest records none)."""
    summary = manifest.get("loss_weights") if hasattr(manifest, "get") else None
    return bool(summary.get("whole", True)) if isinstance(summary, Mapping) else True


def image_processor_from_manifest(manifest: Mapping):
    """The image processor the manifest's family gives the reader without the model folder (Qwen2-VL's,
    `packtool.families.qwen2_vl.reader.qwen_image_processor`, on the backend ``AutoProcessor`` picks: torchvision
    when it is installed, else PIL; the two resize differently, so the pixels are always the model
    processor's); None for a text-only dataset, a fixed-count one, whose model's own processor the caller must
    pass, a Nemotron Omni one (see `processor_for_output`) or a processor-mode one."""
    return reader_of(manifest).processor(None)


def check_digests(where: str, record: PackRecord, members: Mapping[str, Any]) -> None:
    """The SHA-256 digests the pack carries, against its bytes: the token arrays' (``arrays_sha256``) and each
    media item's (with its size). A pack whose bytes changed after it was written (a flipped bit on disk, a
    member swapped) is refused, naming what changed, before any of it reaches a batch. A few milliseconds per
    pack of several MB of media: hashing is far cheaper than decoding."""
    if record.arrays_sha256 and arrays_digest(members) != record.arrays_sha256:
        raise FormatError(f"{where}: the token arrays differ from the SHA-256 written with the pack (corrupt)")
    for ref in record.media_refs:
        if not (ref.size or ref.sha256):  # records written before format 2 carry none
            continue
        data = b"".join(record.media[n] for n in ref.members)
        if len(data) != ref.size or sha256(data) != ref.sha256:
            raise FormatError(f"{where}, member {ref.member}: its bytes differ from the size and SHA-256 written "
                              f"with the pack (corrupt)")


def open_pack(members: Mapping, source: str | None = None) -> tuple[PackRecord, str]:
    """The pack record of one tar sample's members, its digests checked, and the place its errors name."""
    pack_key = str(members.get("__key__", "?"))
    where = f"{source}: pack {pack_key}" if source else f"pack {pack_key}"
    try:
        record = PackRecord.from_members(pack_key, members)
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}" if source else str(exc)) from None
    check_digests(where, record, members)
    return record, where


def pack_to_batch(
    members: Mapping[str, Any],
    manifest: Mapping,
    *,
    pad_to: str = "pack",
    images: bool = True,
    image_processor=None,
    source: str = "",
    loss_mode: str = "token",
    reader: FamilyReader | None = None,
) -> ReaderBatch:
    """One pack record -> one micro-batch row (a :class:`~packtool.readkit.ReaderBatch`: typed fields, read by
    attribute or by key).

    Args:
        members: part name -> bytes (`tokens.npy`, `targets.npy`, `seqlens.npy`, `json`, `m0.jpg`, ...); keys
            starting with `__` are ignored except `__key__`, which becomes `pack_key`.
        manifest: the dataset's `packtool.json` (pad id, image token id, image processor settings).
        pad_to: "pack" (fixed row length, see module docstring) or "segments" (stop after the last segment).
        images: decode media into `pixel_values`; when False, only `image_grid_thw` (stored grids) is returned.
        image_processor: a Hugging Face image processor to use instead of the one the manifest describes
            (required for media of fixed-count datasets, whose model processor the manifest cannot name).
        source: where the record came from (shard path), named in errors.
        loss_mode: how each target token weighs in the step (:mod:`packtool.lossweights`): "token" (each target
            token its sample's weight), "sample" (each sample's targets sum to its weight), "square".
        reader: the manifest's family reader (:func:`packtool.runtime.registry.reader_of` of ``manifest``), given by
            a loop over one output's packs so that it is built once; None: built from ``manifest`` here.

    Returns: tokens, labels, loss_mask, loss_weights (float32, the weight of each label position under `loss_mode`,
    0 where the label is -100), position_ids, padding_mask (`[1, L]`), loss_weight_sum (float64 `[1]`: the row's
    weights summed, what a trainer adds up over the global batch to divide by), num_samples (int64 `[1]`),
    loss_mode (str), cu_seqlens_unpadded,
    cu_seqlens_padded (int32 `[S + 1]`), max_seqlen (int), image_grid_thw (int64 `[n, 3]`, when the dataset has an
    image processor or the pack has media), pixel_values (when also `images`: float32 `[Σpatches, C·t·p·p]` for
    Qwen2-VL, else what the given processor returns), keys (segment source keys), pack_key, and for a mixture's
    pack dataset_index (int64 `[S]`, see :func:`dataset_index`), whole_weights (bool: every weight of the output a
    whole number), family (the registered family whose
    trainer layouts the batch follows, :meth:`FamilyReader.batch_family`: what the layouts read, never the keys) and
    layout_context (the manifest's media token ids and merge size, :func:`packtool.readkit.layout_context`: what
    the layouts need beside the tensors, so the batch alone is enough).
    """
    if pad_to not in PAD_TO:
        raise ValueError(f"pad_to must be one of {PAD_TO}, got {pad_to!r}")
    check_loss_mode(loss_mode)
    record, where = open_pack(members, source)
    tokens, targets = record.tokens, record.targets
    seqlens = record.seqlens.astype(np.int64)
    segments = record.segments
    align, pack_size = record.align, record.pack_size
    cu = np.concatenate([[0], np.cumsum(seqlens)])
    padded = aligned_lengths(seqlens, align)
    cu_padded = np.concatenate([[0], np.cumsum(padded)])
    if pad_to == "pack":
        length = row_length(pack_size, align)
        if cu_padded[-1] > length:
            raise FormatError(f"{where}: aligned length {cu_padded[-1]} exceeds pack size {pack_size}")
        cu_padded[-1] = length  # tail padding absorbed into the last segment
    length = int(cu_padded[-1])

    # Destination of each real token: its segment's padded start + its offset inside the segment.
    seg_of = np.repeat(np.arange(len(seqlens)), seqlens)
    dest = np.arange(len(tokens)) - cu[seg_of] + cu_padded[seg_of]

    row_tokens = np.full(length, manifest["pad_token_id"], dtype=np.int64)
    row_tokens[dest] = tokens
    # Token j predicts token j + 1 when j + 1 is in the same segment and is a target.
    predicts = np.zeros(len(tokens), dtype=bool)
    predicts[:-1] = targets[1:].astype(bool)
    predicts[cu[1:] - 1] = False
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    predictors = np.flatnonzero(predicts)
    labels[dest[predictors]] = tokens[predictors + 1]
    padding_mask = np.ones(length, dtype=bool)
    padding_mask[dest] = False
    padded_lengths = np.diff(cu_padded)
    position_ids = np.arange(length) - np.repeat(cu_padded[:-1], padded_lengths)
    counts = np.bincount(seg_of[predictors], minlength=len(seqlens))
    scale = token_scale(np.array([s.loss_weight for s in segments], np.float64), counts, loss_mode)
    weights = np.zeros(length, dtype=np.float32)
    weights[dest[predictors]] = scale[seg_of[predictors]]

    reader = reader if reader is not None else reader_of(manifest)
    return ReaderBatch(
        tokens=torch.from_numpy(row_tokens)[None],
        labels=torch.from_numpy(labels)[None],
        loss_mask=torch.from_numpy(labels != IGNORE_INDEX).float()[None],
        loss_weights=torch.from_numpy(weights)[None],
        position_ids=torch.from_numpy(position_ids)[None],
        cu_seqlens_unpadded=torch.from_numpy(cu.astype(np.int32)),
        cu_seqlens_padded=torch.from_numpy(cu_padded.astype(np.int32)),
        max_seqlen=int(padded_lengths.max()),
        padding_mask=torch.from_numpy(padding_mask)[None],
        segment_keys=[s.key for s in segments],
        pack_key=record.key,
        loss_weight_sum=torch.tensor([float((scale * counts).sum())], dtype=torch.float64),
        num_samples=torch.tensor([len(segments)], dtype=torch.int64),
        loss_mode=loss_mode,
        whole_weights=whole_weights(manifest),
        family=reader.batch_family(),
        layout_context=layout_context(manifest),
        dataset_index=dataset_index(record, manifest, where),
        media=_media(record, reader, cu, where, images, image_processor),
    )


def dataset_index(record: PackRecord, manifest: Mapping, where: str = "") -> torch.Tensor | None:
    """A mixture's pack: int64 ``[S]``, each segment's dataset as its place in the manifest's
    ``mixture["datasets"]`` (per-dataset loss: scatter the per-segment loss by it); None for one dataset."""
    if not any(s.dataset is not None for s in record.segments):
        return None
    mixture = manifest.get("mixture") if hasattr(manifest, "get") else None
    names = (mixture or {}).get("datasets") or []
    index = {n: i for i, n in enumerate(names)}
    unknown = [s.dataset for s in record.segments if s.dataset not in index]
    if unknown:
        raise FormatError(f"{where or record.key}: segment dataset {unknown[0]!r} is not in the manifest's mixture "
                          f"({', '.join(names) or 'none'})")
    return torch.tensor([index[s.dataset] for s in record.segments], dtype=torch.int64)


def _check_spans(record: PackRecord, reader: FamilyReader, cu: np.ndarray, where: str) -> None:
    """Each media item's placeholders must lie where the record says (see :func:`span_problems`)."""
    ids = reader.family.placeholder_ids()
    for seg, start, end in zip(record.segments, cu[:-1], cu[1:]):
        problems = span_problems(seg.key, record.tokens[start:end], seg.media, ids)
        if problems:
            raise FormatError(f"{where}: {problems[0]}")


def _media(record: PackRecord, reader: FamilyReader, cu: np.ndarray, where: str, images: bool,
           image_processor) -> MediaPart:
    """The media part of the manifest's family (its reader's :attr:`~FamilyReader.media_part` of what its
    :meth:`~FamilyReader.read_media` gives), after checking each media span in the tokens; an empty part for a pack
    without media of a family whose batches carry none."""
    if not record.media_refs and not reader.batch_keys:
        return reader.media_part()
    _check_spans(record, reader, cu, where)
    return reader.media_part.of(reader.read_media(record, image_processor, where, images))


def processor_for_output(path: str | Path, manifest: Mapping):
    """The processor a reader of the packed dataset at `path` uses for its media: its family's
    (:meth:`FamilyReader.processor`: Qwen2-VL's image processor, Nemotron Omni's processors or the processor
    mode's model processor, built from the model folder copied into the output), or None."""
    reader = reader_of(manifest)
    return reader.processor(local_copy(location(path) / TOKENIZER_DIR) if reader.reads_folder else None)


def batch_to(batch: Mapping[str, Any], device) -> Any:
    """Move every tensor of a batch to `device` (non-tensors unchanged): a reader batch stays one, any other
    mapping becomes a dict."""
    if isinstance(batch, ReaderBatch):
        return batch.to(device)
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def read_packs(
    path: str | Path,
    split: str = "train",
    *,
    pad_to: str = "pack",
    images: bool = True,
    device=None,
    image_processor=None,
    loss_mode: str = "token",
) -> Iterator[ReaderBatch]:
    """Batches of a packed dataset's split, one per pack, in on-disk order (deterministic). See `pack_to_batch`
    (``loss_mode``: how each target token weighs in the step)."""
    check_loss_mode(loss_mode)
    manifest = load_manifest(path)
    processor = image_processor
    if processor is None and images:
        processor = processor_for_output(path, manifest)
    reader = reader_of(manifest)
    for shard in split_shard_paths(path, split):
        for key, members in iter_records(shard):
            batch = pack_to_batch({**members, "__key__": key}, manifest, pad_to=pad_to, images=images,
                                  image_processor=processor, source=str(shard), loss_mode=loss_mode, reader=reader)
            yield batch if device is None else batch.to(device)


