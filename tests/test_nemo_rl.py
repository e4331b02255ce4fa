"""NeMo-RL reads packtool's packs: the task encoder NeMo-RL loads by file, its packed SFT batch, the alignment.

NeMo-RL does not install from the package registry, so each behaviour of it these tests rely on is re-derived here
in a few lines from its code (NVIDIA-NeMo/RL, ``nemo_rl/data/energon/``), each helper naming the function it stands
for. The packs are real ``packtool pack`` output read through Energon's own loader.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
import yaml
from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_savable_loader, get_val_dataset

import packfixture as fx
from packtool.errors import FormatError
from packtool.format import PackRecord, load_manifest
from packtool.runtime import nemo_rl
from packtool.settings import alignment_for, derive_align, nemo_rl_align
from packtool.shards import scan_records

ROOT = Path(__file__).resolve().parents[1]


# -- re-derivations of NeMo-RL ----------------------------------------------------------------------------------
def resolve_file_backed(python_file: str, object_name: str, base: type | None) -> object:
    """``LazyRegistry.resolve_configured`` (``multimodal/registry.py``) for a file-backed component: the path must be
    absolute and end in ``.py``; the file is executed as a module named after its path and digest; the object must
    be a task encoder subclass (``base``) or, for a cooker (``base`` None), callable."""
    path = Path(python_file)
    assert path.is_absolute() and path.suffix == ".py"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    name = "_nemo_rl_energon_component_" + hashlib.sha256(f"{path.resolve()}:{digest}".encode()).hexdigest()
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path.resolve())
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    obj = getattr(module, object_name)
    assert (isinstance(obj, type) and issubclass(obj, base)) if base is not None else callable(obj)
    return obj


def nemo_rl_encoder_kwargs(*, max_sequence_length: int, tokenizer=None, packer=None, options=None) -> dict:
    """The keyword arguments ``_task_encoder`` (``sft_dataloader.py``) builds a configured encoder class with."""

    class Adapter:  # HFMultimodalSFTProcessorAdapter: the attribute an encoder may read
        pass

    adapter = Adapter()
    adapter.max_sequence_length = max_sequence_length  # type: ignore[attr-defined]
    return {"adapter": adapter, "cooker_functions": [], "include_source_ids": True, "packer": packer,
            "tokenizer": tokenizer, "sequence_length_pad_multiple": 1, "only_unmask_final": False,
            **(options or {})}


def reference_packed_batch(packs: list[list[tuple[list[int], list[int]]]], multiple: int, pad_id: int,
                           capacity: int | None = None) -> dict:
    """``prepare_packed_sft_batch`` (``multimodal/packing.py``) with ``pack_selected_samples``' padded lengths and
    ``batched_message_log_to_flat_message``'s right padding, for samples given as (token ids, token loss mask): each
    sample's first token loses its loss, each sample is padded with the pad id to ``ceil(cost / multiple) *
    multiple``, rows are padded to the longest; ``cu_seqlens`` sums real lengths, ``cu_seqlens_padded`` padded. With
    ``capacity`` (NeMo-RL's current ``generic_sft``), each pack's last sample is padded on to the capacity."""
    rows, masks, real, padded = [], [], [], []
    for pack in packs:
        ids, mask, lengths, widths = [], [], [], []
        for tokens, loss in pack:
            loss = list(loss)
            loss[0] = 0
            width = math.ceil(len(tokens) / multiple) * multiple
            if capacity is not None and len(widths) == len(pack) - 1:  # the last sample takes the pack's tail
                width = capacity - sum(widths)
            ids += list(tokens) + [pad_id] * (width - len(tokens))
            mask += loss + [0] * (width - len(tokens))
            lengths.append(len(tokens))
            widths.append(width)
        rows.append(ids)
        masks.append(mask)
        real.append(torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32))
        padded.append(torch.tensor([0, *np.cumsum(widths)], dtype=torch.int32))
    length = max(map(len, rows))
    input_ids = torch.tensor([r + [pad_id] * (length - len(r)) for r in rows], dtype=torch.int64)
    token_mask = torch.tensor([m + [0] * (length - len(m)) for m in masks], dtype=torch.float32)
    return {"input_ids": input_ids, "input_lengths": torch.tensor([len(r) for r in rows], dtype=torch.int32),
            "token_mask": token_mask, "sample_mask": token_mask.bool().any(1).float(), "cu_seqlens": real,
            "cu_seqlens_padded": padded}


def nemotron_image_inputs(image, patch_sizes: tuple[int, int], patch_dim: int = 16) -> tuple[torch.Tensor, tuple]:
    """``_NemotronVisualProcessorAdapter._process_media`` (``nemotron_visual.py``) for one image planned at
    ``patch_sizes`` (width, height in patches): PIL resize, [0, 1], CLIP mean/std; its ``imgs_sizes`` row."""
    width, height = patch_sizes[0] * patch_dim, patch_sizes[1] * patch_dim
    array = np.array(image.convert("RGB").resize((width, height)), copy=True)
    pixels = torch.from_numpy(array).permute(2, 0, 1).float() / 255
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    return (pixels - mean) / std, (height, width)


class StandInSFTTaskEncoder(DefaultTaskEncoder, ABC):
    """NeMo-RL's ``BaseSFTTaskEncoder`` (``multimodal/task_encoders/base.py``) as CI holds it: Energon's default
    task encoder with keyword-only cooker functions and the four abstract steps (pre-encode, post-encode, batch,
    encode_batch). Energon itself asserts that pre-encode and ``encode_sample`` are not both overridden."""

    sample_schema: ClassVar[str]

    def __init__(self, *, cooker_functions) -> None:
        super().__init__()
        self.cookers = tuple(c if isinstance(c, Cooker) else Cooker(c) for c in cooker_functions)

    @abstractmethod
    def preencode_sample(self, sample): ...

    @abstractmethod
    def postencode_sample(self, sample): ...

    @abstractmethod
    def batch(self, samples): ...

    @abstractmethod
    def encode_batch(self, batch): ...


def load_encoder_module(label: str, monkeypatch) -> types.ModuleType:
    """The encoder file executed afresh as its own module (it picks its base class at import)."""
    spec = importlib.util.spec_from_file_location(f"_packtool_encoder_{label}", nemo_rl.encoder_file())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stand_in_module(monkeypatch) -> Iterator[types.ModuleType]:
    """The encoder file loaded where ``nemo_rl``'s base module is the stand-in (and nothing else of NeMo-RL is)."""
    names = ["nemo_rl", "nemo_rl.data", "nemo_rl.data.energon", "nemo_rl.data.energon.multimodal",
             "nemo_rl.data.energon.multimodal.task_encoders"]
    for name in names:
        package = types.ModuleType(name)
        package.__path__ = []  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, package)
    base = types.ModuleType("nemo_rl.data.energon.multimodal.task_encoders.base")
    base.BaseSFTTaskEncoder = StandInSFTTaskEncoder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, base.__name__, base)
    yield load_encoder_module("stand_in", monkeypatch)


def loader_batches(path: Path, encoder, batch_size: int = 2, split: str = "val") -> list:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return list(get_savable_loader(get_val_dataset(path, split_part=split, worker_config=wc, batch_size=batch_size,
                                                   task_encoder=encoder)))


# -- helpers ----------------------------------------------------------------------------------------------------
def loaded_encoder_class() -> type:
    return resolve_file_backed(nemo_rl.encoder_file(), "PacktoolSFTTaskEncoder", DefaultTaskEncoder)  # type: ignore


def nemo_rl_loader(path: Path, batch_size: int, split: str = "val", **options):
    cls = loaded_encoder_class()
    encoder = cls(**nemo_rl_encoder_kwargs(max_sequence_length=load_manifest(path)["settings"]["pack_size"],
                                           options=options))
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return get_savable_loader(get_val_dataset(path, split_part=split, worker_config=wc, batch_size=batch_size,
                                              task_encoder=encoder))


def samples_of(path: Path, split: str = "val") -> dict[str, tuple[list[int], list[int]]]:
    """Every packed sample's (tokens, targets) by source key, read from the tars."""
    return {seg.key: (tokens.tolist(), targets.tolist()) for seg, tokens, targets, _ in fx.packed_segments(path, split)}


def assert_batch_equal(batch: dict, want: dict) -> None:
    for key, value in want.items():
        got = batch[key]
        if isinstance(value, list):
            assert len(got) == len(value) and all(torch.equal(a, b) for a, b in zip(got, value)), key
        else:
            assert got.dtype == value.dtype and torch.equal(got, value), key


