"""Qwen3-VL through ``pack``: every packed segment's tokens equal transformers' ``Qwen3VLProcessor``'s
``input_ids`` for the same rendered conversation and media, its rope per segment equals the model's own
``get_rope_index`` on that segment alone, and what the processor refuses is quarantined with its reason.

The model folder is written offline (``examples/qwen3_vl_model.py``, the demo's vocabulary); images, videos (mp4,
webm, mkv, frame lists; several sizes and rates) are generated with PyAV, numpy and PIL; the source and the packs
are real tar shards. The processor imports torchvision; without it these tests are skipped with that reason.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

pytest.importorskip("av")

import packfixture as fx
from packtool.errors import ConfigError
from packtool.format import Manifest
from packtool.media import decode_frames, decode_video, probe_frames, probe_video
from packtool.packer.pipeline import pack
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from test_media_pack import write_source
from test_nemotron_pack import REPLY, source_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import qwen3_vl_model

PACK_SIZE = 8192

# key -> (turns, media specs in tag order), as in test_nemotron_pack.
SAMPLES: dict[str, tuple[list[str], list[tuple]]] = {
    "image": (["<image>What is it?", REPLY], [("image", 320, 200)]),
    "two_images": (["<image><image>Which is wider?", "the first"], [("image", 640, 480), ("image", 33, 90)]),
    "mp4": (["Watch <video> closely.", REPLY], [("video", "mp4", 64, 48, 30, 24)]),
    "webm_image": (["<video>\nAnd <image>?", "both"], [("video", "webm", 80, 80, 25, 12), ("image", 120, 90)]),
    "mkv": (["<video> what moves?", "a square"], [("video", "mkv", 97, 33, 15, 2.5)]),
    "two_videos": (["First <video> then <video>.", "both move"], [("video", "mp4", 96, 32, 13, 6.5),
                                                                  ("video", "mp4", 64, 64, 41, 10)]),
    "frames": (["<video>Frames.", "they change"], [("frames", 6, 44, 36)]),
    "second_turn": (["<image>What is it?", "a picture", "And <video>?", "a clip"],
                    [("image", 30, 30), ("video", "webm", 48, 96, 9, 30)]),
    "text_only": (["Just text.", REPLY], []),
    # What the processor refuses: a video of one frame, an image 250 times wider than high.
    "one_frame": (["<video> one frame", REPLY], [("video", "mp4", 64, 48, 1, 24)]),
    "thin_image": (["<image> a line", REPLY], [("image", 2000, 8)]),
}
REFUSED = {"one_frame": "fewer than its temporal patch of 2", "thin_image": "aspect ratio 250 exceeds 200"}

#: Folder variants: the hub's settings; a per-frame pixel cap with few tokens per frame, sampled at 4 fps by the
#: settings.
VARIANTS = {
    "hub": ({}, {}),
    "capped-4fps": ({"cap_pixels_per_frame": True, "max_video_tokens": 16,
                     "size": {"shortest_edge": 4096, "longest_edge": 64 * 32 * 32}}, {"video_fps": 4.0}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def qwen3_run(request, torchvision, demo_dir, tmp_path_factory):
    """The samples packed several to a pack under one folder variant."""
    root = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    video, overrides = VARIANTS[request.param]
    folder = qwen3_vl_model.write_model_folder(root / "model", tokenizer=demo_dir / "tokenizer", video=video)
    sources = {k: source_sample(*v) for k, v in SAMPLES.items()}
    write_source(root / "src", {k: v[0] for k, v in sources.items()})
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=PACK_SIZE, **overrides),
                            PlanSettings(shard_size="4"))
    pack(root / "src", root / "out", settings, workers=1, progress=False, max_error_rate=1.0)
    ledger = {r["key"]: r for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    return SimpleNamespace(sources=sources, ledger=ledger, out=root / "out", folder=folder, overrides=overrides)


def processor_inputs(turns: list[str], specs: list[tuple], media: list) -> tuple[list[dict], list, list, list]:
    """The conversation as content parts, and the images, whole decoded videos and their metadata (the processor
    samples the frames itself)."""
    from PIL import Image
    from transformers.video_utils import VideoMetadata

    messages = []
    for i, text in enumerate(turns):
        if i % 2:
            messages.append({"role": "assistant", "content": text})
            continue
        content = []
        for piece in text.replace("<image>", "\0image\0").replace("<video>", "\0video\0").split("\0"):
            if piece in ("image", "video"):
                content.append({"type": piece})
            elif piece:
                content.append({"type": "text", "text": piece})
        messages.append({"role": "user", "content": content})
    images, videos, metas = [], [], []
    for spec, data in zip(specs, media):
        if spec[0] == "image":
            images.append(Image.open(io.BytesIO(data)))
            continue
        facts = probe_frames(data, max_pixels=10**8) if spec[0] == "frames" else probe_video(data, max_pixels=10**8)
        frames = (decode_frames(data, range(facts.frames)) if spec[0] == "frames"
                  else decode_video(data, range(facts.frames)))
        videos.append(frames)
        metas.append(VideoMetadata(**facts.metadata()))
    return messages, images, videos, metas


def expected_ids(processor, turns: list[str], specs: list[tuple], media: list, overrides: dict):
    """transformers' ``Qwen3VLProcessor`` on the rendered conversation and the sample's media."""
    messages, images, videos, metas = processor_inputs(turns, specs, media)
    rendered = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    call: dict = {}
    if images:
        call["images"] = images
    if videos:
        call.update(videos=videos, video_metadata=metas)
        if "video_fps" in overrides:
            call["fps"] = overrides["video_fps"]
    return processor(text=rendered, return_tensors="np", **call)


def test_tokens_equal_the_processor(qwen3_run):
    from transformers import AutoProcessor

    run = qwen3_run
    processor = AutoProcessor.from_pretrained(str(run.folder))
    assert type(processor).__name__ == "Qwen3VLProcessor"
    tok = processor.tokenizer
    image_id, video_id = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>")
    expected_status = {k: "error" if k in REFUSED else "packed" for k in SAMPLES}
    assert {k: r["status"] for k, r in run.ledger.items()} == expected_status, run.ledger
    for key, reason in REFUSED.items():
        assert reason in run.ledger[key]["reason"], run.ledger[key]
    segments = {seg.key: (seg, tokens, targets) for seg, tokens, targets, _ in fx.packed_segments(run.out)}
    assert set(segments) == {k for k, s in expected_status.items() if s == "packed"}
    for key, (seg, tokens, targets) in segments.items():
        turns, specs = SAMPLES[key]
        expected = expected_ids(processor, turns, specs, run.sources[key][1], run.overrides)
        assert tokens.tolist() == expected["input_ids"][0].tolist(), key
        assert tok.decode(tokens[targets.astype(bool)].tolist()) == "".join(t + "<|im_end|>" for t in turns[1::2])
        images = [m for m in seg.media if m.kind == "image"]
        videos = [m for m in seg.media if m.kind == "video"]
        if images:
            assert [m.grid_thw for m in images] == expected["image_grid_thw"].tolist(), key
        if videos:
            assert [m.grid_thw for m in videos] == expected["video_grid_thw"].tolist(), key
        for m in seg.media:
            a, b = m.span
            embed = video_id if m.kind == "video" else image_id
            assert a <= m.token_offset < b and tokens[m.token_offset] == embed
            assert int((tokens[a:b] == embed).sum()) == m.tokens
        if videos:  # the timestamps: one label per temporal group
            assert tok.decode(tokens.tolist()).count(" seconds>") == sum(m.grid_thw[0] for m in videos), key
    manifest = Manifest.read(run.out)
    assert manifest.image_processor["family"] == "qwen3_vl"
    assert manifest.video_processor["fps"] == run.overrides.get("video_fps", 2.0)


def test_the_qwen2_vl_rule_counts_differently(qwen3_run):
    """The control: the Qwen2-VL video rule on the same folder and videos gives other grids than the processor's
    (and writes no timestamps), so a test that compared with it would fail."""
    from transformers import AutoProcessor

    from packtool.families.qwen2_vl import Qwen2VLSettings

    run = qwen3_run
    processor = AutoProcessor.from_pretrained(str(run.folder))
    qwen2 = Qwen2VLSettings.from_folder(run.folder, fps=run.overrides.get("video_fps"))
    differ = 0
    for key in ("mp4", "mkv", "two_videos"):
        turns, specs = SAMPLES[key]
        expected = expected_ids(processor, turns, specs, run.sources[key][1], run.overrides)
        _, _, _, metas = processor_inputs(turns, specs, run.sources[key][1])
        for grid, meta in zip(expected["video_grid_thw"].tolist(), metas):
            from packtool.media.video import VideoFacts

            facts = VideoFacts(width=meta.width, height=meta.height, frames=meta.total_num_frames, fps=meta.fps,
                               duration=meta.duration, frame_count_source="header")
            differ += list(qwen2.video(facts).grid_thw) != grid
    assert differ > 0


def _segments_rope(batch, manifest, segs):
    """The model's ``get_rope_index`` on each segment alone (a tiny Qwen3-VL config; no weights are needed)."""
    import torch
    from transformers.models.qwen3_vl import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig(vision_config={"spatial_merge_size": manifest.image_processor["merge_size"]})
    model = SimpleNamespace(config=config,
                            get_vision_position_ids=lambda *a, **k: Qwen3VLModel.get_vision_position_ids(None, *a, **k))
    tokens = batch["tokens"][0]
    cu = batch["cu_seqlens_unpadded"].tolist()
    out = []
    for seg, a, b in zip(segs, cu[:-1], cu[1:]):
        ids = tokens[a:b][None]
        types = (ids == manifest.image_token_id).int() + 2 * (ids == manifest.video_token_id).int()
        image = [m.grid_thw for m in seg.media if m.kind == "image"]
        video = [m.grid_thw for m in seg.media if m.kind == "video"]
        pos, _ = Qwen3VLModel.get_rope_index(model, ids, types,
                                             torch.tensor(image) if image else None,
                                             torch.tensor(video) if video else None)
        out.append((a, b, pos))
    return out


