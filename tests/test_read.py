"""Reader fields against a loop-by-loop reference, plus the loaders, Megatron hand-off and `inspect`."""

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import packfixture as fx
from packtool.errors import FormatError
from packtool.families.qwen2_vl.reader import mrope_position_ids
from packtool.families.reading import VisionMedia
from packtool.format import load_manifest
from packtool.readkit import ReaderBatch
from packtool.runtime.loader import PackDataset, PackTaskEncoder, collate_packs
from packtool.runtime.megatron_batch import to_megatron
from packtool.runtime.read import pack_to_batch, read_packs
from packtool.verify.inspect import inspect_pack

MANIFEST = {"pad_token_id": fx.PAD_ID, "image_token_id": fx.IMAGE_PAD_ID, "image_processor": None}


def reference(tokens, targets, seqlens, *, align, pack_size, pad_to, pad_id=fx.PAD_ID):
    """The reader contract (docs/reader.md) written out token by token."""
    tok, lab, pos, pad, cu, cu_padded, start = [], [], [], [], [0], [0], 0
    for n in seqlens:
        seg, tgt = tokens[start:start + n], targets[start:start + n]
        padded = n
        while padded % align:
            padded += 1
        for j in range(padded):
            real = j < n
            tok.append(seg[j] if real else pad_id)
            lab.append(seg[j + 1] if real and j + 1 < n and tgt[j + 1] else -100)
            pos.append(j)
            pad.append(not real)
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + padded)
        start += n
    if pad_to == "pack":
        length = pack_size - pack_size % align
        while len(tok) < length:
            tok.append(pad_id), lab.append(-100), pos.append(pos[-1] + 1), pad.append(True)
        cu_padded[-1] = length
    widths = [b - a for a, b in zip(cu_padded, cu_padded[1:])]
    return {"tokens": tok, "labels": lab, "loss_mask": [float(x != -100) for x in lab], "position_ids": pos,
            "padding_mask": pad, "cu_seqlens_unpadded": cu, "cu_seqlens_padded": cu_padded, "max_seqlen": max(widths)}


def segments_from(seqlens, rng):
    return [{"key": f"k{i}", "tokens": rng.integers(0, 256, n).tolist(), "targets": rng.integers(0, 2, n).tolist()}
            for i, n in enumerate(seqlens)]


def check_against_reference(batch, segments, *, align, pack_size, pad_to):
    tokens = [t for s in segments for t in s["tokens"]]
    targets = [t for s in segments for t in s["targets"]]
    seqlens = [len(s["tokens"]) for s in segments]
    want = reference(tokens, targets, seqlens, align=align, pack_size=pack_size, pad_to=pad_to)
    for key in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert batch[key].shape == (1, len(want[key]))
        assert batch[key][0].tolist() == want[key], key
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32 and batch["padding_mask"].dtype == torch.bool
    for key in ("cu_seqlens_unpadded", "cu_seqlens_padded"):
        assert batch[key].dtype == torch.int32 and batch[key].tolist() == want[key], key
    assert batch["max_seqlen"] == want["max_seqlen"]
    assert batch["keys"] == [s["key"] for s in segments]

    # The invariants, stated directly.
    cup = batch["cu_seqlens_padded"].tolist()
    assert all(b % align == 0 for b in cup)
    labels, row = batch["labels"][0], batch["tokens"][0]
    for k, (a, b) in enumerate(zip(cup, cup[1:])):
        n = seqlens[k]
        assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
        assert batch["padding_mask"][0, a:a + n].logical_not().all() and batch["padding_mask"][0, a + n:b].all()
        assert (labels[a + n - 1:b] == -100).all()  # last real token and padding predict nothing
        for j in range(a, a + n - 1):  # labels only ever name the next token of the same segment
            assert labels[j] in (-100, row[j + 1])
        if k:  # a segment's first token is never a target: no label anywhere names it from the previous segment
            assert labels[cup[k] - 1] == -100


