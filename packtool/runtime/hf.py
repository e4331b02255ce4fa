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

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from packtool.errors import FormatError
from packtool.format import BATCH_CONTEXT, BATCH_FAMILY
from packtool.lossweights import check_loss_mode
from packtool.readkit import layout_context, mm_token_type_ids
from packtool.runtime.read import IGNORE_INDEX, LOSS_MODE
from packtool.runtime.registry import FamilyReader, reader_of, registered

#: Attention implementations that keep packed segments apart (see the module docstring).
SEGMENT_SAFE_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class HFFamily:
    """How one registered family's packs become a Hugging Face packed row: its registered Hugging Face layout
    (:class:`packtool.families.spec.TrainerLayouts`: the model types it covers, its position ids, the media keys its
    models take)."""

    name: str
    model_types: tuple[str, ...]
    #: (batch restricted to real tokens, layout context, tokens_per_second) -> position_ids.
    positions: Callable[[dict, Mapping, int | None], torch.Tensor]
    #: The media keys the family's model takes (those of media a row has are passed on), and with them
    #: ``mm_token_type_ids``; none: a text model.
    media_keys: tuple[str, ...] = ()


@functools.cache
def _hf_families() -> dict[str, HFFamily]:
    """Every registered family that has a Hugging Face layout, by name (the registry's order); built once, not per
    batch (the registry is complete once imported)."""
    out = {}
    for name, spec in registered().items():
        layouts = spec.layouts
        positions = layouts.function("hugging_face")
        if positions is not None:
            out[name] = HFFamily(name, layouts.hugging_face_model_types, positions, layouts.hugging_face_media_keys)
    return out


def hf_family(name: str) -> HFFamily:
    """The Hugging Face layout of the family called ``name``; a family without one is refused in one line."""
    families = _hf_families()
    if name not in families:
        raise ValueError(f"packtool: error: packs made for image processor {name!r} have no Hugging Face hook "
                         f"(supported: text-only, {', '.join(n for n in families if n != 'none')})")
    return families[name]


def _manifest_get(manifest, key: str):
    if manifest is None:
        return None
    return manifest.get(key) if isinstance(manifest, Mapping) else getattr(manifest, key, None)


def family_of_model(model) -> HFFamily:
    """The Hugging Face layout of a transformers model (or config): the registered family whose layout names its
    ``model_type``; the text-only one for a model without a vision or audio tower; any other is refused in one
    line."""
    config = getattr(model, "config", model)
    model_type = getattr(config, "model_type", "?")
    families = _hf_families()
    for family in families.values():
        if model_type in family.model_types:
            return family
    if not getattr(config, "is_encoder_decoder", False) and not any(
            hasattr(config, k) for k in ("vision_config", "audio_config", "text_config")):
        return families["none"]
    raise ValueError(f"packtool: error: model type {model_type!r} has no packed-row hook "
                     f"(supported: text-only models, "
                     f"{', '.join(t for f in families.values() for t in f.model_types)})")