def test_rope_per_segment_equals_the_model_on_each_segment_alone(qwen3_run):
    import torch

    from packtool.families.qwen3_vl.reader import batch_position_ids
    from packtool.runtime.read import read_packs

    run = qwen3_run
    manifest = Manifest.read(run.out)
    segments = {s.key: s for s, _, _, _ in fx.packed_segments(run.out)}
    batches = list(read_packs(run.out, images=False))
    assert batches
    several = 0
    for batch in batches:
        segs = [segments[k] for k in batch["keys"]]
        mine = batch_position_ids(batch, manifest)
        for i, (a, b, pos) in enumerate(_segments_rope(batch, manifest, segs)):
            assert torch.equal(mine[:, :, a:b], pos), (batch["keys"], i)
        several += len(segs) > 1
        if len(segs) > 1:  # the control: the whole row as one sequence places the second segment elsewhere
            a, b = batch["cu_seqlens_unpadded"].tolist()[1:3]
            whole = mine.clone()
            whole[:, :, a:b] += mine[:, :, a - 1:a].max() + 1
            assert not torch.equal(whole[:, :, a:b], mine[:, :, a:b])
    assert several


def test_the_reader_gives_the_processor_pixels(qwen3_run):
    from packtool.runtime.read import read_packs
    from packtool.verify.packs import verify_output

    run = qwen3_run
    for batch in read_packs(run.out):
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
        assert batch["pixel_values_videos"].shape[0] == int(batch["video_grid_thw"].prod(-1).sum())
    assert verify_output(run.out, retokenize=True) == []