@pytest.fixture(scope="module")
def nemo_rl_packed(demo_dir, tmp_path_factory) -> Path:
    """The demo dataset's val split (text, images, videos) packed for a NeMo-RL recipe at TP4 / CP2."""
    out = tmp_path_factory.mktemp("nemorl") / "out"
    cmd = [sys.executable, "-m", "packtool.cli", "pack", str(demo_dir / "dataset"), str(out), "--tokenizer",
           str(demo_dir / "tokenizer"), "--pack-size", "2048", "--split", "val", "--align-for", "nemo-rl",
           "--tp-size", "4", "--cp-size", "2", "--workers", "1", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


# -- alignment --------------------------------------------------------------------------------------------------
def test_alignment_for_nemo_rl_is_its_sequence_multiple():
    # NeMo-RL's Megatron recipes: make_sequence_length_divisible_by = ${mul:${mul:tp, cp}, 2}
    assert nemo_rl_align(cp_size=2, tp_size=4) == 16 and derive_align(cp_size=2, tp_size=4) == 4
    assert alignment_for("nemo-rl", cp_size=2, tp_size=4) == 16
    assert alignment_for("megatron", cp_size=2, tp_size=4, sequence_parallel=True) == 8
    assert nemo_rl_align() == 2
    with pytest.raises(ValueError, match="align_for"):
        alignment_for("nemo", cp_size=2)  # type: ignore[arg-type]


def test_cli_aligns_packs_for_nemo_rl(nemo_rl_packed):
    assert load_manifest(nemo_rl_packed)["settings"]["align"] == 16


# -- the task encoder through Energon -----------------------------------------------------------------------------
def test_packs_become_nemo_rl_packed_batches(nemo_rl_packed):
    """Sample by sample, the encoder's batch equals `prepare_packed_sft_batch` of the packed samples (tokens and
    targets as NeMo-RL's message logs would carry them), at the recipe's multiple 16 and at 8."""
    samples = samples_of(nemo_rl_packed)
    pad = load_manifest(nemo_rl_packed)["pad_token_id"]
    seen = set()
    for multiple, batch_size, layout in ((None, 1, "samples"), (8, 2, "samples"), (None, 2, "capacity")):
        for batch in nemo_rl_loader(nemo_rl_packed, batch_size, sequence_multiple=multiple, pack_layout=layout):
            packs = [[samples[k] for k in keys] for keys in batch["source_ids"]]
            want = reference_packed_batch(packs, multiple or 16, pad, capacity=2048 if layout == "capacity" else None)
            assert_batch_equal(batch, want)
            ends = [int(p[-1]) for p in batch["cu_seqlens_padded"]]
            assert all(e <= 2048 for e in ends) and (layout == "samples" or set(ends) == {2048})
            seen.update(k for keys in batch["source_ids"] for k in keys)
            if multiple is None:
                assert all((p % 16 == 0).all() for p in batch["cu_seqlens_padded"])
    assert seen == set(samples)


def test_control_pack_tail_padding_is_not_nemo_rl_layout(nemo_rl_packed):
    """Control: the reader's own layout (one pad run at the pack's tail) is not NeMo-RL's, so the comparison above
    can fail."""
    samples = samples_of(nemo_rl_packed)
    pad = load_manifest(nemo_rl_packed)["pad_token_id"]
    differs = 0
    for batch in nemo_rl_loader(nemo_rl_packed, 1, pack_layout="samples"):
        pack = [samples[k] for k in batch["source_ids"][0]]
        tail = reference_packed_batch([[(sum((t for t, _ in pack), []), sum((m for _, m in pack), []))]], 16, pad)
        differs += not torch.equal(tail["input_ids"], batch["input_ids"])
    assert differs > 0


def test_qwen_media_are_the_processors(nemo_rl_packed):
    """Qwen2.5-VL packs carry what NeMo-RL's hf_multimodal adapter puts in its messages: the transformers
    processor's pixel_values and image_grid_thw, per row in placeholder order (here: the reader's, which equals the
    processor's)."""
    from packtool.runtime.read import read_packs

    by_key = {b["pack_key"]: b for b in read_packs(nemo_rl_packed, split="val")}
    with_images = image_only = 0
    for batch in nemo_rl_loader(nemo_rl_packed, 1):
        reader = next(b for b in by_key.values() if b["keys"] == batch["source_ids"][0])
        if batch.get("image_grid_thw") is None or batch["image_grid_thw"][0] is None:
            assert int(reader["image_grid_thw"].shape[0]) == 0
            continue
        with_images += 1
        (grid,), (pixels,) = batch["image_grid_thw"][0], batch["pixel_values"][0]  # one segment per pack
        assert torch.equal(grid, reader["image_grid_thw"]) and torch.equal(pixels, reader["pixel_values"])
        if int(reader["video_grid_thw"].shape[0]) == 0:  # an image-only pack carries no (empty) video keys
            image_only += 1
            assert all(batch.get(k) is None for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"))
    assert with_images > 0 and image_only > 0


def test_qwen_batch_carries_the_processors_mm_token_type_ids(nemo_rl_packed, demo_dir, torchvision):
    """Qwen2.5-VL packs: the batch's ``mm_token_type_ids`` (the shape of ``input_ids``) equal, on one sample with
    images, what transformers' Qwen2.5-VL processor returns for that sample's text and images; 0 on padding."""
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    folder = demo_dir / "tokenizer"
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
                                    tokenizer=AutoTokenizer.from_pretrained(folder),
                                    video_processor=Qwen2VLVideoProcessor.from_pretrained(folder))
    manifest = load_manifest(nemo_rl_packed)
    image_id, video_id = manifest["image_token_id"], manifest["video_token_id"]
    seg, tokens, media = next((s, t, m) for s, t, _, m in fx.packed_segments(nemo_rl_packed, "val")
                              if s.media and all(r.kind == "image" for r in s.media))
    ids = tokens.tolist()
    one_each = [t for i, t in enumerate(ids) if t != image_id or i == 0 or ids[i - 1] != image_id]
    images = [Image.open(io.BytesIO(media[r.member])) for r in seg.media]
    want = processor(text=[processor.tokenizer.decode(one_each)], images=images, return_tensors="pt")
    assert want["input_ids"][0].tolist() == ids  # the processor's own tokens of this sample
    want_types = want["mm_token_type_ids"][0]
    assert int(want_types.sum()) == sum(t == image_id for t in ids) > 0  # control: not all text
    found = 0
    for batch in nemo_rl_loader(nemo_rl_packed, 2):
        types = batch["mm_token_type_ids"]
        assert types.shape == batch["input_ids"].shape
        assert torch.equal(types == 1, batch["input_ids"] == image_id)
        assert torch.equal(types == 2, batch["input_ids"] == video_id)
        for row, keys in enumerate(batch["source_ids"]):
            if seg.key in keys:
                i = keys.index(seg.key)
                start, end = (int(v) for v in batch["cu_seqlens_padded"][row][i:i + 2])
                got = types[row, start:start + len(ids)]
                assert got.dtype == want_types.dtype and torch.equal(got, want_types)
                assert not types[row, start + len(ids):end].any()  # the sample's padding is text (0)
                found += 1
    assert found == 1


def test_encoder_refuses_what_cannot_hold(nemo_rl_packed, tmp_path):
    cls = loaded_encoder_class()
    with pytest.raises(ValueError, match="packing"):
        cls(**nemo_rl_encoder_kwargs(max_sequence_length=2048, packer=object()))
    with pytest.raises(ValueError, match="options"):
        cls(**nemo_rl_encoder_kwargs(max_sequence_length=2048, options={"pad_multiple": 16}))
    # a Nemotron recipe's own encoder options are inherited by its overlay: accepted
    cls(**nemo_rl_encoder_kwargs(max_sequence_length=2048, options={"prompt_format": "nemotron6-moe"}))
    with pytest.raises(Exception, match="max_total_sequence_length"):
        encoder = cls(**nemo_rl_encoder_kwargs(max_sequence_length=1024))
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
        next(iter(get_savable_loader(get_val_dataset(nemo_rl_packed, split_part="val", worker_config=wc,
                                                     batch_size=1, task_encoder=encoder))))


def test_encoder_recipe_options_honoured_or_refused(nemo_rl_packed):
    """Every recipe option of NeMo-RL's own encoders is compared with the packs' settings or refused unless at the
    value the packs fixed: one accepted and one refused value per class."""
    cls = loaded_encoder_class()

    def build(**options):
        return cls(**nemo_rl_encoder_kwargs(max_sequence_length=2048, options=options))

    assert nemo_rl.RECIPE_OPTIONS == {*nemo_rl.PACKED_RECIPE_OPTIONS, *nemo_rl.FIXED_RECIPE_OPTIONS,
                                      *nemo_rl.OFF_RECIPE_OPTIONS, "prompt_format", "thinking_trace_format"}
    # fixed by packtool's NeMo-RL rules: the default accepted, another value refused
    for name, fixed in nemo_rl.FIXED_RECIPE_OPTIONS.items():
        build(**{name: fixed})
        other = (not fixed) if isinstance(fixed, bool) else fixed * 2
        with pytest.raises(ValueError, match=f"{name} .*already fixed it at"):
            build(**{name: other})
    # augmentations, loader decoding and loss masks: off accepted, on refused
    for name in nemo_rl.OFF_RECIPE_OPTIONS:
        build(**{name: None})
        with pytest.raises(ValueError, match=f"the recipe sets {name} "):
            build(**{name: "assistant" if name == "loss_mask_mode" else 1})
    build(video_frame_temporal_jitter=False, tiling_augment_prob=0.0)
    # compared with the manifest when a pack is read
    omni = {"settings": {"pack_size": 4096}, "image_processor": {"family": "nemotron_omni", "patch_size": 16,
                                                                  "video_temporal_patch_dim": 2}}
    qwen = {"settings": {"pack_size": 4096}, "image_processor": {"family": "qwen2_vl"}}

    class Audio:
        feature_size = 128

    class Processors:
        audio = Audio()

    same = {"packing_sequence_length": 4096, "patch_dim": 16, "temporal_patch_size": 2,
            "audio_subsampling_factor": 8, "audio_num_mel_bins": 128}
    assert set(same) == set(nemo_rl.PACKED_RECIPE_OPTIONS)
    nemo_rl.check_packed_recipe_options(omni, same, Processors())
    nemo_rl.check_packed_recipe_options(qwen, {"packing_sequence_length": 4096})
    for name, value in same.items():
        with pytest.raises(FormatError, match=f"the recipe sets {name} {value + 1}, the packs were made with"):
            nemo_rl.check_packed_recipe_options(omni, {name: value + 1}, Processors())
    with pytest.raises(FormatError, match="patch_dim 16, a Nemotron Omni option"):
        nemo_rl.check_packed_recipe_options(qwen, {"patch_dim": 16})
    encoder = build(**same)
    assert encoder.recipe_options == same
    # through Energon's loader: the packs' pack size accepted, another refused with the pack named
    pack_size = load_manifest(nemo_rl_packed)["settings"]["pack_size"]
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    for size in (pack_size, pack_size * 2):
        loader = get_savable_loader(get_val_dataset(nemo_rl_packed, split_part="val", worker_config=wc, batch_size=1,
                                                    task_encoder=build(packing_sequence_length=size)))
        if size == pack_size:
            assert next(iter(loader))["input_ids"].shape[0] == 1
        else:
            with pytest.raises(Exception, match=f"packing_sequence_length {size}, the packs were made with"):
                next(iter(loader))
    # NeMo-RL's own keywords: the pad multiple taken as sequence_multiple, a differing pair refused
    kwargs = nemo_rl_encoder_kwargs(max_sequence_length=2048)
    assert cls(**{**kwargs, "sequence_length_pad_multiple": 8}).sequence_multiple == 8
    with pytest.raises(ValueError, match="differ"):
        cls(**{**kwargs, "sequence_length_pad_multiple": 8, "sequence_multiple": 16})
    # cookers: packtool's accepted, another refused
    cls(**{**kwargs, "cooker_functions": [Cooker(nemo_rl.cook_packtool_pack, has_subflavors={"packtool": 1})]})
    with pytest.raises(ValueError, match="cook_packtool_pack only"):
        cls(**{**kwargs, "cooker_functions": [Cooker(lambda sample: sample)]})


def test_encoder_holds_nemo_rls_base_contract(stand_in_module, nemo_rl_packed):
    """Against the stand-in of NeMo-RL's base: the encoder instantiates with ``_task_encoder``'s keyword arguments
    (all abstract steps implemented), passes Energon's pre/post-encode assertion, and gives the batches it gives on
    Energon's default base."""
    cls = stand_in_module.PacktoolSFTTaskEncoder
    assert issubclass(cls, StandInSFTTaskEncoder) and not cls.__abstractmethods__
    kwargs = nemo_rl_encoder_kwargs(max_sequence_length=2048)
    encoder = cls(**kwargs)
    assert [c.cook.__name__ for c in encoder.cookers] == ["cook_packtool_pack"]
    got = loader_batches(nemo_rl_packed, encoder)
    want = loader_batches(nemo_rl_packed, loaded_encoder_class()(**nemo_rl_encoder_kwargs(max_sequence_length=2048)))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert a["source_ids"] == b["source_ids"]
        assert_batch_equal(a, {k: v for k, v in b.items() if isinstance(v, torch.Tensor)})


def test_control_the_stand_in_holds_nemo_rls_contract(stand_in_module, nemo_rl_packed):
    """Controls: the stand-in refuses what NeMo-RL's base refuses, so the test above can fail: an encoder without
    post-encode cannot be made; one that also overrides encode_sample (packtool's earlier encoder) fails Energon's
    assertion when the loader is built."""
    cls = stand_in_module.PacktoolSFTTaskEncoder
    kwargs = nemo_rl_encoder_kwargs(max_sequence_length=2048)

    class NoPost(StandInSFTTaskEncoder):
        def preencode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples

        def encode_batch(self, batch):
            return batch

    with pytest.raises(TypeError, match="abstract"):
        NoPost(cooker_functions=[])

    class AlsoEncodeSample(cls):
        def encode_sample(self, sample):
            return self.preencode_sample(sample)

    with pytest.raises(AssertionError, match="pre- and post-encode"):
        loader_batches(nemo_rl_packed, AlsoEncodeSample(**kwargs))


def test_encoder_loader_state_resumes(nemo_rl_packed):
    """The loader's saved state restores the same next batches (the encoder's steps are stateless)."""
    cls = loaded_encoder_class()
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)

    def loader():
        encoder = cls(**nemo_rl_encoder_kwargs(max_sequence_length=2048))
        return get_savable_loader(get_val_dataset(nemo_rl_packed, split_part="val", worker_config=wc, batch_size=1,
                                                  task_encoder=encoder))

    first = loader()
    it = iter(first)
    next(it)
    state = first.save_state_rank()
    rest = [b["source_ids"] for b in it]
    again = loader()
    again.restore_state_rank(state)
    assert rest and [b["source_ids"] for b in again] == rest


