"""Packs for Hugging Face trainers (transformers' models, ``Trainer``, TRL's ``SFTTrainer``).

The reader (:mod:`packtool.runtime.read`) gives Megatron-shaped rows: ``tokens`` and ``labels`` ALREADY SHIFTED
(``labels[t]`` is ``tokens[t + 1]`` where that token is a target). A Hugging Face model shifts its ``labels`` itself,
so feeding the reader's labels would train every token one position off. :func:`hf_batch` turns a reader batch into
the padding-free packed row a transformers model's ``forward`` takes, as ``DataCollatorWithFlattening`` builds it:

* ``input_ids`` ``[1, T]``: the real tokens of every segment (alignment and tail padding dropped);
* ``labels`` ``[1, T]``: UNSHIFTED, the token itself where it is a target, -100 elsewhere (every segment's first
  token is -100, so the model's own shift never predicts across a boundary);
* ``position_ids`` restarting at 0 per segment: ``[1, T]`` for text models; ``[4, 1, T]`` for Qwen2-VL/2.5-VL (row 0
  the per-segment text positions, from which transformers builds the packed mask, then the three mRoPE rows
  computed per segment by :func:`packtool.families.qwen2_vl.reader.mrope_position_ids`, which the family hands over);
  the same for Qwen3-VL with its rows (:func:`packtool.families.qwen3_vl.reader.position_ids`), whose videos carry no
  ``second_per_grid_ts`` (their times are text in the tokens);
* ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32) and ``max_length_q``/``max_length_k``: the varlen keywords flash
  attention takes;
* media keys of the processor (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
  ``second_per_grid_ts``, ``mm_token_type_ids``); media a batch has none of are left out.

Segments stay apart only under the attention set-ups :func:`check_model` accepts: eager/sdpa build a block-causal
mask from the text position row when ``attention_mask`` is None and there is no cache; flash attention uses the
varlen keywords. :func:`check_model` refuses other attention implementations and turns the cache off.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packtool.errors import FormatError
from packtool.format import BATCH_FAMILY
from packtool.runtime.read import IGNORE_INDEX
from packtool.runtime.registry import family_named

#: Attention implementations that keep packed segments apart (see the module docstring).
SEGMENT_SAFE_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class HFFamily:
    """How one model family takes a packed row: which model types it covers and its position ids."""

    name: str
    model_types: tuple[str, ...]
    #: (batch restricted to real tokens, manifest, tokens_per_second) -> position_ids.
    positions: Callable[[dict, Any, int | None], torch.Tensor]
    #: The media keys the family's model takes (those of media a row has are passed on), and with them
    #: ``mm_token_type_ids``; none: a text model.
    media_keys: tuple[str, ...] = ()


def _text_positions(row: dict, manifest, tokens_per_second) -> torch.Tensor:
    return row["position_ids"]


def _qwen2_vl_positions(row: dict, manifest, tokens_per_second) -> torch.Tensor:
    image_id = _manifest_get(manifest, "image_token_id")
    video_id = _manifest_get(manifest, "video_token_id")
    if image_id is None:
        raise ValueError("packtool: error: the qwen2_vl hook needs the manifest's image_token_id (pass manifest=)")
    videos = row.get("video_grid_thw")
    if videos is not None and len(videos) and tokens_per_second is None:
        raise ValueError("packtool: error: the batch has videos but no tokens_per_second (the model config's "
                         "vision_config.tokens_per_second); pass tokens_per_second=")
    rope = family_named("qwen2_vl").position_ids(
        row["input_ids"], row["cu"], row.get("image_grid_thw"), image_token_id=image_id, video_grid_thw=videos,
        second_per_grid_ts=row.get("second_per_grid_ts"), video_token_id=video_id,
        tokens_per_second=tokens_per_second or 0)
    return torch.cat([row["position_ids"][None], rope])


def _qwen3_vl_positions(row: dict, manifest, tokens_per_second) -> torch.Tensor:
    image_id = _manifest_get(manifest, "image_token_id")
    processor = _manifest_get(manifest, "image_processor") or {}
    if image_id is None or "merge_size" not in processor:
        raise ValueError("packtool: error: the qwen3_vl hook needs the manifest (pass manifest=)")
    rope = family_named("qwen3_vl").position_ids(
        row["input_ids"], row["cu"], row.get("image_grid_thw"), row.get("video_grid_thw"), image_token_id=image_id,
        video_token_id=_manifest_get(manifest, "video_token_id"), spatial_merge_size=int(processor["merge_size"]))
    return torch.cat([row["position_ids"][None], rope])


#: Family name -> hook. ``none``: text-only models; ``qwen2_vl``: Qwen2-VL and Qwen2.5-VL; ``qwen3_vl``: Qwen3-VL
#: (its videos' times are text in the tokens: no ``second_per_grid_ts``).
FAMILIES: dict[str, HFFamily] = {
    "none": HFFamily("none", (), _text_positions),
    "qwen2_vl": HFFamily("qwen2_vl", ("qwen2_vl", "qwen2_5_vl"), _qwen2_vl_positions, MEDIA_KEYS),
    "qwen3_vl": HFFamily("qwen3_vl", ("qwen3_vl", "qwen3_vl_moe"), _qwen3_vl_positions,
                         tuple(k for k in MEDIA_KEYS if k != "second_per_grid_ts")),
}


def _manifest_get(manifest, key: str):
    if manifest is None:
        return None
    return manifest.get(key) if isinstance(manifest, Mapping) else getattr(manifest, key, None)


def mm_token_type_ids(input_ids: torch.Tensor, manifest) -> torch.Tensor:
    """transformers' Qwen2-VL / Qwen2.5-VL processor's ``mm_token_type_ids`` of ``input_ids`` (any shape): per token
    0 text, 1 the manifest's image token, 2 its video token; int32, the shape of ``input_ids``."""
    image_id = _manifest_get(manifest, "image_token_id")
    video_id = _manifest_get(manifest, "video_token_id")
    kinds = torch.zeros_like(input_ids, dtype=torch.int32)
    if image_id is not None:
        kinds += (input_ids == image_id).int()
    if video_id is not None:
        kinds += 2 * (input_ids == video_id).int()
    return kinds