def test_detection_is_exact(demo_dir, tmp_path):
    """Each Qwen3-VL name alone makes the folder Qwen3-VL's; other names do not; a Qwen2-VL-only setting is
    refused."""
    from packtool.families.qwen2_vl import Qwen2VL
    from packtool.families.qwen3_vl import Qwen3VL
    from packtool.packer.encoder import Encoder

    folder = qwen3_vl_model.write_model_folder(tmp_path / "m", tokenizer=demo_dir / "tokenizer",
                                               model_type="qwen3_vl_moe")
    assert isinstance(Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048)).family, Qwen3VL)
    with pytest.raises(ConfigError, match="image_resize do not apply to a Qwen3-VL"):
        Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048, image_resize="qwen_vl_utils"))
    with pytest.raises(ConfigError, match="image_tokens do not apply to a Qwen3-VL"):
        Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048, image_tokens=576))
    import json

    for name, key, other in (("preprocessor_config.json", "processor_class", "Qwen2_5_VLProcessor"),
                             ("video_preprocessor_config.json", "processor_class", "Qwen2_5_VLProcessor"),
                             ("video_preprocessor_config.json", "video_processor_type", "Qwen2VLVideoProcessor"),
                             ("config.json", "model_type", "qwen2_5_vl")):
        cfg = json.loads((folder / name).read_text())
        cfg[key] = other
        (folder / name).write_text(json.dumps(cfg))
    assert isinstance(Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048)).family, Qwen2VL)


