"""Quick sanity tests of the demo builders (examples/demo.py): tokenizer folder, chat template, datasets."""

from __future__ import annotations

import collections
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402

SMALL = dict(n_train=120, n_val=20, samples_per_shard=40, seed=7)


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    return demo.build_tokenizer(base / "plain"), demo.build_tokenizer(base / "gen", generation_tags=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return demo.build_dataset(tmp_path_factory.mktemp("ds") / "dataset", **SMALL)


def _conversation():
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in <image> it?"}]},
        {"role": "assistant", "content": "A red river."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because of the light."},
    ]


def test_tokenizer_loads_offline(tok_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dirs[0])
    assert tok.is_fast
    assert tok.convert_tokens_to_ids(list(demo.SPECIAL_TOKENS)) == list(range(7))
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = "The careful teacher explains the picture of a river.\n<image> Why?"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # the BPE learned words, not just bytes
    assert all(i >= 7 for i in ids)  # "<image>" is plain text, not a special token


def test_chat_template_text(tok_dirs):
    from transformers import AutoTokenizer

    plain, gen = (AutoTokenizer.from_pretrained(d) for d in tok_dirs)
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in <image> it?<|im_end|>\n"
        "<|im_start|>assistant\nA red river.<|im_end|>\n"
        "<|im_start|>user\nWhy?<|im_end|>\n"
        "<|im_start|>assistant\nBecause of the light.<|im_end|>\n"
    )
    for tok in (plain, gen):
        assert tok.apply_chat_template(_conversation(), tokenize=False) == expected
        with_system = [{"role": "system", "content": "Be brief."}] + _conversation()[:1]
        assert tok.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in <image> it?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    assert "{% generation %}" not in (tok_dirs[0] / "chat_template.jinja").read_text()
    assert "{% generation %}" in (tok_dirs[1] / "chat_template.jinja").read_text()