def family_of_model(model) -> HFFamily:
    """The hook of a transformers model (or config): ``qwen2_vl`` for Qwen2-VL/2.5-VL, ``qwen3_vl`` for Qwen3-VL,
    ``none`` for a model without a vision or audio tower; any other family is refused in one line."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", "?")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    if not getattr(config, "is_encoder_decoder", False) and not any(
            hasattr(config, k) for k in ("vision_config", "audio_config", "text_config")):
        return FAMILIES["none"]
    raise ValueError(f"packtool: error: model type {model_type!r} has no packed-row hook "
                     f"(supported: text-only models, "
                     f"{', '.join(t for f in FAMILIES.values() for t in f.model_types)})")


def family_of_batch(batch: Mapping, manifest=None) -> HFFamily:
    """The hook of the family the manifest names, else the one the reader wrote into the batch (``family``); a
    family without a hook is refused in one line. Nothing is guessed from the batch's keys: a batch that names no
    family, without a manifest, is refused too."""
    if manifest is not None:
        processor = _manifest_get(manifest, "image_processor")
        kind = processor.get("family", processor.get("type")) if isinstance(processor, Mapping) else None
        name = "none" if kind is None else str(kind)
    elif isinstance(batch.get(BATCH_FAMILY), str):
        name = batch[BATCH_FAMILY]
    else:
        raise ValueError("packtool: error: the batch names no family (its 'family' entry, written by packtool's "
                         "reader); pass the manifest or family=")
    if name not in FAMILIES:
        raise ValueError(f"packtool: error: packs made for image processor {name!r} have no Hugging Face hook "
                         f"(supported: text-only, {', '.join(n for n in FAMILIES if n != 'none')})")
    return FAMILIES[name]


def check_pairing(manifest, config, where: str = "the packs", model: str = "the model") -> None:
    """Refuse packs and a model that do not belong together, in one line naming both: the family the packs were
    made for against the model's (its ``model_type``), and the media token ids both state."""
    config = getattr(config, "config", config)
    if isinstance(config, Mapping):
        from types import SimpleNamespace

        config = SimpleNamespace(**config)
    packs = family_of_batch({}, manifest).name
    model_type = getattr(config, "model_type", "?")
    ours = family_of_model(config).name
    if packs != ours:
        raise ValueError(f"packtool: error: {where} were made for {packs if packs != 'none' else 'a text-only model'}"
                         f", {model} is {model_type!r} ({ours if ours != 'none' else 'text-only'}); pack with that "
                         f"model's folder or train the model the packs were made for")
    for key in ("image_token_id", "video_token_id"):
        theirs, mine = getattr(config, key, None), _manifest_get(manifest, key)
        if theirs is not None and mine is not None and int(theirs) != int(mine):
            raise ValueError(f"packtool: error: {where} use {key} {mine}, {model} {theirs}: another tokenizer; "
                             f"pack with that model's folder")