def family_of_batch(batch: Mapping, manifest=None) -> HFFamily:
    """The Hugging Face layout of the family the manifest names, else the one the reader wrote into the batch
    (``family``); a family without one is refused in one line. Nothing is guessed from the batch's keys: a batch
    that names no family, without a manifest, is refused too."""
    if manifest is not None:
        processor = _manifest_get(manifest, "image_processor")
        kind = processor.get("family", processor.get("type")) if isinstance(processor, Mapping) else None
        name = "none" if kind is None else str(kind)
    elif isinstance(batch.get(BATCH_FAMILY), str):
        name = batch[BATCH_FAMILY]
    else:
        raise ValueError("packtool: error: the batch names no family (its 'family' entry, written by packtool's "
                         "reader); pass the manifest or family=")
    return hf_family(name)


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
             family: str | None = None, loss_mode: str | None = None) -> dict:
    """One reader batch (:func:`packtool.runtime.read.pack_to_batch`) as a padding-free packed row for a Hugging
    Face model's ``forward`` (see the module docstring). ``family``: a registered family's name; by default the family
    the manifest names, else the one the batch names (:func:`family_of_batch`). ``loss_mode``: add
    ``loss_weights`` (float32 ``[1, T]``, the weight of each ``labels`` position, 0 where it is -100) and
    ``loss_weight_sum`` (float64 ``[1]``) under that mode (:mod:`packtool.lossweights`; the batch's own weights
    where it was read under that mode), for :func:`packed_lm_loss`; None: neither (the model's own loss)."""
    families = _hf_families()
    if family is not None and family not in families:
        raise ValueError(f"packtool: error: unknown family {family!r} (known: {', '.join(families)})")
    named = batch.get(BATCH_FAMILY)
    if manifest is not None and named in families:
        made = family_of_batch({}, manifest).name
        if made != named:
            raise ValueError(f"packtool: error: the batch is of family {named}, the manifest given was written for "
                             f"{made}: pass the manifest of the output the batch was read from")
    hook = families[family] if family is not None else family_of_batch(batch, manifest)
    context = layout_context(manifest) if manifest is not None else batch.get(BATCH_CONTEXT)
    if context is None:
        raise ValueError("packtool: error: the batch carries no layout context (a batch of an older packtool "
                         "reader); pass the output's manifest")
    tokens = batch["tokens"][0]
    real = ~batch["padding_mask"][0]
    shifted = batch["labels"][0]
    # Unshift: token t is a target iff the reader's label at t - 1 (same segment, never a segment's last) is.
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[1:] = torch.where(shifted[:-1] != IGNORE_INDEX, tokens[1:], IGNORE_INDEX)
    if not torch.equal(labels[1:][shifted[:-1] != IGNORE_INDEX], shifted[:-1][shifted[:-1] != IGNORE_INDEX]):
        raise FormatError(f"pack {batch.get('pack_key', '?')}: labels are not the next tokens (not a reader batch)")
    cu = batch["cu_seqlens_unpadded"].to(torch.int32)
    weighted = _weights_unshifted(batch, loss_mode)
    row: dict = {"input_ids": tokens[real][None], "labels": labels[real][None],
                 "position_ids": batch["position_ids"][0][real][None], "cu": cu}
    for key in hook.media_keys:
        if key in batch:
            row[key] = batch[key]
    position_ids = hook.positions(row, context, tokens_per_second)
    seqlens = cu.diff()
    out = {"input_ids": row["input_ids"], "labels": row["labels"], "position_ids": position_ids,
           "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
           "max_length_q": int(seqlens.max()), "max_length_k": int(seqlens.max())}
    if weighted is not None:
        out["loss_weights"], out["loss_weight_sum"] = weighted[0][real][None], weighted[1]
    if hook.media_keys:
        out["mm_token_type_ids"] = mm_token_type_ids(row["input_ids"], context)
        has = {"image": len(row.get("image_grid_thw", ())) > 0, "video": len(row.get("video_grid_thw", ())) > 0}
        for key in hook.media_keys:  # only the kinds the row has media of: empty media tensors crash the model
            if key in row and has["video" if "video" in key or key == "second_per_grid_ts" else "image"]:
                out[key] = row[key]
    return out