@settings(max_examples=60, deadline=None)
@given(seqlens=st.lists(st.integers(1, 40), min_size=1, max_size=6), align=st.sampled_from([1, 8]),
       pad_to=st.sampled_from(["pack", "segments"]), extra=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_fields_match_reference(seqlens, align, pad_to, extra, seed):
    segments = segments_from(seqlens, np.random.default_rng(seed))
    pack_size = sum(-(-n // align) * align for n in seqlens) + extra
    members = fx.pack_record(segments, pack_size=pack_size, align=align, split="train")
    batch = pack_to_batch(members, MANIFEST, pad_to=pad_to)
    check_against_reference(batch, segments, align=align, pack_size=pack_size, pad_to=pad_to)
    assert "pixel_values" not in batch and "image_grid_thw" not in batch


def test_first_token_target_flag_is_ignored():
    segments = [{"key": "a", "tokens": [1, 2, 3], "targets": [1, 1, 1]},
                {"key": "b", "tokens": [4, 5], "targets": [1, 1]}]
    batch = pack_to_batch(fx.pack_record(segments, pack_size=8, align=1, split="train"), MANIFEST)
    assert batch["labels"][0].tolist() == [2, 3, -100, 5, -100, -100, -100, -100]


@pytest.fixture
def image_dataset(tmp_path):
    img = [(fx.image_bytes(60, 90, 1), "jpg"), (fx.image_bytes(112, 56, 2, "PNG"), "png"),
           (fx.image_bytes(70, 70, 3), "jpg")]
    packs = [[fx.chat_segment("v0", "what?", "a cat.", [img[0]]), fx.chat_segment("t1", "hi", "hello")],
             [fx.chat_segment("v2", "two", "same", img[1:])],
             [fx.chat_segment("t3", "text only", "ok")]]
    fx.write_packs(tmp_path, {"train": packs, "val": packs[:1]}, pack_size=128, align=8,
                   image_processor=fx.QWEN_PROCESSOR, packs_per_shard=2)
    return tmp_path, packs


def test_read_packs_order_fields_and_images(image_dataset):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.utils import is_torchvision_available

    path, packs = image_dataset
    p = fx.QWEN_PROCESSOR
    backend = Qwen2VLImageProcessor if is_torchvision_available() else Qwen2VLImageProcessorPil  # AutoProcessor's
    processor = backend(min_pixels=p["min_pixels"], max_pixels=p["max_pixels"], image_mean=p["image_mean"],
                        image_std=p["image_std"])
    batches = list(read_packs(path))
    assert [b["pack_key"] for b in batches] == [f"train-{i:09d}" for i in range(3)]
    for batch, segments in zip(batches, packs):
        check_against_reference(batch, segments, align=8, pack_size=128, pad_to="pack")
        media = [m for s in segments for m in s["media"]]
        assert batch["image_grid_thw"].tolist() == [m["grid_thw"] for m in media]
        assert batch["pixel_values"].dtype == torch.float32
        if media:
            want = processor(images=[Image.open(io.BytesIO(m["bytes"])) for m in media], return_tensors="np")
            assert np.array_equal(batch["pixel_values"].numpy(), want["pixel_values"])
        else:
            assert batch["pixel_values"].shape == (0, 3 * 2 * 14 * 14)
    again = list(read_packs(path))
    assert all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(batches, again))
    lean = next(read_packs(path, images=False, pad_to="segments"))
    assert "pixel_values" not in lean and lean["image_grid_thw"].tolist() == [[1, 6, 4]]


def test_bad_packs_raise():
    img = fx.image_bytes(60, 90, 1)
    seg = fx.chat_segment("v", "q", "a", [(img, "jpg")])
    manifest = {**MANIFEST, "image_processor": fx.QWEN_PROCESSOR}

    def members(**change):
        s = {**seg, "media": [{**seg["media"][0], **change}]}
        return fx.pack_record([s], pack_size=128, align=1, split="train")

    pack_to_batch(members(), manifest)
    with pytest.raises(ValueError, match="processes to grid"):
        pack_to_batch(members(grid_thw=[1, 4, 6]), manifest)
    with pytest.raises(ValueError, match="m0.jpg of segment v does not match its image tokens"):
        pack_to_batch(members(token_offset=seg["media"][0]["token_offset"] + 1), manifest)
    with pytest.raises(ValueError, match="do not agree"):
        pack_to_batch({**members(), "seqlens.npy": fx.npy(np.array([3], np.int32))}, manifest)
    with pytest.raises(ValueError, match="exceeds pack size"):
        pack_to_batch(fx.pack_record([seg], pack_size=8, align=1, split="train"), manifest)
    buf = io.BytesIO()
    np.save(buf, np.array([1, 2], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        pack_to_batch({**members(), "tokens.npy": buf.getvalue()}, manifest)


def test_fixed_count_images_need_the_models_processor():
    seg = fx.chat_segment("v", "q", "a", [(fx.image_bytes(60, 90, 1), "jpg"), (fx.image_bytes(30, 30, 2), "jpg")])
    seg["media"] = [{**m, "grid_thw": [1, 1, 1]} for m in seg["media"]]
    members = fx.pack_record([seg], pack_size=128, align=1, split="train")
    manifest = {**MANIFEST, "image_processor": {"type": "fixed", "fixed_tokens": 6}}
    with pytest.raises(ValueError, match="no image processor"):
        pack_to_batch(members, manifest)
    assert pack_to_batch(members, manifest, images=False)["image_grid_thw"].tolist() == [[1, 1, 1]] * 2

    def clip_like(images, return_tensors):
        return {"pixel_values": np.stack([np.full((3, 4, 4), im.size[0], np.float32) for im in images])}

    batch = pack_to_batch(members, manifest, image_processor=clip_like)
    assert batch["pixel_values"][:, 0, 0, 0].tolist() == [60, 30]


def test_mrope_positions_by_hand():
    i = fx.IMAGE_PAD_ID
    tokens = torch.tensor([[5, i, i, i, i, i, i, 7, 0, 9, 9]])  # two adjacent images; a 2nd segment from index 8
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    pos = mrope_position_ids(tokens, torch.tensor([0, 8, 11]), grid, image_token_id=i)
    assert pos[:, 0].tolist() == [[0, 1, 1, 1, 1, 3, 3, 5, 0, 1, 2],
                                  [0, 1, 1, 2, 2, 3, 3, 5, 0, 1, 2],
                                  [0, 1, 2, 1, 2, 3, 4, 5, 0, 1, 2]]
    with pytest.raises(ValueError):
        mrope_position_ids(tokens, torch.tensor([0, 11]), grid[:1], image_token_id=i)


def test_pack_dataset_order_ranks_workers(image_dataset):
    path, _ = image_dataset
    keys = lambda ds: [b["pack_key"] for b in ds]
    assert keys(PackDataset(path, shuffle=False)) == [f"train-{i:09d}" for i in range(3)]
    ds = PackDataset(path, seed=3, images=False)
    first = keys(ds)
    assert first == keys(PackDataset(path, seed=3, images=False)) and sorted(first) == keys(
        PackDataset(path, shuffle=False))
    orders = set()
    for epoch in range(6):
        ds.set_epoch(epoch)
        orders.add(tuple(keys(ds)))
    assert len(orders) > 1
    ranks = [keys(PackDataset(path, seed=3, rank=r, world_size=2)) for r in range(2)]
    assert all(len(r) == 1 for r in ranks) and not set(ranks[0]) & set(ranks[1])
    loader = torch.utils.data.DataLoader(PackDataset(path, seed=3), batch_size=None, num_workers=2)
    assert keys(loader) == first


def assert_same_batch(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_energon_task_encoder_matches_reader(image_dataset):
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset, get_val_dataset

    path, _ = image_dataset
    want = {b["pack_key"]: b for b in read_packs(path)}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    val = get_val_dataset(path, split_part="train", worker_config=wc, batch_size=1, task_encoder=PackTaskEncoder())
    got = list(get_savable_loader(val))
    assert [b["pack_key"] for b in got] == list(want)
    for batch in got:
        assert_same_batch(batch, want[batch["pack_key"]])

    def train(**kw):
        ds = get_train_dataset(path, worker_config=wc, batch_size=2, shuffle_buffer_size=None,
                               max_samples_per_sequence=None, task_encoder=PackTaskEncoder(**kw))
        return get_savable_loader(ds)

    loader = train(pad_to="segments")
    it = iter(loader)
    seen = [next(it) for _ in range(2)]
    for batch in seen:
        ref = collate_packs([_read_one(path, k, "segments") for k in batch["pack_key"]], fx.PAD_ID)
        assert_same_batch(batch, ref)
    state = loader.save_state_rank()
    after = [next(it) for _ in range(3)]
    resumed = train(pad_to="segments")
    resumed.restore_state_rank(state)
    it2 = iter(resumed)
    for batch in after:
        assert_same_batch(next(it2), batch)


def test_energon_metadataset_blend_uses_each_datasets_manifest(image_dataset, tmp_path):
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    images, _ = image_dataset
    text = fx.write_packs(tmp_path / "text", {"train": [segments_from([5, 9], np.random.default_rng(0))]},
                          pack_size=64, align=1, with_tokenizer=False)
    blend = tmp_path / "blend.yaml"
    blend.write_text(f"__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                     f"      - weight: 1\n        path: {images}\n      - weight: 1\n        path: {text}\n")
    ds = get_train_dataset(blend, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), batch_size=1,
                           shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=PackTaskEncoder())
    want = {64: {b["pack_key"]: b for b in read_packs(text)}, 128: {b["pack_key"]: b for b in read_packs(images)}}
    seen = set()
    for batch, _ in zip(get_loader(ds), range(12)):
        length = batch["tokens"].shape[1]
        assert_same_batch(batch, want[length][batch["pack_key"]])
        seen.add(length)
    assert seen == {64, 128}


def _read_one(path, key, pad_to):
    return next(b for b in read_packs(path, pad_to=pad_to) if b["pack_key"] == key)


def test_collate_pads_with_ignore_and_keeps_thd_view(image_dataset):
    path, packs = image_dataset
    rows = list(read_packs(path, pad_to="segments"))
    batch = collate_packs(rows, fx.PAD_ID)
    length = max(r["tokens"].shape[1] for r in rows)
    assert batch["tokens"].shape == (3, length) and batch["pack_key"] == [r["pack_key"] for r in rows]
    flat = {k: batch[k].reshape(-1) for k in ("tokens", "labels", "loss_mask", "padding_mask")}
    assert flat["labels"][flat["padding_mask"]].eq(-100).all() and flat["loss_mask"][flat["padding_mask"]].eq(0).all()
    assert flat["tokens"][flat["padding_mask"]].eq(fx.PAD_ID).all()
    segments = [s for p in packs for s in p]
    cu, cup = batch["cu_seqlens_unpadded"].tolist(), batch["cu_seqlens_padded"].tolist()
    assert cup[-1] == 3 * length and all(b % 8 == 0 for b in cup) and batch["keys"] == [s["key"] for s in segments]
    for k, seg in enumerate(segments):
        assert cu[k + 1] - cu[k] == len(seg["tokens"])
        assert flat["tokens"][cup[k]:cup[k] + len(seg["tokens"])].tolist() == seg["tokens"]
    assert batch["image_grid_thw"].shape == (3, 3)
    assert batch["pixel_values"].shape[0] == sum(r["pixel_values"].shape[0] for r in rows)


def test_reader_batches_are_typed_and_read_by_key_through_every_loader(image_dataset):
    """A reader batch is one dataclass (:class:`ReaderBatch`): its fields by attribute equal its entries by key,
    the family's media are its typed part, and it stays one through collate, a device move, pickling (loader
    workers), a plain torch DataLoader and Energon's loader; every trainer layout takes it as it is."""
    import pickle

    from megatron.energon import WorkerConfig, get_savable_loader, get_val_dataset

    from packtool.format import BATCH_CONTEXT, BATCH_FAMILY
    from packtool.runtime.hf import hf_batch
    from packtool.runtime.megatron_batch import megatron_bridge_batch

    path, _ = image_dataset
    rows = list(read_packs(path, pad_to="segments"))
    batch = rows[0]
    assert isinstance(batch, ReaderBatch)
    assert batch.tokens is batch["tokens"] and batch.segment_keys is batch["keys"] and batch.family == "qwen2_vl"
    assert set(batch.media) == {"pixel_values", "image_grid_thw"} and batch.media["pixel_values"] is batch[
        "pixel_values"]
    # The media are the family reader's typed part: fields by attribute, None (and no key) where the pack has none.
    assert type(batch.media) is VisionMedia and batch.media.pixel_values is batch["pixel_values"]
    assert batch.media.video_grid_thw is None and "video_grid_thw" not in batch and batch.media.extra == {}
    assert list(batch)[:3] == ["tokens", "labels", "loss_mask"] and {BATCH_FAMILY, BATCH_CONTEXT} <= set(batch)
    assert "dataset_index" not in batch and batch.get("dataset_index") is None  # one dataset: no entry
    assert set(batch.to_dict()) == set(batch) and type(batch.to_dict()) is dict
    with pytest.raises(KeyError, match="every reader batch has"):
        del batch["tokens"]
    batch["extra"] = 1  # a caller's own entry joins the media, beside its fields
    assert batch.media.extra == {"extra": 1} and list(batch)[-1] == "extra"
    assert batch.media.pop("extra") == 1 and "extra" not in batch
    batch["video_grid_thw"] = torch.zeros((0, 3), dtype=torch.int64)  # a field's key sets the field
    assert batch.media.video_grid_thw is batch["video_grid_thw"] and batch.media.extra == {}
    del batch["video_grid_thw"]
    assert batch.media.video_grid_thw is None and "video_grid_thw" not in batch
    stacked = collate_packs(rows, fx.PAD_ID)
    assert isinstance(stacked, ReaderBatch) and stacked.pack_key == [r.pack_key for r in rows]
    assert type(stacked.media) is VisionMedia and stacked.media.image_grid_thw.shape == (3, 3)
    moved = stacked.to("cpu")
    assert isinstance(moved, ReaderBatch) and torch.equal(moved.tokens, stacked.tokens)
    assert type(moved.media) is VisionMedia
    again = pickle.loads(pickle.dumps(stacked))
    assert isinstance(again, ReaderBatch) and set(again) == set(stacked) and type(again.media) is VisionMedia
    plain = next(iter(torch.utils.data.DataLoader(PackDataset(path, shuffle=False), batch_size=None)))
    assert isinstance(plain, ReaderBatch) and plain.pack_key == rows[0].pack_key
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    val = get_val_dataset(path, split_part="train", worker_config=wc, batch_size=2, task_encoder=PackTaskEncoder())
    assert isinstance(next(iter(get_savable_loader(val))), ReaderBatch)
    assert hf_batch(batch)["input_ids"].shape[1] == int(batch.cu_seqlens_unpadded[-1])  # layouts take it as it is
    assert torch.equal(megatron_bridge_batch(batch)["tokens"], batch.tokens)


def test_a_loop_over_one_outputs_packs_builds_its_reader_once(image_dataset, monkeypatch):
    """``read_packs`` and ``PackDataset`` build the manifest's family reader once per pass, not per pack (it cost
    ~3 % of a text pack's read), and the batches equal those built pack by pack. The control: ``pack_to_batch``
    alone builds it on each call."""
    import packtool.runtime.loader as loader_module
    import packtool.runtime.read as read_module

    path, _ = image_dataset
    built = []

    def counting(manifest):
        built.append(1)
        return real(manifest)

    real = read_module.reader_of
    expected = [b.tokens for b in read_packs(path, pad_to="segments")]
    monkeypatch.setattr(read_module, "reader_of", counting)
    monkeypatch.setattr(loader_module, "reader_of", counting)
    rows = list(read_packs(path, pad_to="segments", images=False))
    assert len(rows) > 1 and len(built) == 1
    assert all(torch.equal(r.tokens, e) for r, e in zip(rows, expected, strict=True))
    built.clear()
    assert len(list(PackDataset(path, shuffle=False, images=False))) == len(rows) and len(built) == 1
    built.clear()
    from packtool.format import split_shard_paths
    from packtool.shards import iter_records

    for key, members in iter_records(split_shard_paths(path, "train")[0]):
        pack_to_batch({**members, "__key__": key}, load_manifest(path), images=False)
    assert len(built) > 1


def test_every_readers_media_part_is_a_typed_dataclass_naming_its_batch_keys():
    """Each registered reader (convention variants and the processor mode's included) names its media part, a
    dataclass below the families' readers, whose fields are the reader's batch keys; an entry not a field is kept
    apart (``extra``), never taken for one. The control: the empty base part holds every entry as extra."""
    import dataclasses

    from packtool.families import readers
    from packtool.mediapart import MediaPart

    parts = {}
    for cls in readers():
        assert issubclass(cls.media_part, MediaPart) and dataclasses.is_dataclass(cls.media_part)
        assert cls.batch_keys == cls.media_part.field_names()
        parts[cls.__name__] = cls.media_part
    assert parts["NoMediaReader"] is MediaPart and parts["FamilyReader"] is VisionMedia
    assert {"media_kinds", "media_inputs"} <= set(parts["ProcessorReader"].field_names())
    assert set(parts["MBridgeNemotronOmniReader"].field_names()) - set(parts["NemotronOmniReader"].field_names()) \
        == {"sound_length", "num_image_tiles"}
    assert "second_per_grid_ts" in parts["Qwen2VLReader"].field_names()
    assert "second_per_grid_ts" not in parts["Qwen3VLReader"].field_names()
    part = parts["Qwen2VLReader"].of({"image_grid_thw": torch.zeros((1, 3)), "image_sizes": [1]})
    assert set(part) == {"image_grid_thw", "image_sizes"} and part.extra == {"image_sizes": [1]}
    with pytest.raises(KeyError):
        part["pixel_values"]
    bare = MediaPart.of({"image_grid_thw": 1})
    assert bare.extra == {"image_grid_thw": 1} and MediaPart.field_names() == ()


def test_to_megatron(image_dataset):
    path, _ = image_dataset
    batch = next(read_packs(path))
    out = to_megatron(batch, "cpu")
    assert out["tokens"].shape == (1, 128) and out["attention_mask"] is None
    assert torch.equal(out["cu_seqlens_q"], batch["cu_seqlens_unpadded"])
    assert out["cu_seqlens_kv_padded"].dtype == torch.int32
    assert int(out["max_seqlen_q"]) == batch["max_seqlen"] and out["max_seqlen_q"].device.type == "cpu"
    params = out["packed_seq_params"]
    get = params.get if isinstance(params, dict) else lambda k: getattr(params, k)
    assert get("qkv_format") == "thd" and torch.equal(get("cu_seqlens_q_padded"), batch["cu_seqlens_padded"])
    assert get("max_seqlen_kv") == batch["max_seqlen"]
    assert set(out["visual_inputs"].normalized_for_model()) == {"pixel_values", "image_grid_thw"}
    rows = collate_packs(list(read_packs(path)), fx.PAD_ID)
    flat = to_megatron(rows, "cpu")
    assert flat["tokens"].shape == (1, 3 * 128) and int(flat["cu_seqlens_q_padded"][-1]) == 3 * 128
    assert to_megatron(list(read_packs(path))[2], "cpu")["visual_inputs"] is None


def test_inspect(image_dataset):
    path, packs = image_dataset
    text = inspect_pack(path)
    assert text.startswith("pack train-000000000") and "v0" in text and "t1" in text
    assert "⟦a cat.<|im_end|>⟧" in text and "⟦hello<|im_end|>⟧" in text
    assert "<|image_pad|>×6" in text and "m0.jpg  image" in text and "60×90" in text
    second = inspect_pack(path, "train-000000001")
    assert second.startswith("pack train-000000001")
    assert "m0.png" in second and "m1.jpg" in second and "<|image_pad|>×8" in second
    assert inspect_pack(path, split="val").startswith("pack val-000000000")
    with pytest.raises(FormatError, match="no pack 'train-000000099'"):
        inspect_pack(path, "train-000000099")
    assert load_manifest(path)["image_token_id"] == fx.IMAGE_PAD_ID


def test_shuffle_keeps_dp_balanced_groups_together(demo_dir, tmp_path):
    """Packs written with --balance-dp N move as whole groups when N ranks shuffle: each step's packs are one group."""
    from packtool.packer.pipeline import pack
    from packtool.runtime.loader import PackDataset
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    out = tmp_path / "dp"
    pack(demo_dir / "dataset", out, PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                                                 PlanSettings(balance_dp=4), splits=("train",)), progress=False)
    ranks = [PackDataset(out, "train", seed=3, rank=r, world_size=4, images=False).rank_records() for r in range(4)]
    flat = lambda rec: rec[:, 1]
    steps = np.stack([flat(r) for r in ranks], axis=1)
    assert (steps // 4 == (steps[:, :1] // 4)).all() and (steps % 4 == np.arange(4)).all()
    assert not (steps[:, 0] == np.arange(0, 4 * len(steps), 4)).all()  # shuffled, not on-disk order