def test_megatron_bridge_batches_are_refused(qwen3_run):
    """Megatron-Bridge's Qwen3-VL step takes a row as one sequence: a pack's batch is refused with the reason."""
    from packtool import families
    from packtool.families.qwen3_vl import Qwen3VL
    from packtool.runtime.megatron_batch import megatron_bridge_batch
    from packtool.runtime.read import read_packs

    batch = next(read_packs(qwen3_run.out, images=False))
    assert families.of_batch(batch) is Qwen3VL
    with pytest.raises(ValueError, match="qwen3_vl_step treats each batch row as one sequence"):
        megatron_bridge_batch(batch, temporal_patch_dim=2)


def _tiny_qwen3_vl(manifest, vocab_size: int):
    """A tiny random Qwen3-VL (fp32, eager attention, seed 0) over the packs' vocabulary and media tokens, its vision
    tower laid out as the folder's processor (patch, temporal patch, merge)."""
    import torch
    from transformers.models.qwen3_vl import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    proc = manifest.image_processor
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4,
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=int(proc["patch_size"]), spatial_merge_size=int(proc["merge_size"]),
                           temporal_patch_size=int(proc["temporal_patch_size"]), num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=manifest.image_token_id, video_token_id=manifest.video_token_id,
        vision_start_token_id=manifest.vision_start_token_id, vision_end_token_id=manifest.vision_end_token_id)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).eval()


def test_hugging_face_batch_packed_equals_each_segment_alone(qwen3_run):
    """``hf_batch`` of a Qwen3-VL pack (per-segment rope, media without ``second_per_grid_ts``) through a real
    Qwen3-VL forward gives each segment's logits and loss as that segment alone does; the control: plain text
    positions in place of the media's 3-D rope do not."""
    import torch

    from packtool.runtime.hf import check_model, hf_batch
    from packtool.runtime.read import read_packs
    from test_hf import check_packed_equals_alone

    run = qwen3_run
    manifest = Manifest.read(run.out)
    segments = {s.key: s for s, _, _, _ in fx.packed_segments(run.out)}
    batch = max(read_packs(run.out), key=lambda b: sum(len(segments[k].media) for k in b["keys"]))
    model = _tiny_qwen3_vl(manifest, int(batch["tokens"].max()) + 1)
    assert check_model(model).name == "qwen3_vl"
    row = hf_batch(batch, manifest)
    assert row["position_ids"].shape == (4, 1, row["input_ids"].shape[1]) and "second_per_grid_ts" not in row
    assert torch.equal(hf_batch(batch)["position_ids"], row["position_ids"])  # the reader batch alone suffices
    cu = row["cu_seq_lens_q"].tolist()
    ip = [0] + (row["image_grid_thw"].prod(-1).cumsum(0).tolist() if "image_grid_thw" in row else [])
    vp = [0] + (row["video_grid_thw"].prod(-1).cumsum(0).tolist() if "video_grid_thw" in row else [])
    images = videos = 0
    alone = []
    for key, lo, hi in zip(batch["keys"], cu[:-1], cu[1:]):
        kinds = [m.kind for m in segments[key].media]
        ni, nv = kinds.count("image"), kinds.count("video")
        inputs = {"input_ids": row["input_ids"][:, lo:hi], "mm_token_type_ids": row["mm_token_type_ids"][:, lo:hi]}
        if ni:
            inputs.update(pixel_values=row["pixel_values"][ip[images]:ip[images + ni]],
                          image_grid_thw=row["image_grid_thw"][images:images + ni])
        if nv:
            inputs.update(pixel_values_videos=row["pixel_values_videos"][vp[videos]:vp[videos + nv]],
                          video_grid_thw=row["video_grid_thw"][videos:videos + nv])
        images, videos = images + ni, videos + nv
        alone.append((inputs, row["labels"][:, lo:hi].clone()))
    assert len(alone) > 1 and videos >= 1
    check_packed_equals_alone(model, row, alone)
    flat = {**row, "position_ids": row["position_ids"][:1].expand(4, -1, -1).clone()}
    with torch.no_grad():  # control: text positions in place of the media's 3-D rope change the logits
        assert not torch.allclose(model(**flat).logits, model(**row).logits, atol=1e-4)