@pytest.mark.skipif(not os.environ.get("PACKTOOL_NEMO_RL_SRC"),
                    reason="set PACKTOOL_NEMO_RL_SRC to a folder holding NeMo-RL's nemo_rl package")
def test_nemo_rls_own_registry_builds_the_encoder(nemo_rl_packed, monkeypatch):
    """NeMo-RL's own code (its registry, model families and BaseSFTTaskEncoder from PACKTOOL_NEMO_RL_SRC) resolves
    the file-backed encoder and cooker the overlays configure, as ``_task_encoder`` does, and the encoder it builds
    gives batches through Energon's loader."""
    monkeypatch.syspath_prepend(os.environ["PACKTOOL_NEMO_RL_SRC"])
    for name in [n for n in sys.modules if n == "nemo_rl" or n.startswith(("nemo_rl.", "_nemo_rl_energon_component_"))]:
        monkeypatch.delitem(sys.modules, name)  # NeMo-RL's own modules, and the encoder file loaded on its base
    from nemo_rl.data.energon.multimodal import registry
    from nemo_rl.data.energon.multimodal.task_encoders.base import BaseSFTTaskEncoder

    cooker = registry.COOKER_REGISTRY.resolve_configured_for_model_family(
        name=None, python_file=nemo_rl.encoder_file(), object_name="cook_packtool_pack", model_family="nemotron")
    cls = registry.TASK_ENCODER_REGISTRY.resolve_configured_for_model_family(
        name=None, python_file=nemo_rl.encoder_file(), object_name="PacktoolSFTTaskEncoder", model_family="qwen")
    assert issubclass(cls, BaseSFTTaskEncoder) and not cls.__abstractmethods__
    kwargs = nemo_rl_encoder_kwargs(max_sequence_length=2048)
    kwargs["cooker_functions"] = [Cooker(cooker, has_subflavors={"packtool": 1})]
    batches = loader_batches(nemo_rl_packed, cls(**kwargs))
    samples, pad = samples_of(nemo_rl_packed), load_manifest(nemo_rl_packed)["pad_token_id"]
    assert batches
    for batch in batches:
        want = reference_packed_batch([[samples[k] for k in keys] for keys in batch["source_ids"]], 16, pad,
                                      capacity=2048)
        assert_batch_equal(batch, want)


def test_alignment_must_be_a_multiple_of_the_recipes():
    seg = fx.chat_segment("a", "q", "an answer")
    members = {**fx.pack_record([seg], pack_size=64, align=8, split="train"), "__key__": "train-000000000"}
    manifest = {"pad_token_id": fx.PAD_ID}
    with pytest.raises(FormatError, match="--align-for nemo-rl"):
        nemo_rl.nemo_rl_row(members, manifest, multiple=16)
    row = nemo_rl.nemo_rl_row(members, manifest, multiple=4)
    assert row.padded == [math.ceil(len(seg["tokens"]) / 4) * 4]