def check_model(model, packs=None):
    """Refuse a model whose attention would let packed segments see each other; turn its cache off (outer config
    and text config: Qwen2.5-VL's text config defaults to ``use_cache=True``, and with a cache transformers does not
    build the packed mask). With ``packs`` (an :class:`HFPackDataset` or a manifest), also refuse a model the packs
    were not made for (:func:`check_pairing`). Returns the model's :class:`HFFamily`."""
    family = family_of_model(model)
    if packs is not None:
        check_pairing(getattr(packs, "manifest", packs), model.config,
                      f"the packs at {packs.path}" if isinstance(packs, HFPackDataset) else "the packs")
    config = model.config
    configs = [config] + [c for c in [getattr(config, "text_config", None)] if c is not None]
    for c in configs:
        impl = getattr(c, "_attn_implementation", None)
        if impl is not None and impl not in SEGMENT_SAFE_ATTENTION:
            raise ValueError(f"packtool: error: attention implementation {impl!r} may attend across packed "
                             f"segments; use one of {', '.join(SEGMENT_SAFE_ATTENTION)}")
    for c in configs:
        if hasattr(c, "use_cache"):
            c.use_cache = False
    return family


def model_tokens_per_second(folder: str | Path) -> int | None:
    """``vision_config.tokens_per_second`` of a model folder's ``config.json`` (None when it has none)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    value = (config.get("vision_config") or {}).get("tokens_per_second")
    return None if value is None else int(value)


def hf_batch(batch: Mapping, manifest=None, *, tokens_per_second: int | None = None,
             family: str | None = None) -> dict:
    """One reader batch (:func:`packtool.runtime.read.pack_to_batch`) as a padding-free packed row for a Hugging
    Face model's ``forward`` (see the module docstring). ``family``: a :data:`FAMILIES` name; by default the family
    the manifest names, else the one the batch names (:func:`family_of_batch`)."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"packtool: error: unknown family {family!r} (known: {', '.join(FAMILIES)})")
    named = batch.get(BATCH_FAMILY)
    if manifest is not None and named in FAMILIES:
        made = family_of_batch({}, manifest).name
        if made != named:
            raise ValueError(f"packtool: error: the batch is of family {named}, the manifest given was written for "
                             f"{made}: pass the manifest of the output the batch was read from")
    hook = FAMILIES[family] if family is not None else family_of_batch(batch, manifest)
    tokens = batch["tokens"][0]
    real = ~batch["padding_mask"][0]
    shifted = batch["labels"][0]
    # Unshift: token t is a target iff the reader's label at t - 1 (same segment, never a segment's last) is.
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[1:] = torch.where(shifted[:-1] != IGNORE_INDEX, tokens[1:], IGNORE_INDEX)
    if not torch.equal(labels[1:][shifted[:-1] != IGNORE_INDEX], shifted[:-1][shifted[:-1] != IGNORE_INDEX]):
        raise FormatError(f"pack {batch.get('pack_key', '?')}: labels are not the next tokens (not a reader batch)")
    cu = batch["cu_seqlens_unpadded"].to(torch.int32)
    row: dict = {"input_ids": tokens[real][None], "labels": labels[real][None],
                 "position_ids": batch["position_ids"][0][real][None], "cu": cu}
    for key in MEDIA_KEYS:
        if key in batch:
            row[key] = batch[key]
    position_ids = hook.positions(row, manifest, tokens_per_second)
    seqlens = cu.diff()
    out = {"input_ids": row["input_ids"], "labels": row["labels"], "position_ids": position_ids,
           "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
           "max_length_q": int(seqlens.max()), "max_length_k": int(seqlens.max())}
    if hook.media_keys:
        out["mm_token_type_ids"] = mm_token_type_ids(row["input_ids"], manifest)
        has = {"image": len(row.get("image_grid_thw", ())) > 0, "video": len(row.get("video_grid_thw", ())) > 0}
        for key in hook.media_keys:  # only the kinds the row has media of: empty media tensors crash the model
            if key in row and has["video" if "video" in key or key == "second_per_grid_ts" else "image"]:
                out[key] = row[key]
    return out