def _weights_unshifted(batch: Mapping, loss_mode: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's per-position weights moved onto the unshifted labels (the weight of the reader's label at
    ``t - 1`` belongs to token ``t``), under ``loss_mode``; None without a mode."""
    if loss_mode is None:
        return None
    check_loss_mode(loss_mode)
    if batch.get(LOSS_MODE, "token") != loss_mode:
        raise ValueError(f"packtool: error: the batch was read with loss_mode {batch.get(LOSS_MODE, 'token')!r}, "
                         f"not {loss_mode!r}: read it with loss_mode={loss_mode!r}")
    shifted = batch["loss_weights"][0]
    weights = torch.zeros_like(shifted)
    weights[1:] = shifted[:-1]
    return weights, batch["loss_weight_sum"].reshape(1).double()


def packed_lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum of a packed row's next-token losses: ``Σ_t w_t · CE(logits[t - 1], labels[t])`` over the
    row's unshifted ``labels`` (-100: no target) and :func:`hf_batch`'s ``loss_weights``. Divide the sum over a
    global batch (every micro-batch of the step, every process) by the sum of its rows' ``loss_weight_sum``: the
    step is then the mode's weighted mean exactly (``token`` with no weights: the per-token mean)."""
    logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])
    target = labels[..., 1:].reshape(-1)
    weights = loss_weights[..., 1:].reshape(-1).to(logits.dtype)
    losses = torch.nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
    return (losses * weights * (target != IGNORE_INDEX)).sum()


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
    for key in ("mm_token_type_ids", "loss_weights"):
        if key in rows[0]:
            out[key] = torch.cat([r[key] for r in rows], dim=-1)
    if "loss_weight_sum" in rows[0]:
        out["loss_weight_sum"] = torch.cat([r["loss_weight_sum"] for r in rows]).sum().reshape(1)
    token_keys = {"input_ids", "labels", "position_ids", "mm_token_type_ids", "loss_weights", "loss_weight_sum",
                  *VARLEN_KEYS}
    media = dict.fromkeys(k for r in rows for k in r if k not in token_keys)  # in order of first appearance
    for key in media:
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
                 tokens_per_second: int | None = None, family: str | None = None, loss_mode: str | None = None):
        from packtool.format import TOKENIZER_DIR, load_manifest, split_shard_paths
        from packtool.shards import record_offsets

        self.path, self.split, self.family = Path(path), split, family
        self.loss_mode = None if loss_mode is None else check_loss_mode(loss_mode)
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
        self._reader: FamilyReader | None = None  # the manifest's family reader, built on the first pack read

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
        if self._reader is None:
            self._reader = reader_of(self.manifest)
        key, members = next(iter_records(shard, [number]))
        batch = pack_to_batch({**members, "__key__": key}, self.manifest, pad_to="segments",
                              image_processor=self._processor, source=str(shard), loss_mode=self.loss_mode or "token",
                              reader=self._reader)
        return hf_batch(batch, self.manifest, tokens_per_second=self.tokens_per_second, family=self.family,
                        loss_mode=self.loss_mode)


class HFPackCollator:
    """Collator for :class:`HFPackDataset`: the rows of a micro-batch concatenated into one padding-free packed row
    (:func:`concat_hf_batches`). Trainer counts the batch's target tokens (``num_items_in_batch``) from ``labels``
    and the model divides its summed loss by it, as an unpacked run normalises per target token.

    With ``packs`` (an :class:`HFPackDataset`), items may be ``{"pack": i}`` (:meth:`HFPackDataset.index_dataset`,
    the ``datasets.Dataset`` TRL's SFTTrainer requires): the collator reads pack ``i`` itself."""

    def __init__(self, packs: HFPackDataset | None = None, *, loss_mode: str | None = None):
        self.packs = packs
        self.loss_mode = None if loss_mode is None else check_loss_mode(loss_mode)
        if packs is not None and loss_mode is not None and packs.loss_mode != loss_mode:
            raise ValueError(f"packtool: error: the collator's loss_mode {loss_mode!r} is not its packs' "
                             f"({packs.loss_mode!r}): give the HFPackDataset the same loss_mode")

    def __call__(self, rows: Iterable[Mapping]) -> dict:
        resolved = []
        for row in rows:
            if "input_ids" not in row:
                if self.packs is None or "pack" not in row:
                    raise ValueError("packtool: error: a collated item is neither a packed row nor {'pack': i} "
                                     "of an HFPackCollator given its HFPackDataset")
                row = self.packs[int(row["pack"])]
            if self.loss_mode is not None and "loss_weights" not in row:
                raise ValueError(f"packtool: error: the collator's loss_mode is {self.loss_mode!r} but a row carries "
                                 f"no loss_weights: read the packs with loss_mode={self.loss_mode!r}")
            resolved.append(row)
        return concat_hf_batches(resolved)