def test_nemotron_images_are_nemo_rls_visual_inputs(tmp_path):
    """A Nemotron Omni pack's images become `_process_media`'s pixel_values / imgs_sizes / num_frames."""
    from PIL import Image

    segments, images = [], []
    for i, (w, h, grid) in enumerate([(60, 90, (1, 4, 2)), (200, 120, (1, 6, 10)), (33, 47, (1, 2, 2))]):
        data = fx.image_bytes(w, h, i, "PNG")
        seg = fx.chat_segment(f"s{i}", "what?", "this.")
        seg["media"] = [{"bytes": data, "ext": "png", "token_offset": 1, "tokens": 0, "grid_thw": list(grid),
                         "width": w, "height": h}]
        segments.append(seg)
        images.append((Image.open(io.BytesIO(data)), grid))
    members = {**fx.pack_record(segments, pack_size=512, align=1, split="train"), "__key__": "train-000000000"}
    manifest = {"pad_token_id": fx.PAD_ID, "image_processor": {"family": "nemotron_omni", "patch_size": 16}}
    row = nemo_rl.nemo_rl_row(members, manifest)
    for index, (image, (_, gh, gw)) in enumerate(images):
        pixels, size = nemotron_image_inputs(image, (gw, gh))
        assert torch.allclose(row.media["pixel_values"][index][0], pixels, atol=1e-6)
        assert tuple(row.media["imgs_sizes"][index][0].tolist()) == size
    assert [n.tolist() for n in row.media["num_frames"]] == [[1], [1], [1]]
    # control: a resize to the transposed grid is not the same input
    pixels, _ = nemotron_image_inputs(images[1][0], (6, 10))
    assert pixels.shape != row.media["pixel_values"][1][0].shape
    batch = nemo_rl.nemo_rl_batch([row, row], fx.PAD_ID)  # per row: its items in placeholder order
    assert len(batch["pixel_values"]) == 2 and len(batch["pixel_values"][1]) == 3


# -- recipe overlays --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vlm_sft-qwen2.5-vl-energon-packtool.yaml",
                                  "vlm_sft-nemotron-omni-energon-packtool.yaml"])
def test_recipe_overlays_name_a_loadable_encoder(name, monkeypatch):
    """Each overlay's loader block follows NeMo-RL's configuration rules (``EnergonTaskEncoderConfig`` and
    ``EnergonCookerConfig`` in ``config.py``: a file-backed component has no name, a python_file and an
    object_name; ``_loader_config``: at least one cooker) and resolves to packtool's encoder and cooker."""
    overlay = yaml.safe_load((ROOT / "examples" / "nemo_rl" / name).read_text())
    energon = overlay["data"]["energon"]
    encoder, cookers = energon["task_encoder"], energon["cookers"]
    assert encoder["name"] is None and encoder["packing"] is None and energon["packing_buffer_size"] is None
    assert cookers and all(c["name"] is None for c in cookers)
    assert cookers[0]["has_subflavors"] == {"packtool": 1}
    env = "${oc.env:PACKTOOL_NEMO_RL_ENCODER}"
    assert encoder["python_file"] == env and cookers[0]["python_file"] == env
    assert loaded_encoder_class().__name__ == encoder["object_name"]
    assert resolve_file_backed(nemo_rl.encoder_file(), cookers[0]["object_name"], None)
    multiple = encoder["options"]["sequence_multiple"]
    assert multiple.startswith("${policy.make_sequence_length_divisible_by")
    done = subprocess.run([sys.executable, "-m", "packtool.runtime.nemo_rl"], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == nemo_rl.encoder_file()


def test_runtime_side_imports_nothing_of_the_build_side():
    code = ("import sys, packtool.runtime.nemo_rl; "
            "print([m for m in sys.modules if m.startswith('packtool.packer')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


# -- --preset nemo-rl-qwen-vl ------------------------------------------------------------------------------------
def nemo_rl_qwen_log(tok, messages: list[dict], *, add_eos: bool = True) -> tuple[list[int], list[int]]:
    """``get_formatted_message_log`` (``nemo_rl/data/llm_message_utils.py``) for text turns, then
    ``add_loss_mask_to_message_log(roles_to_train_on=["assistant"])``: each message's chunk is what the chat
    template adds after the rendering of the messages before it, the eos token is appended to the last chunk when
    it does not end with it (trailing newlines aside), and every token of an assistant chunk is a target."""
    ids: list[int] = []
    mask: list[int] = []
    previous = ""
    for i, message in enumerate(messages):
        text = tok.apply_chat_template(messages[:i + 1], tokenize=False, add_generation_prompt=False)
        start = next((k for k, (a, b) in enumerate(zip(previous, text)) if a != b), min(len(previous), len(text)))
        chunk = text[start:]
        if i == len(messages) - 1 and add_eos and tok.eos_token and not chunk.rstrip("\n").endswith(tok.eos_token):
            chunk += tok.eos_token
        new = tok(chunk, add_special_tokens=False)["input_ids"]
        ids += new
        mask += [int(message["role"] == "assistant")] * len(new)
        previous = text
    return ids, mask


def demo_text_samples(demo_dir):
    from packtool.packer.sources import open_source, read_raw_samples
    from packtool.packer.sources.conversation import conversation_adapter

    src = open_source(demo_dir / "dataset", ["train"])
    for shard in src.splits["train"]:
        for raw in read_raw_samples(src.root, shard, src.excluded_samples):
            conversation = conversation_adapter(raw.parts)
            if not conversation.media:
                yield raw, [{"role": m["role"], "content": m["content"]} for m in conversation.messages]


def test_qwen_preset_targets_equal_nemo_rls(demo_dir):
    """Under --preset nemo-rl-qwen-vl, tokens and targets of each demo text sample equal NeMo-RL's hf_multimodal
    message log with its assistant-role mask (the reply's role header and the newline after its end-of-turn token
    are targets); the first token is never a target in NeMo-RL's batch, nor here (it is the template's start)."""
    from packtool.packer.encoder import Encoder
    from packtool.settings import EncodeSettings

    samples = list(demo_text_samples(demo_dir))
    preset = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, preset="nemo-rl-qwen-vl"))
    plain = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    checked = differs = 0
    for (raw, messages), got, base in zip(samples, preset.encode_many([r for r, _ in samples]),
                                          plain.encode_many([r for r, _ in samples])):
        if got.status != "packed":
            continue
        ids, mask = nemo_rl_qwen_log(preset.tok, messages)
        assert got.tokens.tolist() == ids, raw.key
        mask[0] = 0  # prepare_packed_sft_batch
        assert got.targets.tolist() == mask, raw.key
        differs += base.targets.tolist() != mask  # control: packtool's default convention is not NeMo-RL's
        checked += 1
    assert checked >= 20 and differs == checked