def concat_hf_batches(rows: Sequence[Mapping]) -> dict:
    """Rows of :func:`hf_batch` concatenated into one packed row, as ``DataCollatorWithFlattening`` concatenates
    examples: tokens, labels and positions along the token axis, boundaries offset, media stacked in order."""
    if not rows:
        raise ValueError("packtool: error: no rows to concatenate")
    if len(rows) == 1:
        return dict(rows[0])
    out: dict = {"input_ids": torch.cat([r["input_ids"] for r in rows], dim=-1),
                 "labels": torch.cat([r["labels"] for r in rows], dim=-1),
                 "position_ids": torch.cat([r["position_ids"] for r in rows], dim=-1)}
    if len({r["position_ids"].dim() for r in rows}) != 1:
        raise ValueError("packtool: error: rows of different families cannot be concatenated")
    cus, offset = [torch.zeros(1, dtype=torch.int32)], 0
    for r in rows:
        cus.append(r["cu_seq_lens_q"][1:] + offset)
        offset += int(r["cu_seq_lens_q"][-1])
    cu = torch.cat(cus)
    longest = max(int(r["max_length_q"]) for r in rows)
    out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=longest, max_length_k=longest)
    for key in ("mm_token_type_ids",):
        if key in rows[0]:
            out[key] = torch.cat([r[key] for r in rows], dim=-1)
    for key in MEDIA_KEYS:
        parts = [r[key] for r in rows if key in r]
        if parts:
            out[key] = torch.cat(parts)
    return out


class HFPackDataset(torch.utils.data.Dataset):
    """A packed split as a map-style torch Dataset of :func:`hf_batch` rows (one per pack, on-disk order) for
    transformers' ``Trainer`` or TRL's ``SFTTrainer``. The shards' ``.tar.idx`` give the packs' places; each item
    reads its one pack (memory bounded by one pack). ``tokens_per_second`` defaults to the model folder's
    config (``model_folder``, else the output's copy of the tokenizer folder) where it has one."""

    def __init__(self, path: str | Path, split: str = "train", *, model_folder: str | Path | None = None,
                 tokens_per_second: int | None = None, family: str | None = None):
        from packtool.format import TOKENIZER_DIR, load_manifest, split_shard_paths
        from packtool.shards import record_offsets

        self.path, self.split, self.family = Path(path), split, family
        self.manifest = load_manifest(path)
        if family is None:
            family_of_batch({}, self.manifest)  # packs of a family without a hook are refused here, in one line
        if model_folder is not None and (Path(model_folder) / "config.json").is_file():
            check_pairing(self.manifest, json.loads((Path(model_folder) / "config.json").read_text()),
                          f"the packs at {path}", f"the model at {model_folder}")
        if tokens_per_second is None:
            tokens_per_second = model_tokens_per_second(model_folder or self.path / TOKENIZER_DIR)
        self.tokens_per_second = tokens_per_second
        self._index = [(shard, i) for shard in split_shard_paths(path, split)
                       for i in range(len(record_offsets(shard)) - 1)]
        self._processor = None

    def __len__(self) -> int:
        return len(self._index)

    def index_dataset(self):
        """A ``datasets.Dataset`` of ``{"pack": i}`` items (for trainers that require one, e.g. TRL's
        SFTTrainer); pair it with ``HFPackCollator(self)``, which reads each pack."""
        import datasets

        return datasets.Dataset.from_dict({"pack": list(range(len(self)))})

    def __getitem__(self, i: int) -> dict:
        from packtool.runtime.read import pack_to_batch, processor_for_output
        from packtool.shards import iter_records

        shard, number = self._index[i]
        if self._processor is None and self.manifest.image_processor is not None:
            self._processor = processor_for_output(self.path, self.manifest)
        key, members = next(iter_records(shard, [number]))
        batch = pack_to_batch({**members, "__key__": key}, self.manifest, pad_to="segments",
                              image_processor=self._processor, source=str(shard))
        return hf_batch(batch, self.manifest, tokens_per_second=self.tokens_per_second, family=self.family)


class HFPackCollator:
    """Collator for :class:`HFPackDataset`: the rows of a micro-batch concatenated into one padding-free packed row
    (:func:`concat_hf_batches`). Trainer counts the batch's target tokens (``num_items_in_batch``) from ``labels``
    and the model divides its summed loss by it, as an unpacked run normalises per target token.

    With ``packs`` (an :class:`HFPackDataset`), items may be ``{"pack": i}`` (:meth:`HFPackDataset.index_dataset`,
    the ``datasets.Dataset`` TRL's SFTTrainer requires): the collator reads pack ``i`` itself."""

    def __init__(self, packs: HFPackDataset | None = None):
        self.packs = packs

    def __call__(self, rows: Iterable[Mapping]) -> dict:
        resolved = []
        for row in rows:
            if "input_ids" not in row:
                if self.packs is None or "pack" not in row:
                    raise ValueError("packtool: error: a collated item is neither a packed row nor {'pack': i} "
                                     "of an HFPackCollator given its HFPackDataset")
                row = self.packs[int(row["pack"])]
            resolved.append(row)
        return concat_hf_batches(resolved)
