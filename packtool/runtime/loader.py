"""Training-time loaders for packed datasets: a plain torch `IterableDataset` and Energon task encoders.

`PackDataset` and `PackTaskEncoder` yield the batches of `packtool.runtime.read.pack_to_batch` (one pack per row);
`MegatronBridgeTaskEncoder` yields the batch Megatron-Bridge's training steps consume
(`packtool.runtime.megatron_batch.megatron_bridge_batch`) and is the one to name in a Megatron-Bridge recipe. A
micro-batch of one pack is the normal THD setting; for `B > 1` packs, `collate_packs` stacks rows `[B, L]` (short
rows padded like the tail of a pack) and gives `cu_seqlens_*` for the flattened row `tokens.reshape(1, -1)`, so the
batch stays one valid THD row.

A pack that fails to read (a corrupt media member, a malformed record) stops the Energon loader with an error
naming the shard, the pack key and the member: Energon's default error handler would otherwise log it and skip
the pack. `on_error="skip"` skips such packs instead, each one logged with a running count.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NoReturn

import numpy as np
import torch
from megatron.energon import Cooker, DefaultTaskEncoder, Sample, SkipSample, basic_sample_keys, stateless
from megatron.energon.edataclass import edataclass
from megatron.energon.epathlib import EPath
from megatron.energon.errors import FatalSampleError

from packtool.format import (
    BATCH_CONTEXT,
    BATCH_FAMILY,
    MANIFEST,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    Manifest,
    load_manifest,
    split_shard_paths,
)
from packtool.lossweights import check_loss_mode
from packtool.mediapart import MediaPart
from packtool.readkit import ReaderBatch, pad_frames
from packtool.runtime.megatron_batch import megatron_bridge_batch
from packtool.runtime.read import (
    IGNORE_INDEX,
    LOSS_MODE,
    PAD_TO,
    ROW_KEYS,
    WHOLE_WEIGHTS,
    pack_to_batch,
    processor_for_output,
)
from packtool.runtime.registry import FamilyReader, reader_classes, reader_of
from packtool.shards import iter_records, record_offsets

log = logging.getLogger(__name__)
OnError = Literal["raise", "skip"]

def pad_row(row: Mapping[str, Any], length: int, pad_token_id: int) -> Any:
    """Extend a one-pack batch to `length` tokens; the extra padding joins the last segment (as the pack tail). A
    reader batch stays one."""
    extra = length - row["tokens"].shape[1]
    if extra < 0:
        raise ValueError(f"row of {row['tokens'].shape[1]} tokens is longer than {length}")
    if extra == 0:
        return row
    last = row["position_ids"][0, -1]
    fill = {"tokens": pad_token_id, "labels": IGNORE_INDEX, "loss_mask": 0.0, "loss_weights": 0.0,
            "padding_mask": True}
    out = dict(row)
    for key, value in fill.items():
        out[key] = torch.cat([row[key], row[key].new_full((1, extra), value)], dim=1)
    out["position_ids"] = torch.cat([row["position_ids"], last + 1 + torch.arange(extra)[None]], dim=1)
    out["cu_seqlens_padded"] = row["cu_seqlens_padded"].clone()
    out["cu_seqlens_padded"][-1] += extra
    out["max_seqlen"] = int(out["cu_seqlens_padded"].diff().max())
    return ReaderBatch.of(out, type(row.media)) if isinstance(row, ReaderBatch) else out


def collate_packs(rows: Sequence[Mapping[str, Any]], pad_token_id: int) -> Any:
    """Batch one-pack rows (:class:`~packtool.readkit.ReaderBatch`). One row is returned as is; several are
    stacked `[B, L]` (labels padded with -100, never 0) into one reader batch with `cu_seqlens_unpadded`,
    `cu_seqlens_padded`, `max_seqlen`, `keys` describing `tokens.reshape(1, -1)`; `pack_key` becomes a list, media
    tensors are concatenated in row order; `family` and `layout_context` are the rows' one value (rows given as
    plain dicts give a dict)."""
    if len(rows) == 1:
        return rows[0]
    typed = all(isinstance(r, ReaderBatch) for r in rows)
    length = max(r["tokens"].shape[1] for r in rows)
    rows = [pad_row(r, length, pad_token_id) for r in rows]
    out: dict[str, Any] = {key: torch.cat([r[key] for r in rows]) for key in ROW_KEYS}
    for key in ("cu_seqlens_unpadded", "cu_seqlens_padded"):
        lengths = torch.cat([r[key].diff() for r in rows])
        out[key] = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    out["max_seqlen"] = max(r["max_seqlen"] for r in rows)
    out["keys"] = [k for r in rows for k in r["keys"]]
    out["pack_key"] = [r["pack_key"] for r in rows]
    out["loss_weight_sum"] = torch.cat([r["loss_weight_sum"] for r in rows])
    out["num_samples"] = torch.cat([r["num_samples"] for r in rows])
    modes = {r[LOSS_MODE] for r in rows}
    if len(modes) > 1:
        raise ValueError(f"rows of different loss modes ({', '.join(sorted(modes))}) cannot share a batch")
    out[LOSS_MODE] = modes.pop()
    out[WHOLE_WEIGHTS] = all(r.get(WHOLE_WEIGHTS, True) for r in rows)
    kinds = {r.get(BATCH_FAMILY) for r in rows}
    if len(kinds) > 1:
        raise ValueError(f"rows of different families ({', '.join(sorted(map(str, kinds)))}) cannot share a batch")
    out[BATCH_FAMILY] = kinds.pop()
    contexts = [r[BATCH_CONTEXT] for r in rows if BATCH_CONTEXT in r]
    if contexts:
        if any(c != contexts[0] for c in contexts):
            raise ValueError("rows of outputs with other media token ids cannot share a batch")
        out[BATCH_CONTEXT] = contexts[0]
    if any("dataset_index" in r for r in rows):  # a mixture's: one per segment, in `keys` order
        out["dataset_index"] = torch.cat([r["dataset_index"] for r in rows])
    for key in stacked_media_keys():  # rows of a text-only dataset (blending) have none
        if any(key in r for r in rows):
            out[key] = torch.cat([r[key] for r in rows if key in r])
    for key in ("input_features", "input_features_mask"):  # audio clips: padded to the longest of the batch
        if any(key in r for r in rows):
            width = max(r[key].shape[1] for r in rows if key in r)
            out[key] = torch.cat([pad_frames(r[key], width) for r in rows if key in r])
    for key in ("media_kinds", "media_inputs"):  # one entry per media item: lists joined in row order
        if any(key in r for r in rows):
            out[key] = [k for r in rows for k in r.get(key, [])]
    return ReaderBatch.of(out, _media_part(rows)) if typed else out


def _media_part(rows: Sequence[Any]) -> type[MediaPart]:
    """The media part of reader rows stacked into one batch: the first row's with media fields (rows of one family;
    a text-only dataset's rows, blended in, have the empty base part)."""
    return next((type(r.media) for r in rows if type(r.media) is not MediaPart), MediaPart)