def test_qwen_preset_with_images_equals_nemo_rls(demo_dir):
    """An image sample: the processor's expansion of each `<|image_pad|>` (n = the grid the folder's pixel bounds
    give / 4), inside the user chunk; the assistant chunk is the target."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from packtool.packer.encoder import Encoder
    from packtool.packer.sources import RawSample
    from packtool.settings import EncodeSettings

    sizes = [(60, 60), (90, 40)]
    turns = [{"role": "user", "content": "<image><image>Compare them."}, {"role": "assistant", "content": "Same."},
             {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
    raw = RawSample(key="k0", shard="shards/x.tar", index=0)
    parts = {"json": json.dumps({"messages": turns}).encode(),
             **{f"{i}.png": fx.image_bytes(w, h, i, "PNG") for i, (w, h) in enumerate(sizes)}}
    for name, data in parts.items():
        raw.parts[name], raw.ranges[name] = data, (0, len(data))
    enc = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, preset="nemo-rl-qwen-vl"))
    got = enc.encode_many([raw])[0]
    assert got.status == "packed", got.reason
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "Compare them."}]}, *turns[1:]]
    ids, mask = nemo_rl_qwen_log(enc.tok, messages)
    cfg = json.loads((demo_dir / "tokenizer" / "preprocessor_config.json").read_text())
    counts = iter(int(np.prod(smart_resize(h, w, 28, cfg["min_pixels"], cfg["max_pixels"]))) // 784
                  for w, h in sizes)
    pad = enc.family.tokens.image_token_id
    ids, mask = zip(*[(i, m) for i, m in zip(ids, mask) for _ in range(next(counts) if i == pad else 1)])
    mask = [0, *mask[1:]]
    assert got.tokens.tolist() == list(ids) and got.targets.tolist() == mask


# -- --preset nemo-rl-nemotron-omni ------------------------------------------------------------------------------
MM_MARKER = "\ue000"


def nemo_rl_reply(text: str, ultra: bool = False) -> str:
    """``_normalize_assistant_thinking`` (``nemotron_visual.py``), prompt format nemotron6-moe, trace format
    normalized (``ultra``: ``_clean_thinking_trace`` without the newline before ``</think>``, and the answer right
    after it)."""
    if "<think>" not in text and "</think>" not in text:
        return "<think></think>" + text.strip()
    inner = text[text.index("<think>") + 7:text.index("</think>")].strip()
    close = "</think>" if ultra else "\n</think>"
    text = text[:text.index("<think>")] + (f"<think>\n{inner}{close}" if inner else "<think></think>") + \
        text[text.index("</think>") + 8:]
    head, tail = text.split("</think>")
    return head + ("</think>" if ultra else "</think>\n") + tail.lstrip()


def nemo_rl_image_grids(sizes, available: int, *, min_patches=1024, max_patches=13312, patch=16, video_target=1024):
    """``_plan_visual_occurrences`` (``nemotron_visual.py``), no augmentation: a budget of ``available * 4`` patches
    (times the tubelet's 2 for video frames' share), each image's own grid scaled into its allowance (up to the
    minimum where it fits), sides rounded to 2, allowances shrunk together until the grids fit; a video frame
    (``(w, h, True)``) takes a tile of about ``video_target`` patches of its aspect, sides rounded to 2. Returns
    (grid_h, grid_w) per image and frame."""
    videos = sum(len(s) == 3 for s in sizes)
    budget = available * 4
    if videos:
        budget = budget * 2 if videos == len(sizes) else int(budget * ((len(sizes) - videos) / len(sizes)
                                                                        + videos / len(sizes) * 2))
    budget = max(budget, min_patches * len(sizes))
    allow = [max(min(budget, max_patches), min_patches)] * len(sizes)
    for _ in range(10):
        grids = []
        for (w, h, *video), a in zip(sizes, allow):
            if video:
                th = max(1, round(math.sqrt(video_target / (w / h))))
                tw = max(1, round(math.sqrt(video_target * w / h)))
                uh, uw = th + th % 2, tw + tw % 2
                grids.append((uh, uw) if uh * uw <= video_target else (max(2, th - th % 2), max(2, tw - tw % 2)))
                continue
            ch, cw = round(h / patch + 0.5), round(w / patch + 0.5)
            f = min(math.sqrt(a / (ch * cw)), 1.0)
            th, tw = math.floor(f * ch), math.floor(f * cw)
            if a > min_patches and th * tw < min_patches:
                u = math.sqrt(min_patches / max(th * tw, 1))
                if a > math.ceil(u * th) * math.ceil(u * tw):
                    th, tw = math.ceil(u * th), math.ceil(u * tw)
            if th % 2:
                th = th + 1 if (th + 1) * tw <= a else max(2, th - 1)
            if tw % 2:
                tw = tw + 1 if th * (tw + 1) <= a else max(2, tw - 1)
            grids.append((th, tw))
        total = sum(h * w for h, w in grids)
        if total <= budget:
            break
        scaled = [max(min_patches, int(h * w * budget / total)) for h, w in grids]
        allow = scaled if any(s < o for s, o in zip(scaled, allow)) else [min_patches] * len(sizes)
    return grids


def nemo_rl_video_seconds(duration: float, frames: int) -> list[float]:
    """``_select_video_frames`` (``nemotron_visual.py``) with its defaults (8 to 32 frames, 2 fps, tubelets of 2, no
    augmentation or jitter): the count, made even within the source's frames, and the segment centres of
    ``duration - 1`` seconds, in float32."""
    n = frames if frames < 8 else min(max(int(2 * duration), 8), 32)
    if n % 2:
        n = n + 1 if n + 1 <= frames and n + 1 <= 32 else max(2, n - 1)
    centres = np.float32((duration - 1) / n) * (np.arange(n, dtype=np.float32) + np.float32(0.5))
    return [float(c) for c in centres]


def nemo_rl_video_prompt(seconds: list[float], placeholder: str) -> str:
    """``_video_prompt`` (``nemotron_visual.py``): a header line, a line per pair of frames, a trailing newline."""
    text = "This is a video:"
    for i in range(0, len(seconds), 2):
        pair = [f"{'Frame' if k == i else 'frame'} {k + 1} sampled at {seconds[k]:.2f} seconds"
                for k in range(i, min(i + 2, len(seconds)))]
        text += "\n" + " and ".join(pair) + ": " + placeholder
    return text + "\n"


def nemo_rl_video_metadata(data: bytes) -> tuple[float, int]:
    """``_derived_media_metadata`` (``cookers/nemotron.py``) for a video: Energon's ``AVDecoder.get_metadata``."""
    from megatron.energon.av import AVDecoder

    meta = AVDecoder(io.BytesIO(data)).get_metadata()
    return meta.video_duration, meta.video_num_frames


def nemo_rl_video_inputs(data: bytes, seconds: list[float], grid: tuple[int, int], patch_dim: int = 16):
    """``_process_media`` with ``_decode_video_clips`` (``nemotron_visual.py``) for one video: Energon's
    ``get_clips`` at each second, the first frame of each clip (the last repeated for a short decode), torchvision's
    ``ToPILImage``, PIL resize, CLIP mean/std; ``imgs_sizes`` per frame and ``num_frames``."""
    from megatron.energon.av import AVDecoder
    from PIL import Image
    from torchvision.transforms import ToPILImage

    clips = list(AVDecoder(io.BytesIO(data)).get_clips(video_clip_ranges=[(t, t) for t in seconds],
                                                       video_unit="seconds").video_clips)
    clips += [clips[-1]] * (len(seconds) - len(clips))
    pictures = [ToPILImage()(clip[0]).convert("RGB") for clip in clips]
    pixels = torch.stack([nemotron_image_inputs(p, (grid[1], grid[0]), patch_dim)[0] for p in pictures])
    assert all(isinstance(p, Image.Image) for p in pictures)
    sizes = torch.tensor([[grid[0] * patch_dim, grid[1] * patch_dim]] * len(seconds), dtype=torch.int32)
    return pixels, sizes, torch.tensor([len(seconds)])