#: Keys of a weighted row the model's ``forward`` does not take.
WEIGHT_KEYS = ("loss_weights", "loss_weight_sum", "num_samples")


class PackedLossTrainer:
    """A mixin for transformers' ``Trainer`` (or TRL's ``SFTTrainer``), listed first, that makes the optimizer step
    the loss mode's weighted mean over the whole global batch, exactly as the same samples trained unpacked::

        class PackedSFTTrainer(PackedLossTrainer, SFTTrainer): ...

        data = HFPackDataset(OUTPUT, loss_mode="sample")
        trainer = PackedSFTTrainer(..., train_dataset=data.index_dataset(), data_collator=HFPackCollator(data))

    Each micro-batch's loss is :func:`packed_lm_loss` divided by the sum of ``loss_weight_sum`` over every
    micro-batch of the step (gradient accumulation) and every process (all-gathered: Trainer's
    ``num_items_in_batch`` becomes that sum), times the process count (DDP averages the processes' gradients).
    ``token`` with no weights is then the per-token mean over the global batch, as Trainer's own loss gives.

    A ``compute_loss_func`` cannot do this: Trainer hands it the outputs and the labels only, never the batch's
    per-token weights. The rows must carry ``loss_weights`` (read with ``loss_mode=``); tensor, context and
    sequence parallelism and ``DataParallel`` are refused (each would count the weights more than once)."""

    #: The loss is already the step's share: Trainer must not divide it by the accumulation steps again.
    loss_is_scaled_for_ga = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # What older Trainers read instead of loss_is_scaled_for_ga (the same: scaled, counted per step).
        self.model_accepts_loss_kwargs = True

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        if not batch_samples:
            return None
        missing = [b for b in batch_samples if "loss_weights" not in b]
        if missing:
            raise ValueError("packtool: error: PackedLossTrainer's batches carry no loss_weights: give "
                             "HFPackDataset and HFPackCollator a loss_mode ('token', 'sample' or 'square')")
        args, accelerator = self.args, self.accelerator  # type: ignore[attr-defined]
        parallel = {"tensor": self.get_tp_size(), "context": self.get_cp_size(),  # type: ignore[attr-defined]
                    "sequence": self.get_sp_size()}  # type: ignore[attr-defined]
        if args.n_gpu > 1 or any(size > 1 for size in parallel.values()):
            raise ValueError("packtool: error: PackedLossTrainer takes data parallelism only (one device per "
                             f"process; n_gpu {args.n_gpu}, parallel sizes {parallel})")
        total = sum(b["loss_weight_sum"].double().sum() for b in batch_samples).to(device).reshape(1)
        if args.world_size > 1:
            total = accelerator.gather(total).sum()
        return total.reshape(())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        if "loss_weights" not in inputs:
            raise ValueError("packtool: error: PackedLossTrainer's batch carries no loss_weights: give "
                             "HFPackDataset and HFPackCollator a loss_mode ('token', 'sample' or 'square')")
        labels, weights = inputs.pop("labels"), inputs.pop("loss_weights")
        local = inputs["loss_weight_sum"].double().sum()
        for key in WEIGHT_KEYS:
            inputs.pop(key, None)
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        loss = packed_lm_loss(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
                              labels, weights)
        if num_items_in_batch is None:  # evaluation without a count: this batch's own weighted mean
            loss = loss / local.clamp(min=1e-300).to(loss.dtype)
        else:
            total = torch.as_tensor(num_items_in_batch, device=loss.device).to(loss.dtype)
            loss = torch.where(total > 0, loss / total.clamp(min=1e-300), loss * 0)
            loss = loss * self.accelerator.num_processes  # type: ignore[attr-defined]
        return (loss, outputs) if return_outputs else loss