#: Media fields of reader rows that the batch builds otherwise: clips padded to the batch's longest, lists.
UNSTACKED_MEDIA_KEYS = frozenset({"input_features", "input_features_mask", "media_kinds", "media_inputs"})


@functools.cache
def stacked_media_keys() -> tuple[str, ...]:
    """Media tensors of reader rows that stack along their first dimension: every registered family's reader
    fields (:attr:`FamilyReader.batch_keys`, its convention variants' included), in registration order."""
    keys: dict[str, None] = {}
    for cls in reader_classes():
        keys.update(dict.fromkeys(k for k in cls.batch_keys if k not in UNSTACKED_MEDIA_KEYS))
    return tuple(keys)


class PackDataset(torch.utils.data.IterableDataset):
    """The packs of one split as batches, for a plain torch `DataLoader(dataset, batch_size=None)`.

    Order: all records of the split, permuted by `(seed, epoch)` when `shuffle` (call `set_epoch` before each
    epoch; a dataset packed with `--balance-dp` equal to `world_size` is permuted by whole groups), else on-disk
    order. Ranks take every `world_size`-th record after cutting the list to a multiple of
    `world_size` (every rank yields the same number of packs); DataLoader workers then take every
    `num_workers`-th of the rank's records, which the DataLoader's round-robin turns back into the rank's order.
    """

    def __init__(self, path, split: str = "train", *, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, pad_to: str = "pack", images: bool = True, image_processor=None,
                 loss_mode: str = "token"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.path, self.split, self.seed, self.shuffle = path, split, seed, shuffle
        self.rank, self.world_size, self.pad_to, self.images = rank, world_size, pad_to, images
        self.image_processor, self.loss_mode = image_processor, check_loss_mode(loss_mode)
        self.manifest = load_manifest(path)
        self.shards = split_shard_paths(path, split)
        counts = [len(record_offsets(s)) - 1 for s in self.shards]
        pairs = [(s, i) for s, n in enumerate(counts) for i in range(n)]
        self.records = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rank_records(self) -> np.ndarray:
        """`(shard index, record index)` rows this rank reads in the current epoch, in order."""
        order = np.arange(len(self.records))
        if self.shuffle:
            # Packs ordered with `--balance-dp N` for N == world_size move as whole groups, so each step still
            # gives every rank one pack of a compute-balanced group.
            group = self.world_size if self.manifest.settings.get("balance_dp") == self.world_size else 1
            groups = np.random.default_rng([self.seed, self.epoch]).permutation(len(order) // group)
            order = (groups[:, None] * group + np.arange(group)).reshape(-1)
        order = order[: len(order) // self.world_size * self.world_size]
        return self.records[order[self.rank::self.world_size]]

    def __len__(self) -> int:
        return len(self.records) // self.world_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = self.rank_records()
        if info is not None:
            mine = mine[info.id::info.num_workers]
        processor = self.image_processor
        if processor is None and self.images:
            processor = processor_for_output(self.path, self.manifest)
        reader = reader_of(self.manifest)
        for shard, index in mine:
            key, members = next(iter_records(self.shards[shard], iter([index])))
            yield pack_to_batch({**members, "__key__": key}, self.manifest, pad_to=self.pad_to, images=self.images,
                                image_processor=processor, source=str(self.shards[shard]), loss_mode=self.loss_mode,
                                reader=reader)


def _manifest(dataset_path: str) -> Manifest:
    """The manifest of a dataset Energon opened (its path may be remote: read through Energon's own paths). One
    that cannot be read stops the loader whatever ``on_error`` says (Energon's handler would skip every pack of
    the dataset, one by one, and a loader would yield nothing)."""
    try:
        return _read_manifest(dataset_path)
    except Exception as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FatalSampleError(f"packtool could not read the manifest {EPath(dataset_path) / MANIFEST}: "
                               f"{type(exc).__name__}: {message}") from exc


@functools.lru_cache(maxsize=16)
def _read_manifest(dataset_path: str) -> Manifest:
    path = EPath(dataset_path) / MANIFEST
    return Manifest.parse(json.loads(path.read_text()), str(path))


@functools.lru_cache(maxsize=16)
def _reader(dataset_path: str) -> FamilyReader:
    """The family reader of a dataset Energon opened, built once from its manifest (:func:`_manifest`)."""
    return reader_of(_manifest(dataset_path))


@functools.lru_cache(maxsize=16)
def _reader_processor(dataset_path: str):
    """The processor of a dataset Energon opened (its family's reader's, :meth:`FamilyReader.processor`); for a
    reader of the model folder, from the dataset's copy of it, a remote one's settings files copied to a local
    temporary folder first (transformers' processors read local files)."""
    reader = _reader(dataset_path)
    if not reader.reads_folder:
        return reader.processor(None)
    folder = EPath(dataset_path) / TOKENIZER_DIR
    if not folder.is_local():
        import tempfile

        local = EPath(tempfile.mkdtemp(prefix="packtool-model-"))
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                (folder / name).copy(local / name)
        folder = local
    return reader.processor(folder.local_path())


@edataclass
class PackSample(Sample):
    """A pack record as Energon delivers it: raw member bytes by part name."""

    members: dict


@edataclass
class PackRow(Sample):
    """One pack after `pack_to_batch`."""

    batch: ReaderBatch


@stateless
def cook_pack(sample: dict) -> PackSample:
    """Cooker for packtool datasets (subflavor `packtool: 1`): keep the raw parts, decode nothing yet."""
    members = {k: v for k, v in sample.items() if not k.startswith("__")}
    return PackSample(**basic_sample_keys(sample), members=members)


class PackTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder for packtool datasets: batches equal `read_packs`' (see `collate_packs` for B > 1).
    `pad_to`, `images`, `image_processor`, `loss_mode` as in `packtool.runtime.read.pack_to_batch`; `on_error`: a
    pack that fails to read stops the loader (`"raise"`, an Energon `FatalSampleError` carrying packtool's message)
    or is skipped with a logged warning and running count (`"skip"`; `skipped` counts them in this process).

    `get_train_dataset(OUTPUT, task_encoder=PackTaskEncoder(), batch_size=1, ...)`; works in metadatasets too
    (each sample finds its own dataset's manifest). Media are decoded in the loader workers. For Megatron-Bridge
    use `MegatronBridgeTaskEncoder`.
    """

    cookers = [Cooker(cook_pack, has_subflavors={"packtool": 1})]
    decoder = None  # raw bytes: the packs hold npy/json/original media, decoded by pack_to_batch

    def __init__(self, *, pad_to: str = "pack", images: bool = True, image_processor=None,
                 on_error: OnError = "raise", loss_mode: str = "token"):
        super().__init__()
        self.loss_mode = check_loss_mode(loss_mode)
        if pad_to not in PAD_TO:
            raise ValueError(f"pad_to must be one of {PAD_TO}, got {pad_to!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.pad_to, self.images, self.image_processor, self.on_error = pad_to, images, image_processor, on_error
        self.skipped = 0

    @stateless
    def encode_sample(self, sample: PackSample) -> PackRow:
        info = sample.__sources__[0]
        manifest = _manifest(str(info.dataset_path))
        where = f"{info.dataset_path}/{info.shard_name}"
        try:
            processor = self.image_processor
            if processor is None and self.images:
                processor = _reader_processor(str(info.dataset_path))
            batch = pack_to_batch({**sample.members, "__key__": sample.__key__}, manifest, pad_to=self.pad_to,
                                  images=self.images, image_processor=processor, source=where,
                                  loss_mode=self.loss_mode, reader=_reader(str(info.dataset_path)))
        except Exception as exc:
            self._failed(exc, where, sample.__key__)
        return PackRow.derive_from(sample, batch=batch)

    def _failed(self, exc: Exception, where: str, key: str) -> NoReturn:
        """Raise past Energon's error handler (it would skip the pack), or skip it visibly."""
        message = str(exc) or type(exc).__name__
        if key not in message:  # packtool's own errors name shard and pack already
            message = f"{where}: pack {key}: {type(exc).__name__}: {message}"
        if self.on_error == "raise":
            raise FatalSampleError(f"packtool could not read a pack: {message}") from exc
        self.skipped += 1
        log.warning("packtool skipped pack %d in this process: %s", self.skipped, message)
        raise SkipSample()

    def finish(self, batch: dict, manifest: Manifest) -> dict:
        """The collated batch as this encoder yields it."""
        return batch

    @stateless
    def batch(self, samples: list[PackRow]) -> dict:
        manifest = _manifest(str(samples[0].__sources__[0].dataset_path))
        return self.finish(collate_packs([s.batch for s in samples], manifest["pad_token_id"]), manifest)


class MegatronBridgeTaskEncoder(PackTaskEncoder):
    """Energon task encoder yielding the batch Megatron-Bridge's `vlm_step` / `gpt_step` consume: THD packed-
    sequence keys `cu_seqlens_q/kv(_padded)`, `max_seqlen_q/kv`, a `visual_inputs` object, ... (table in
    `packtool.runtime.megatron_batch`). Name it as the dataset's task encoder with micro batch size 1 and the model's
    `seq_length` equal to the pack size. Arguments as `PackTaskEncoder`.

    Limits Megatron-Bridge does not check: with pipeline parallel >= 3 its steps give the middle stages these THD
    boundaries only when the dataset config declares packing (`enable_offline_packing=True` with
    `offline_packing_specs`, as `examples/megatron_bridge_recipe.py` does; its validation refuses
    `enable_in_batch_packing` at micro batch 1), else their samples attend across each other; its Qwen2.5-VL model
    does not split sequences across context-parallel ranks (train with CP 1); Nemotron Omni packs with video need a
    model built with `temporal_patch_dim` equal to the manifest's `video_temporal_patch_dim` (2); FP8 needs a row
    length that is a multiple of 16."""

    def finish(self, batch: dict, manifest: Manifest) -> dict:
        return megatron_bridge_batch(batch, temporal_patch_dim=reader_of(manifest).temporal_patch_dim)