def nemo_rl_audio_clips(samples: int, rate: int, target: int = 16000, hop: int = 160, factor: int = 8):
    """``_audio_plan`` (``nemotron_multimodal.py``) with its defaults (30 s clips, 0.1 s minimum): samples per clip
    at the target rate, valid mel frames (samples // hop) and ``<so_embedding>`` tokens per clip."""
    total = round(max(0.1, samples / rate) * target)
    clip = 30 * target
    per = [clip] * (math.ceil(total / clip) - 1) + [clip if total % clip == 0 else max(total % clip, 1600)]
    frames = [n // hop for n in per]
    tokens = []
    for f in frames:
        for _ in range(int(math.log2(factor))):
            f = (f + 1) // 2
        tokens.append(max(1, f))
    return per, frames, tokens


def nemo_rl_nemotron_sample(tok, messages: list[dict], sizes, max_len: int, audio=(), videos=(), ultra=False):
    """NeMo-RL's nemotron_multimodal (``NemotronMultiModalProcessorAdapter.preencode`` and ``postencode``): replies
    normalised; each image part rendered ``<img>`` + marker + ``</img>``, each video part as ``_video_prompt`` with
    one marker per pair of frames (``videos``: (width, height, seconds of its frames)); the chat template's text
    encoded piece by piece with the image token spliced at each marker (``_encode_with_marker_splices``); targets
    each reply after its ``<|im_start|>assistant\\n`` header through its ``<|im_end|>``
    (``tokenize_nemotron_conversation``, nemotron6-moe, with this tokenizer's ids); one image budget from
    ``max_len - tokens - 4`` shared with the video frames; each marker expanded to its image's or pair's tokens
    (``_expand_visual_placeholders``); the first token's loss dropped (``prepare_packed_sft_batch``)."""
    import re

    rendered, kinds, video_items = [], [], iter(videos)
    for m in messages:
        text = m["content"]
        if m["role"] == "assistant":
            text = nemo_rl_reply(text, ultra)
        text = text.replace("<audio>", "<so_start><so_embedding><so_end>")
        out = ""
        for piece in re.split("(<image>|<video>)", text):
            if piece == "<image>":
                out += f"<img>{MM_MARKER}</img>"
                kinds.append(("image", None))
            elif piece == "<video>":
                width, height, seconds = next(video_items)
                out += nemo_rl_video_prompt(seconds, f"<img>{MM_MARKER}</img>")
                kinds.append(("video", (width, height, len(seconds))))
            else:
                out += piece
        rendered.append({"role": m["role"], "content": out})
    text = tok.apply_chat_template(rendered, tokenize=False)
    image_id = tok.convert_tokens_to_ids("<image>")
    ids: list[int] = []
    for i, piece in enumerate(text.split(MM_MARKER)):
        ids += tok.encode(piece, add_special_tokens=False) if piece else []
        ids += [image_id] if i < text.count(MM_MARKER) else []
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end, newline = tok.convert_tokens_to_ids("<|im_end|>"), tok.encode("\n", add_special_tokens=False)[0]
    mask = [0] * len(ids)
    for p in range(len(ids) - len(header) + 1):
        if ids[p:p + len(header)] == header:
            upper = ids.index(end, p + len(header))
            assert ids[upper + 1] == newline
            mask[p + len(header):upper + 1] = [1] * (upper + 1 - p - len(header))
    sound = tok.convert_tokens_to_ids("<so_embedding>")  # _expand_audio_placeholders, before the image budget
    counts = iter(sum(nemo_rl_audio_clips(n, rate)[2]) for n, rate in audio)
    ids, mask = map(list, zip(*[(i, k) for i, k in zip(ids, mask) for _ in range(next(counts) if i == sound else 1)]))
    image_sizes = iter(sizes)
    frames = [f for kind, v in kinds for f in ([next(image_sizes)] if kind == "image" else [(v[0], v[1], True)] * v[2])]
    grids = nemo_rl_image_grids(frames, max_len - len(ids) - 4)
    widths, position = [], 0
    for kind, v in kinds:
        step = 1 if kind == "image" else v[2]
        widths += [h * w // 4 for h, w in grids[position:position + step:2 if kind == "video" else 1]]
        position += step
    width_of = iter(widths)
    ids, mask = map(list, zip(*[(i, k) for i, k in zip(ids, mask) for _ in range(next(width_of) if i == image_id
                                                                                    else 1)]))
    mask[0] = 0
    return ids, mask, [g for g, f in zip(grids, frames) if len(f) == 2]


def nemo_rl_sound_inputs(data: bytes, extractor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_process_audio`` (``nemotron_multimodal.py``) for a mono source at the extractor's rate: the waveform
    (int16 / 32768) padded to 0.1 s and to its plan, split into 30 s clips, each clip's planned samples through the
    feature extractor; ``sound_clips`` zero-padded to the longest clip's mel frames, ``sound_length`` the valid
    frames."""
    import wave as wavfile

    with wavfile.open(io.BytesIO(data)) as f:
        assert f.getsampwidth() == 2 and f.getnchannels() == 1
        rate = f.getframerate()
        wave = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    per, frames, _ = nemo_rl_audio_clips(len(wave), rate)
    wave = np.pad(wave, (0, max(0, sum(per) - len(wave))))[:sum(per)]
    mels, valid, start = [], [], 0
    for n in per:
        out = extractor(wave[start:start + n], sampling_rate=rate, return_tensors="pt", return_attention_mask=True)
        mels.append(out["input_features"][0])
        valid.append(int(out["attention_mask"].sum()))
        start += n
    assert valid == frames
    clips = torch.zeros((len(mels), max(m.shape[0] for m in mels), mels[0].shape[1]))
    for i, mel in enumerate(mels):
        clips[i, :mel.shape[0]] = mel
    return clips, torch.tensor(valid, dtype=torch.long)


def raw_sample(key: str, turns: list[dict], images: list[bytes], audio: list[bytes] = (),
               videos: list[tuple[str, bytes]] = ()):
    from packtool.packer.sources import RawSample

    raw = RawSample(key=key, shard="shards/x.tar", index=0)
    parts = {"json": json.dumps({"messages": turns}).encode(), **{f"{i}.jpg": b for i, b in enumerate(images)},
             **{f"{i}.wav": b for i, b in enumerate(audio)}, **{f"v{i}.{e}": b for i, (e, b) in enumerate(videos)}}
    for name, data in parts.items():
        raw.parts[name], raw.ranges[name] = data, (0, len(data))
    return raw


@pytest.fixture(scope="module")
def nemotron_folder(tmp_path_factory) -> Path:
    import nemotron_omni_model

    return nemotron_omni_model.write_model_folder(tmp_path_factory.mktemp("nemotron") / "model")


def test_nemotron_preset_equals_nemo_rls_images_audio_and_replies(nemotron_folder):
    """Images of several sizes with short and long texts, several images sharing one budget, audio shorter and
    longer than 30 s (and at another rate), replies with and without a thinking trace: tokens, targets, grids and
    audio lengths equal NeMo-RL's for each sample; a control without the preset differs."""
    import mediafixture as mf
    from packtool.packer.encoder import Encoder
    from packtool.settings import EncodeSettings

    words = " ".join(f"word{i % 97}" for i in range(900))
    cases = [  # (user text, reply, image sizes)
        ("<image>What is this?", "A cat.", [(60, 90)]),
        ("<image>Describe it.", "<think>It has stripes.\n</think>  A zebra.", [(1600, 1200)]),
        (f"<image>{words}\nSummarise.", "<think> </think>Words.", [(1600, 1200)]),
        ("<image><image><image><image>Compare.", "Similar.", [(1600, 1200), (1000, 1500), (300, 200), (1200, 1600)]),
        (f"{words[:3000]} <image> and <image>?", "<think>\nhmm\n</think>\nNo.", [(1600, 1200), (1400, 1000)]),
        ("Just text.", "<think>Thinking.</think>Answer.", []),
        ("<audio>Transcribe.", "Hello.", [], [(3 * 16000, 16000)]),  # audio shorter and longer than 30 s
        ("<audio><image>Both?", "<think>\nyes\n</think>Yes.", [(1600, 1200)], [(65 * 16000 + 123, 16000)]),
        ("<audio>Rate?", "Fine.", [], [(2 * 22050 + 7, 22050)]),
    ]
    raws, expected = [], []
    for i, (question, reply, sizes, *rest) in enumerate(cases):
        audio = rest[0] if rest else []
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        raws.append(raw_sample(f"s{i}", turns, [fx.image_bytes(w, h, i * 10 + k) for k, (w, h) in enumerate(sizes)],
                               [mf.make_audio("wav", samples=n, rate=r) for n, r in audio]))
        expected.append((turns, sizes, audio))
    settings = dict(tokenizer=str(nemotron_folder), pack_size=4096)
    preset = Encoder(EncodeSettings(**settings, preset="nemo-rl-nemotron-omni"))
    plain = Encoder(EncodeSettings(**settings))
    budget_bound = differs = 0
    for (turns, sizes, audio), got, base in zip(expected, preset.encode_many(raws), plain.encode_many(raws)):
        assert got.status == "packed", got.reason
        ids, mask, grids = nemo_rl_nemotron_sample(preset.tok, turns, sizes, 4096, audio, ultra=True)
        assert got.tokens.tolist() == ids
        targets = got.targets.tolist()
        targets[0] = 0
        assert targets == mask
        assert [list(m.grid_thw) for m in got.media if m.kind == "image"] == [[1, h, w] for h, w in grids]
        assert [m.samples for m in got.media if m.kind == "audio"] == [
            sum(nemo_rl_audio_clips(n, r)[0]) for n, r in audio]
        differs += base.tokens.tolist() != ids  # control: transformers' convention is not NeMo-RL's
        budget_bound += [m.grid_thw for m in got.media] != [m.grid_thw for m in base.media]
    assert differs >= len(cases) - 2  # (a reply already in NeMo-RL's layout, images that fit both ways, ...)
    assert budget_bound >= 3  # the text-dependent, shared budget changed grids, not only the replies


def test_nemotron_preset_thinking_trace_format(nemotron_folder, tmp_path):
    """``--thinking-trace-format ultra`` renders replies as NeMo-RL's ``ultra`` (``...</think>Yes``); normalized is the
    control that differs; the setting is refused off the preset; the encoder refuses a recipe value other than the
    packs'."""
    from packtool.errors import ConfigError
    from packtool.packer.encoder import Encoder
    from packtool.settings import EncodeSettings

    turns = [{"role": "user", "content": "Is it?"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\nYes"}]
    raw = raw_sample("t", turns, [])
    settings = dict(tokenizer=str(nemotron_folder), pack_size=4096, preset="nemo-rl-nemotron-omni")
    ultra = Encoder(EncodeSettings(**settings, thinking_trace_format="ultra")).encode_many([raw])[0]
    normal = Encoder(EncodeSettings(**settings, thinking_trace_format="normalized")).encode_many([raw])[0]
    enc = Encoder(EncodeSettings(**settings))
    want_ultra, _, _ = nemo_rl_nemotron_sample(enc.tok, turns, [], 4096, ultra=True)
    want_normal, _, _ = nemo_rl_nemotron_sample(enc.tok, turns, [], 4096)
    assert ultra.tokens.tolist() == want_ultra and normal.tokens.tolist() == want_normal
    assert want_ultra != want_normal and "</think>Yes" in enc.tok.decode(want_ultra)
    with pytest.raises(ConfigError, match="thinking_trace_format"):
        EncodeSettings(tokenizer=str(nemotron_folder), pack_size=4096, thinking_trace_format="ultra")
    with pytest.raises(ConfigError, match="thinking_trace_format"):
        EncodeSettings(**settings, thinking_trace_format="compact")  # type: ignore[arg-type]
    nemotron = {"image_processor": {"family": "nemotron_omni"}}  # what owns a manifest for the family
    manifest = {**nemotron, "settings": {"preset": "nemo-rl-nemotron-omni", "thinking_trace_format": "ultra"}}
    nemo_rl.check_thinking_trace_format(manifest, "ultra")
    nemo_rl.check_thinking_trace_format(manifest, None)
    with pytest.raises(FormatError, match="--thinking-trace-format normalized"):
        nemo_rl.check_thinking_trace_format(manifest, "normalized")
    with pytest.raises(FormatError, match="--thinking-trace-format ultra"):
        nemo_rl.check_thinking_trace_format({**nemotron, "settings": {"preset": "nemo-rl-nemotron-omni"}}, "ultra")
    with pytest.raises(FormatError, match="without --preset"):
        nemo_rl.check_thinking_trace_format({"settings": {}}, "normalized")
    with pytest.raises(FormatError, match="without --preset nemo-rl-nemotron-omni"):  # the family's, another preset
        nemo_rl.check_thinking_trace_format({**nemotron, "settings": {}}, "normalized")
    with pytest.raises(ValueError, match="prompt_format"):
        loaded_encoder_class()(**nemo_rl_encoder_kwargs(max_sequence_length=2048,
                                                        options={"prompt_format": "nemotron5"}))


def test_nemotron_preset_refuses_what_it_cannot_do_yet(nemotron_folder, demo_dir):
    from packtool.errors import ConfigError
    from packtool.packer.encoder import Encoder
    from packtool.settings import EncodeSettings

    with pytest.raises(ConfigError, match="is for nemotron_omni model folders"):
        Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=4096, preset="nemo-rl-nemotron-omni"))
    enc = Encoder(EncodeSettings(tokenizer=str(nemotron_folder), pack_size=4096, preset="nemo-rl-nemotron-omni"))
    bad = raw_sample("b", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>a<think>b"}],
                     [])
    got = enc.encode_many([bad])[0]
    assert got.status == "error" and "<think>" in got.reason
    # NeMo-RL refuses videos longer than 600 s (`_video_selections`, without allow_large_videos)
    import mediafixture as mf

    turns = [{"role": "user", "content": "<video>Long?"}, {"role": "assistant", "content": "Yes."}]
    long = raw_sample("l", turns, [], videos=[("mp4", mf.make_video("mp4", width=16, height=16, frames=601, fps=1))])
    got = enc.encode_many([long])[0]
    assert got.status == "error" and "600 s" in got.reason


def test_nemotron_preset_pack_verify_and_batch(nemotron_folder, tmp_path):
    """`pack --preset nemo-rl-nemotron-omni` end to end: verify re-derives each image's grid from NeMo-RL's budget
    (control: the same packs read as transformers' convention fail), and the NeMo-RL batch's pixel_values /
    imgs_sizes / num_frames equal `_process_media` of each image at NeMo-RL's grid."""
    from PIL import Image

    import mediafixture as mf
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings
    from packtool.verify.packs import verify_output

    words = " ".join(f"word{i % 97}" for i in range(700))
    cases = {"small": ("<image>What?", "A dot.", [(60, 90)], []),
             "long": (f"<image>{words}", "<think>Long.</think>Yes.", [(1600, 1200)], []),
             "many": ("<image><image><image>Same?", "No.", [(1600, 1200), (1200, 1600), (500, 300)], []),
             "audio": ("<audio> and <audio>?", "Two.", [], [3 * 16000 + 5, 35 * 16000 + 77])}
    samples = {}
    waves = []
    for key, (question, reply, sizes, audio) in cases.items():
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        samples[key] = {"json": json.dumps({"messages": turns}).encode(),
                        **{f"{i}.png": mf.make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)},
                        **{f"{i}.wav": mf.make_audio("wav", samples=n, rate=16000) for i, n in enumerate(audio)}}
        waves += [samples[key][f"{i}.wav"] for i in range(len(audio))]
    mf.write_source(tmp_path / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(nemotron_folder), pack_size=4096, align=16,
                                           preset="nemo-rl-nemotron-omni", thinking_trace_format="ultra"),
                            PlanSettings(shard_size="8"))
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    assert verify_output(tmp_path / "out", source=tmp_path / "src") == []  # re-derived with the recorded format

    from transformers import AutoProcessor

    from packtool.families.nemotron_omni.reader import nemotron_processors

    manifest = load_manifest(tmp_path / "out")
    assert manifest["settings"]["thinking_trace_format"] == "ultra"
    processors = nemotron_processors(manifest, tmp_path / "out" / ".nv-meta" / "tokenizer")
    extractor = AutoProcessor.from_pretrained(nemotron_folder).feature_extractor  # what NeMo-RL's adapter holds
    checked = heard = 0
    for shard in sorted((tmp_path / "out" / "train").glob("*.tar")):
        for key, members in scan_records(shard):
            row = nemo_rl.nemo_rl_row({**members, "__key__": key}, manifest, image_processor=processors)
            refs = [m for s in PackRecord.from_members(key, members).segments for m in s.media]
            images = [(m, members[m.member]) for m in refs if m.kind == "image"]
            for index, (ref, data) in enumerate(images):
                pixels, size = nemotron_image_inputs(Image.open(io.BytesIO(data)), (ref.grid_thw[2], ref.grid_thw[1]))
                assert torch.allclose(row.media["pixel_values"][index][0], pixels, atol=1e-5)
                assert tuple(row.media["imgs_sizes"][index][0].tolist()) == size
                checked += 1
            for index, ref in enumerate(m for m in refs if m.kind == "audio"):
                clips, lengths = nemo_rl_sound_inputs(members[ref.member], extractor)
                assert torch.equal(row.media["sound_clips"][index], clips)
                assert torch.equal(row.media["sound_length"][index], lengths)
                heard += 1
    assert checked == 5 and heard == 2
    # through Energon, the task encoder gives the same media (the processors from OUTPUT's model folder copy)
    rows = {row.pack_key: row for row in (
        nemo_rl.nemo_rl_row({**m, "__key__": k}, manifest, image_processor=processors)
        for shard in sorted((tmp_path / "out" / "train").glob("*.tar")) for k, m in scan_records(shard))}
    with pytest.raises(Exception, match="thinking_trace_format 'normalized'"):  # the recipe's value must be the packs'
        next(iter(nemo_rl_loader(tmp_path / "out", 1, split="train", thinking_trace_format="normalized")))
    for batch in nemo_rl_loader(tmp_path / "out", 1, split="train", thinking_trace_format="ultra"):
        row = next(r for r in rows.values() if r.keys == batch["source_ids"][0])
        for key, segments in row.media.items():
            assert all(torch.equal(a, b) for a, b in zip(batch[key][0], segments)), key

    # control: the same packs checked as transformers' convention (preset and convention record removed) fail
    path = tmp_path / "out" / ".nv-meta" / "packtool.json"
    data = json.loads(path.read_text())
    data["settings"]["preset"] = None
    path.write_text(json.dumps(data))
    assert verify_output(tmp_path / "out") == []  # the family's variant is the recorded convention's, not the preset's
    del data["convention"]
    path.write_text(json.dumps(data))
    problems = verify_output(tmp_path / "out")
    assert problems and all("image rule gives grid" in p for p in problems), problems[:3]


#: Videos of the video tests: (container, width, height, frames, fps): 3 s (8 frames taken), 10 s (20), 20 s (32),
#: a WebM of 2 s whose Energon duration is 1.999 s, 5 frames (fewer than 8: 4 taken), 10 s at another size.
VIDEOS = {"short": ("mp4", 64, 48, 30, 10), "ten": ("mp4", 160, 90, 50, 5), "long": ("mp4", 48, 80, 80, 4),
          "webm": ("webm", 64, 48, 48, 24), "few": ("mp4", 64, 48, 5, 4), "wide": ("mp4", 96, 64, 250, 25)}


def video_bytes(name: str) -> tuple[str, bytes]:
    import mediafixture as mf

    ext, width, height, frames, fps = VIDEOS[name]
    return ext, mf.make_video(ext, width=width, height=height, frames=frames, fps=fps)


def test_nemotron_preset_videos_equal_nemo_rls(nemotron_folder):
    """Videos shorter than 4 s, of ~10 s and long enough for 32 frames, of several sizes, alone, two in a sample
    and with images: tokens (header line, frame labels, one tile per pair of frames, trailing newline), targets,
    video grids and the image grids their frames share a budget with equal NeMo-RL's for each sample; a control
    without the preset (transformers' frame rule and labels) differs."""
    from packtool.packer.encoder import Encoder
    from packtool.settings import EncodeSettings

    words = " ".join(f"word{i % 97}" for i in range(150))
    cases = [  # (user text, reply, image sizes, videos)
        ("<video>What happens?", "It moves.", [], ["short"]),
        ("<video>Describe it.", "<think>Colours.</think>Moving colours.", [], ["ten"]),
        ("Watch: <video>", "Done.", [], ["long"]),
        ("<image><video><image>Compare.", "Same.", [(1600, 1200), (800, 600)], ["webm"]),
        ("<video> and <video>?", "Two.", [], ["few", "wide"]),
        (f"{words}<video><image>Sum up.", "Fine.", [(1600, 1200)], ["ten"]),
    ]
    raws, expected = [], []
    for i, (question, reply, sizes, names) in enumerate(cases):
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        videos = [video_bytes(n) for n in names]
        raws.append(raw_sample(f"v{i}", turns, [fx.image_bytes(w, h, i * 10 + k) for k, (w, h) in enumerate(sizes)],
                               videos=videos))
        expected.append((turns, sizes, [(VIDEOS[n][1], VIDEOS[n][2], nemo_rl_video_seconds(*nemo_rl_video_metadata(b)))
                                        for n, (_, b) in zip(names, videos)]))
    settings = dict(tokenizer=str(nemotron_folder), pack_size=8192)  # 32 frames take ~4000 tokens
    preset = Encoder(EncodeSettings(**settings, preset="nemo-rl-nemotron-omni"))
    plain = Encoder(EncodeSettings(**settings))
    differs = taken = 0
    for (turns, sizes, videos), got, base in zip(expected, preset.encode_many(raws), plain.encode_many(raws)):
        assert got.status == "packed", got.reason
        ids, mask, grids = nemo_rl_nemotron_sample(preset.tok, turns, sizes, 8192, videos=videos, ultra=True)
        assert got.tokens.tolist() == ids
        targets = got.targets.tolist()
        targets[0] = 0
        assert targets == mask
        assert [list(m.grid_thw) for m in got.media if m.kind == "image"] == [[1, h, w] for h, w in grids]
        want = [[len(s), *nemo_rl_image_grids([(w, h, True)], 0)[0]] for w, h, s in videos]
        assert [list(m.grid_thw) for m in got.media if m.kind == "video"] == want
        taken += sum(len(s) for *_, s in videos)
        differs += base.tokens.tolist() != ids  # control: transformers' convention is not NeMo-RL's
    assert differs == len(cases)
    assert taken == 8 + 20 + 32 + 8 + 4 + 20 + 20


def test_nemotron_preset_video_pack_verify_and_batch(nemotron_folder, tmp_path):
    """`pack --preset nemo-rl-nemotron-omni` with videos: verify re-derives each video's frames, grid and tokens
    from Energon's metadata (control: the same packs checked as transformers' convention fail), and the NeMo-RL
    batch's pixel_values / imgs_sizes / num_frames equal `_process_media` of each video and image in placeholder
    order (control: frames taken half a segment later are other pixels)."""
    from PIL import Image

    import mediafixture as mf
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings
    from packtool.verify.packs import verify_output

    cases = {"short": ("<video>What?", "Colours.", [], ["short"]),
             "mixed": ("<image><video>Same?", "No.", [(1600, 1200)], ["ten"]),
             "long": ("<video><video>Both?", "Yes.", [], ["long", "webm"])}
    samples = {}
    for key, (question, reply, sizes, names) in cases.items():
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        samples[key] = {"json": json.dumps({"messages": turns}).encode(),
                        **{f"{i}.png": mf.make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)},
                        **{f"v{i}.{ext}": data for i, (ext, data) in enumerate(video_bytes(n) for n in names)}}
    mf.write_source(tmp_path / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(nemotron_folder), pack_size=8192, align=16,
                                           preset="nemo-rl-nemotron-omni"), PlanSettings(shard_size="8"))
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    assert verify_output(tmp_path / "out", source=tmp_path / "src") == []

    manifest = load_manifest(tmp_path / "out")
    seen = {"image": 0, "video": 0}
    shifted = 0
    for shard in sorted((tmp_path / "out" / "train").glob("*.tar")):
        for key, members in scan_records(shard):
            row = nemo_rl.nemo_rl_row({**members, "__key__": key}, manifest)
            refs = [m for s in PackRecord.from_members(key, members).segments for m in s.media]
            assert len(row.media["pixel_values"]) == len(refs)
            for index, ref in enumerate(refs):
                data = members[ref.member]
                if ref.kind == "image":
                    pixels, size = nemotron_image_inputs(Image.open(io.BytesIO(data)),
                                                         (ref.grid_thw[2], ref.grid_thw[1]))
                    want = (pixels[None], torch.tensor([size], dtype=torch.int32), torch.tensor([1]))
                else:
                    seconds = nemo_rl_video_seconds(*nemo_rl_video_metadata(data))
                    want = nemo_rl_video_inputs(data, seconds, tuple(ref.grid_thw[1:]))
                    later = [t + (seconds[1] - seconds[0]) / 2 for t in seconds]
                    other = nemo_rl_video_inputs(data, later, tuple(ref.grid_thw[1:]))[0]
                    shifted += not torch.allclose(other, row.media["pixel_values"][index], atol=1e-5)
                assert torch.allclose(row.media["pixel_values"][index], want[0], atol=1e-5)
                assert torch.equal(row.media["imgs_sizes"][index], want[1])
                assert row.media["num_frames"][index].tolist() == want[2].tolist()
                seen[ref.kind] += 1
    assert seen == {"image": 1, "video": 4} and shifted == 4
    # through Energon, the task encoder gives the same media
    loaded = 0
    for batch in nemo_rl_loader(tmp_path / "out", 1, split="train"):
        key = next(k for k, m in (kv for shard in sorted((tmp_path / "out" / "train").glob("*.tar"))
                                  for kv in scan_records(shard))
                   if [s.key for s in PackRecord.from_members(k, m).segments] == batch["source_ids"][0])
        members = next(m for shard in sorted((tmp_path / "out" / "train").glob("*.tar"))
                       for k, m in scan_records(shard) if k == key)
        row = nemo_rl.nemo_rl_row({**members, "__key__": key}, manifest)
        for name, segments in row.media.items():
            assert all(torch.equal(a, b) for a, b in zip(batch[name][0], segments)), name
            loaded += len(segments)
    assert loaded == 3 * 5  # pixel_values, imgs_sizes, num_frames of 1 image and 4 videos
    # packtool's own reader, which takes frames by number, says where such videos are read
    from packtool.runtime.read import read_packs

    with pytest.raises(FormatError, match="NeMo-RL's task encoder"):
        list(read_packs(tmp_path / "out", split="train"))

    # control: the same packs checked as transformers' convention (preset and convention record removed) fail
    path = tmp_path / "out" / ".nv-meta" / "packtool.json"
    data = json.loads(path.read_text())
    data["settings"]["preset"] = None
    del data["convention"]  # the variant is the recorded convention's, whatever the settings' preset says
    path.write_text(json.dumps(data))
    problems = verify_output(tmp_path / "out")
    assert sum("video rule gives" in p for p in problems) == 4, problems[:3]