def test_assistant_mask_covers_reply_and_end_token(tok_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dirs[1])
    out = tok.apply_chat_template(_conversation(), return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    assert [tok.decode(r) for r in runs] == ["A red river.<|im_end|>", "Because of the light.<|im_end|>"]


def test_image_processor_config(tok_dirs):
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(tok_dirs[0])
    assert (proc.size["shortest_edge"], proc.size["longest_edge"]) == (3136, 200704)
    for (w, h), grid in {(20, 30): [1, 6, 4], (1200, 900): [1, 26, 36], (56, 56): [1, 4, 4]}.items():
        out = proc(images=[Image.new("RGB", (w, h))], return_tensors="np")
        assert out["image_grid_thw"].tolist() == [grid]
        assert out["pixel_values"].shape == (int(np.prod(grid)), 3 * 2 * 14 * 14)


def test_dataset_is_reproducible(dataset, tmp_path):
    again = demo.build_dataset(tmp_path / "again", **SMALL)
    files = sorted(p.relative_to(dataset) for p in dataset.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert any(str(f).endswith("index.sqlite") for f in files) and any(str(f).endswith(".tar.idx") for f in files)
    for rel in files:
        assert (dataset / rel).read_bytes() == (again / rel).read_bytes(), rel
    other = demo.build_dataset(tmp_path / "other", **{**SMALL, "seed": 8})
    assert (other / "shards/train-0000.tar").read_bytes() != (dataset / "shards/train-0000.tar").read_bytes()


def test_dataset_metadata_matches_tars(dataset):
    import yaml

    meta = dataset / ".nv-meta"
    info = json.loads((meta / ".info.json").read_text())
    assert info["shard_counts"] == {"shards/train-0000.tar": 40, "shards/train-0001.tar": 40,
                                    "shards/train-0002.tar": 40, "shards/val-0000.tar": 20}
    for shard, count in info["shard_counts"].items():
        with tarfile.open(dataset / shard) as tar:
            infos = tar.getmembers()
        names = [m.name for m in infos]
        assert all(m.uid == 0 and m.gid == 0 and m.mtime == 0 and m.mode == 0o644 for m in infos)
        assert len(dict.fromkeys(n.split(".", 1)[0] for n in names)) == count
        assert (dataset / (shard + ".idx")).stat().st_size == 8 * (count + 1)
    split = yaml.safe_load((meta / "split.yaml").read_text())
    assert split["exclude"] == [f"shards/train-0000.tar/{demo.EXCLUDED_KEY}"]
    assert set(split["split_parts"]) == {"train", "val"}
    assert yaml.safe_load((meta / "dataset.yaml").read_text())["__class__"] == "CrudeWebdataset"
    assert (meta / "index.sqlite").is_file() and (meta / "index.uuid").is_file()


def test_dataset_covers_the_input_styles(dataset):
    records = demo.read_manifest(dataset)
    assert len(records) == 140 and len({r["key"] for r in records}) == 140
    assert all("." not in r["key"] for r in records)
    assert {r["style"] for r in records} == {"sharegpt", "chatml", "list_sharegpt", "list_chatml"}
    kinds = collections.Counter((r["split"], r["kind"]) for r in records)
    assert kinds[("train", "long")] == 2 and kinds[("val", "long")] == 1
    assert kinds[("train", "image")] == 72 and kinds[("val", "image")] == 12
    images = [r for r in records if r["images"]]
    assert any(r["tagged"] for r in images) and any(not r["tagged"] for r in images)
    assert any(r["images"] > 1 and r["naming"] == "img" for r in images)
    sizes = [w * h for r in images for w, h in r["image_sizes"]]
    assert min(sizes) < 3136 and max(sizes) > 1003520
    assert any(r["rounds"] > 1 for r in records) and any(r["system"] for r in records)
    with tarfile.open(dataset / "shards/train-0000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar}
    for r in (r for r in records if r["shard"] == "shards/train-0000.tar"):
        assert sorted(p for p in members if p.startswith(r["key"] + ".")) == sorted(
            f"{r['key']}.{p}" for p in r["parts"])
        text = members[f"{r['key']}.json"].decode()
        assert text.count("<image>") == (r["images"] if r["tagged"] else 0)


def test_long_samples_exceed_2048_tokens(dataset, tok_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dirs[0])
    long_rec = next(r for r in demo.read_manifest(dataset) if r["kind"] == "long")
    with tarfile.open(dataset / long_rec["shard"]) as tar:
        text = tar.extractfile(f"{long_rec['key']}.json").read().decode()
    assert 4000 < len(tok(text)["input_ids"]) < 10000


def _energon_keys(path: Path, split: str) -> list[dict]:
    """Read a crude split with raw bytes (decoder=None), on-disk order, errors re-raised."""
    from megatron.energon import WorkerConfig, reraise_exception
    from megatron.energon.dataset_config import get_dataset_from_config

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    factory = get_dataset_from_config(path, split_part=split, training=False, worker_config=wc, decoder=None)
    dataset = factory.build()
    wc.worker_activate(sample_index=0)
    try:
        return [dict(s) for s in dataset]
    finally:
        wc.worker_deactivate()


def test_energon_reads_the_crude_dataset(dataset):
    records = demo.read_manifest(dataset)
    samples = _energon_keys(dataset, "train")
    expected = [r for r in records if r["split"] == "train" and r["key"] != demo.EXCLUDED_KEY]
    assert [s["__key__"] for s in samples] == [r["key"] for r in expected]
    for s, r in zip(samples, expected):
        assert s["__shard__"] == r["shard"]  # the shard path relative to the dataset root
        assert sorted(k for k in s if not k.startswith("__")) == sorted(r["parts"])
        assert isinstance(s["json"], bytes) and json.loads(s["json"])
    assert [s["__key__"] for s in _energon_keys(dataset, "val")] == [
        r["key"] for r in records if r["split"] == "val"]


def test_energon_reads_typed_datasets(tmp_path):
    from megatron.energon import CaptioningSample, VQASample, WorkerConfig, get_loader, get_val_dataset

    vqa = demo.build_vqa_dataset(tmp_path / "vqa", n=6)
    cap = demo.build_captioning_dataset(tmp_path / "cap", n=4)
    for path, sample_type, n in ((vqa, VQASample, 6), (cap, CaptioningSample, 4)):
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
        loaded = list(get_loader(get_val_dataset(path, split_part="train", worker_config=wc, batch_size=None)))
        assert len(loaded) == n and all(isinstance(s, sample_type) for s in loaded)
        assert loaded[0].image.ndim == 3
    assert isinstance(loaded[0].caption, str)


# -- videos and audio ------------------------------------------------------------------------------------------------
VIDEO_SMALL = dict(n_train=60, n_val=10, samples_per_shard=30, seed=3, video_fraction=0.3)


@pytest.fixture(scope="module")
def video_dataset(tmp_path_factory):
    pytest.importorskip("av")
    return demo.build_dataset(tmp_path_factory.mktemp("vds") / "dataset", **VIDEO_SMALL)


def _members(dataset: Path, record: dict) -> dict[str, bytes]:
    with tarfile.open(dataset / record["shard"]) as tar:
        return {p: tar.extractfile(f"{record['key']}.{p}").read() for p in record["parts"]}


def test_video_samples_hold_every_form_and_read(video_dataset):
    from packtool.media import probe_frames, probe_video

    records = demo.read_manifest(video_dataset)
    videos = [r for r in records if r["kind"] == "video"]
    assert collections.Counter(r["split"] for r in videos) == {"train": 18, "val": 3}
    assert {r["video"]["form"] for r in videos} == set(demo.DEMO_VIDEO_FORMS)
    assert any(r["images"] for r in videos) and any(r["tagged"] for r in videos) and \
        any(not r["tagged"] for r in videos)
    for r in videos:
        members, facts = _members(video_dataset, r), r["video"]
        if facts["form"] == "frames":
            frames = [members[f"clip.{i}.jpg"] for i in range(facts["frames"])]
            got = probe_frames(frames, max_pixels=10**8, decode=True)
        else:
            got = probe_video(members[facts["form"]], max_pixels=10**8)
            assert got.fps == pytest.approx(facts["fps"])
        assert (got.width, got.height, got.frames) == (facts["width"], facts["height"], facts["frames"]), r["key"]
        assert members["json"].decode().count("<video>") == (1 if r["tagged"] else 0)


def test_video_fraction_zero_is_the_dataset_without_videos(dataset, tmp_path):
    again = demo.build_dataset(tmp_path / "again", **SMALL, video_fraction=0.0, audio_fraction=0.0)
    assert (again / "shards/train-0001.tar").read_bytes() == (dataset / "shards/train-0001.tar").read_bytes()
    assert not any(r["kind"] in ("video", "audio") for r in demo.read_manifest(dataset))


def test_omni_dataset_holds_audio_video_and_images(tmp_path):
    pytest.importorskip("av")
    from packtool.media import probe_audio

    omni = demo.build_omni_dataset(tmp_path / "omni", n=20, seed=1)
    records = demo.read_manifest(omni)
    assert collections.Counter(r["kind"] for r in records) == {"audio": 6, "video": 6, "image": 4, "text": 4}
    audio = [r for r in records if r["kind"] == "audio"]
    assert {r["audio"]["format"] for r in audio} == set(demo.DEMO_AUDIO_FORMATS)
    for r in audio:
        members, facts = _members(omni, r), r["audio"]
        got = probe_audio(members[facts["format"]], decode=True)
        assert (got.sample_rate, got.samples) == (facts["rate"], facts["samples"]), r["key"]
        assert members["json"].decode().count("<audio>") == (1 if r["tagged"] else 0)
    assert sum(p.stat().st_size for p in omni.rglob("*") if p.is_file()) < 2_000_000


def test_video_demo_packs_for_the_qwen_folder(video_dataset, tok_dirs, tmp_path):
    """What ``make run`` does with the demo's videos: every sample is kept (none quarantined), each video sample
    with its video, byte for byte."""
    import pyarrow.parquet as pq

    from packfixture import packed_segments
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    out = tmp_path / "packed"
    pack(video_dataset, out, PackSettings(EncodeSettings(tokenizer=str(tok_dirs[0]), pack_size=2048),
                                          PlanSettings()), workers=1, progress=False)
    ledger = {r["key"]: r for r in pq.read_table(out / "ledger.parquet").to_pylist()}
    assert {r["status"] for r in ledger.values()} <= {"packed", "truncated"}
    records = {r["key"]: r for r in demo.read_manifest(video_dataset) if not r["excluded"]}
    assert set(ledger) == set(records)
    videos = {r["key"]: r for r in records.values() if r["kind"] == "video"}
    seen = {}
    for split in ("train", "val"):
        for seg, _, _, media in packed_segments(out, split):
            if seg.key in videos:
                (ref,) = [m for m in seg.media if m.kind == "video"]
                seen[seg.key] = [media[n] for n in ref.members]
    assert set(seen) == set(videos)
    for key, data in seen.items():
        members, facts = _members(video_dataset, videos[key]), videos[key]["video"]
        expected = [members[f"clip.{i}.jpg"] for i in range(facts["frames"])] if facts["form"] == "frames" \
            else [members[facts["form"]]]
        assert data == expected, key


def test_omni_demo_packs_for_the_nemotron_folder(tmp_path):
    """What ``make run`` does with the omni demo: at its pack size every sample is kept whole for the Nemotron Omni
    folder (no sample quarantined or cut), and each sample's pack carries all its media members, byte for byte."""
    pytest.importorskip("av")
    import pyarrow.parquet as pq

    import nemotron_omni_model
    from packfixture import packed_segments
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    omni = demo.build_omni_dataset(tmp_path / "omni", n=20, seed=1)
    folder = nemotron_omni_model.write_model_folder(tmp_path / "nemotron-omni")
    out = tmp_path / "packed-omni"
    pack(omni, out, PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=4096), PlanSettings()),
         workers=1, progress=False)
    ledger = {r["key"]: r for r in pq.read_table(out / "ledger.parquet").to_pylist()}
    records = {r["key"]: r for r in demo.read_manifest(omni) if not r["excluded"]}
    assert set(ledger) == set(records)
    assert {(r["status"], r["reason"]) for r in ledger.values()} == {("packed", "")}
    carried = {}
    for seg, _, _, media in packed_segments(out):
        carried[seg.key] = (sorted(m.kind for m in seg.media), sorted(media[n] for m in seg.media for n in m.members))
    assert set(carried) == set(records)
    kinds = collections.Counter()
    for key, (media_kinds, data) in carried.items():
        members = _members(omni, records[key])
        assert data == sorted(v for p, v in members.items() if p != "json"), key
        kinds.update(media_kinds)
        assert ledger[key]["images"] == len(media_kinds), key
    assert set(kinds) == {"image", "video", "audio"}