def test_transparent_palette_and_cmyk_images_read_as_the_trainers_decoder(demo_dir, tmp_path):
    """Under a trainer preset the reader feeds its processor each image as the trainer's Energon decoder (pilrgb)
    gives it, ``convert("RGB")``: alpha dropped without compositing, palette and CMYK converted by PIL. Control: the
    same images handed over as stored (the processor composites alpha onto white) give other pixel values."""
    from PIL import Image

    import mediafixture as mf
    from packtool.packer.pipeline import pack
    from packtool.runtime.read import processor_for_output, read_packs
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (64, 96, 4), dtype=np.uint8), "RGBA")
    palette = Image.fromarray(rng.integers(0, 256, (80, 56, 3), dtype=np.uint8)).convert("P")
    palette.info["transparency"] = 0
    cmyk = Image.fromarray(rng.integers(0, 256, (72, 72, 4), dtype=np.uint8), "CMYK")

    def encoded(image, fmt):
        buf = io.BytesIO()
        image.save(buf, format=fmt)
        return buf.getvalue()

    members = {"0.png": encoded(rgba, "PNG"), "1.png": encoded(palette, "PNG"), "2.jpg": encoded(cmyk, "JPEG")}
    turns = [{"role": "user", "content": "<image><image><image>What?"}, {"role": "assistant", "content": "Noise."}]
    mf.write_source(tmp_path / "src", {"s0": {"json": json.dumps({"messages": turns}).encode(), **members}})
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=4096,
                                           preset="nemo-rl-qwen-vl"), PlanSettings())
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    (batch,) = list(read_packs(tmp_path / "out", split="train"))
    proc = processor_for_output(tmp_path / "out", load_manifest(tmp_path / "out"))
    stored = [Image.open(io.BytesIO(members[name])) for name in sorted(members)]
    want = proc(images=[im.convert("RGB") for im in stored], return_tensors="pt")["pixel_values"]
    assert torch.allclose(batch["pixel_values"], want.float(), atol=1e-6)
    control = proc(images=stored, return_tensors="pt")["pixel_values"]
    assert not torch.allclose(batch["pixel_values"], control.float(), atol=1e-3)


def test_a_processor_mode_pack_refuses_nemotron_recipe_options():
    """Packs of the processor mode (no registered family of their own) refuse a recipe's Nemotron Omni option in one
    line, as packs of any family other than Nemotron Omni do."""
    manifest = {"image_processor": {"family": "processor"}, "settings": {"pack_size": 4096}}
    with pytest.raises(FormatError, match="patch_dim 16, a Nemotron Omni option, but the packs were made for a "
                                          "processor model folder"):
        nemo_rl.check_packed_recipe_options(manifest, {"patch_dim": 16})
