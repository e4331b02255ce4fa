"""The reader on Nemotron Omni packs: every media tensor equals transformers' ``nemotron_h_omni`` processor's.

Packs are built by hand the way the encoder writes them (``PackRecord`` with ``MediaRef`` grids, token counts and
spans from ``NemotronOmniSettings`` of the model folder of ``examples/nemotron_omni_model.py``) around generated
media: images of several sizes, an mp4 video with an odd frame count, a one-frame frame list, WAV and FLAC clips.
The processor gets the same media sample by sample (one video per call, as it takes them), and its outputs are
compared with the reader's batch, all exactly: image pixels and grids, video pixels after laying them out as patches,
each clip's audio features and mask (the reader pads them to the pack's longest clip). Stored facts that disagree
with the processor's are refused.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mediafixture as mf
from packtool.errors import FormatError
from packtool.families.nemotron_omni import NemotronOmniSettings
from packtool.families.nemotron_omni.reader import nemotron_processors
from packtool.format import (
    FORMAT_VERSION,
    MANIFEST,
    TOKENIZER_DIR,
    Manifest,
    MediaRef,
    PackRecord,
    Segment,
    pack_key,
    sha256,
    shard_path,
    write_energon_metadata,
)
from packtool.media import decode_audio, decode_frames, decode_video, probe_audio, probe_frames, probe_video
from packtool.runtime.megatron_batch import megatron_bridge_batch
from packtool.runtime.read import pack_to_batch
from packtool.shards import write_tar

MAX_PIXELS = 10**8
# Token ids of examples/nemotron_omni_model.py's special tokens.
PAD, IMG_START, IMG_END, IMAGE, SO_START, SO_END, SO_EMB = 0, 3, 4, 5, 6, 7, 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A model folder with small budgets (fast) whose image settings the manifest then overrides."""
    import nemotron_omni_model

    return nemotron_omni_model.write_model_folder(
        tmp_path_factory.mktemp("nemotron") / "model",
        image={"min_num_patches": 64, "max_num_patches": 512},
        video={"video_target_num_patches": 64},
    )


@pytest.fixture(scope="module")
def settings(folder) -> NemotronOmniSettings:
    """The folder's settings with a smaller image budget and an audio cap, as packing-time overrides give them."""
    return NemotronOmniSettings.from_folder(folder, max_num_patches=256, audio_max_seconds=0.9)


def manifest_of(settings: NemotronOmniSettings) -> dict:
    return {"pad_token_id": PAD, "image_token_id": IMAGE, "audio_token_id": SO_EMB, "video_token_id": None,
            "video_processor": None, "image_processor": settings.manifest()}


# -- the samples ---------------------------------------------------------------------------------------------------
def video_bytes() -> bytes:
    return mf.make_video("mp4", width=96, height=40, frames=7, fps=4)


def clip(ext: str, rate: int, channels: int, seconds: float) -> bytes:
    return mf.make_audio(ext, samples=round(seconds * rate), rate=rate, channels=channels)


#: 0.64 s at 16 kHz is 64 mel hops: a length where counting from the mask's frames (64) instead of transformers'
#: frames + 1 (65) gives one audio token less, so the Megatron-Bridge lengths are tested where it matters.
#: Pack -> samples -> pieces: text, ("image", w, h), ("video", bytes), ("frames", [png bytes]), ("audio", bytes).
def samples() -> list[list[list]]:
    return [
        [
            ["Look:\n", ("image", 50, 70), ("image", 640, 480), "\nand hear:\n", ("audio", clip("wav", 16000, 1, 0.64)),
             "\nWhat is it?"],
            ["Watch:\n", ("video", video_bytes()), "\nthen:\n", ("image", 33, 300), "\nWhy?"],
            ["Listen:\n", ("audio", clip("flac", 44100, 2, 1.3)), "\nand\n", ("audio", clip("wav", 8000, 1, 0.25)),
             "\nok"],
            ["plain text, no media"],
        ],
        [["One frame:\n", ("frames", [mf.make_image(44, 36, seed=3)]), "\nWhat?"]],
    ]


def build_segment(pieces: list, settings: NemotronOmniSettings, tokenizer, key: str, first_member: int):
    """(segment tokens, MediaRefs, {member: bytes}) for one sample, each media expanded as the processor does."""
    tokens: list[int] = []
    refs, media = [], {}
    n_images = sum(1 for p in pieces if isinstance(p, tuple) and p[0] == "image")
    for piece in pieces:
        if isinstance(piece, str):
            tokens += tokenizer.encode(piece, add_special_tokens=False)
            continue
        kind, start, number = piece[0], len(tokens), first_member + len(refs)
        if kind == "image":
            _, w, h = piece
            data = mf.make_image(w, h, seed=number)
            gh, gw = settings.image_grid(w, h, n_images=n_images)
            n = settings.image_tokens(w, h, n_images=n_images)
            tokens += [IMG_START] + [IMAGE] * n + [IMG_END]
            member = f"m{number}.png"
            media[member] = data
            refs.append(MediaRef(member, "image", start + 1, n, [1, gh, gw], w, h, len(data), sha256(data),
                                 span=[start, len(tokens)]))
        elif kind in ("video", "frames"):
            if kind == "video":
                data, frames = piece[1], []
                facts = probe_video(data, max_pixels=MAX_PIXELS)
                member = f"m{number}.mp4"
                media[member] = data
            else:
                frames = [f"m{number}.{i}.png" for i in range(len(piece[1]))]
                media.update(zip(frames, piece[1]))
                facts = probe_frames(piece[1], max_pixels=MAX_PIXELS)
                member, data = frames[0], b"".join(piece[1])
            plan = settings.video(facts)
            tokens += tokenizer.encode(settings.video_text(facts), add_special_tokens=False)
            refs.append(MediaRef(member, "video", tokens.index(IMAGE, start), plan.tokens,
                                 [len(plan.indices), *plan.tile], facts.width, facts.height, len(data), sha256(data),
                                 frames=frames, total_frames=facts.frames, fps=facts.fps, duration=facts.duration,
                                 frame_indices=list(plan.indices), span=[start, len(tokens)]))
        else:
            data = piece[1]
            facts = probe_audio(data)
            n = settings.audio_tokens(facts)
            tokens += [SO_START] + [SO_EMB] * n + [SO_END]
            member = f"m{number}.{'wav' if data[:4] == b'RIFF' else 'flac'}"
            media[member] = data
            refs.append(MediaRef(member, "audio", start + 1, n, [1, 1, 1], 0, 0, len(data), sha256(data),
                                 span=[start, len(tokens)], samples=settings.audio_samples(facts)))
    return tokens, refs, media


def build_record(pack: list[list], settings, tokenizer, key: str) -> PackRecord:
    all_tokens, segments, media = [], [], {}
    for i, pieces in enumerate(pack):
        tokens, refs, members = build_segment(pieces, settings, tokenizer, f"{key}-s{i}", len(
            [m for s in segments for m in s.media]))
        all_tokens.append(tokens)
        segments.append(Segment(f"{key}-s{i}", "train", "src/train-0.tar", False, refs))
        media.update(members)
    tokens = np.concatenate([np.asarray(t, np.int32) for t in all_tokens])
    targets = np.zeros(len(tokens), np.uint8)
    targets[-3:] = 1
    return PackRecord(key, tokens, targets, np.array([len(t) for t in all_tokens], np.int32), 4096, 8, segments,
                      media, "0.1.0")


@pytest.fixture(scope="module")
def records(folder, settings):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [build_record(p, settings, tokenizer, pack_key("train", i)) for i, p in enumerate(samples())]


def read(record: PackRecord, manifest: dict, processors, **kw) -> dict:
    return pack_to_batch({**dict(record.to_members()), "__key__": record.key}, manifest, image_processor=processors,
                         **kw)


# -- what the processor makes of the same media ---------------------------------------------------------------------
def processor_outputs(folder: Path, settings: NemotronOmniSettings, record: PackRecord) -> list[dict]:
    """The transformers processor's output for each media item's sample, one call per sample (and per video)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    processor.image_processor.max_num_patches = settings.max_num_patches  # the packing-time override
    outs = []
    for seg in record.segments:
        images = [Image.open(io.BytesIO(record.media[m.member])) for m in seg.media if m.kind == "image"]
        waves = [decode_audio(record.media[m.member], rate=settings.audio_sampling_rate,
                              max_samples=settings.max_audio_samples) for m in seg.media if m.kind == "audio"]
        call: dict = {}
        if images:
            call["images"] = images
        if waves:
            call["audio"] = waves
        text = "<image>" * len(images) + "<so_embedding>" * len(waves)
        out = dict(processor(text=text, return_tensors="pt", **call)) if call else {}
        for m in (m for m in seg.media if m.kind == "video"):
            frames = (decode_frames([record.media[f] for f in m.frames], m.frame_indices) if m.frames
                      else decode_video(record.media[m.member], m.frame_indices))
            video = processor(text="<video>", videos=[frames], do_sample_frames=False, return_tensors="pt")
            out.setdefault("videos", []).append(video)
        outs.append(out)
    return outs


def test_reader_equals_the_processor(torchvision, folder, settings, records):
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import convert_image_to_patches

    manifest = manifest_of(settings)
    processors = nemotron_processors(manifest, folder)
    for record in records:
        batch = read(record, manifest, processors)
        outs = processor_outputs(folder, settings, record)
        refs = record.media_refs
        assert batch["media_kinds"] == [m.kind for m in refs]

        # Images: the processor's pixel values and grids, sample after sample.
        pixels = [o["pixel_values"] for o in outs if "pixel_values" in o]
        grids = [o["image_grid_hw"] for o in outs if "image_grid_hw" in o]
        assert batch["pixel_values"].dtype == torch.float32 and batch["pixel_values"].shape[1] == 3 * 16 * 16
        assert torch.equal(batch["pixel_values"], torch.cat(pixels) if pixels else torch.zeros((0, 768)))
        assert batch["image_grid_hw"].tolist() == (torch.cat(grids).tolist() if grids else [])
        assert batch["image_grid_hw"].tolist() == [m.grid_thw[1:] for m in refs if m.kind == "image"]

        # Videos: the processor's frames, as patches; grids (frames, tile) in patches.
        videos = [v for o in outs for v in o.get("videos", [])]
        expected = [convert_image_to_patches(v["pixel_values_videos"], 16).reshape(-1, 768) for v in videos]
        assert torch.equal(batch["pixel_values_videos"], torch.cat(expected) if expected else torch.zeros((0, 768)))
        assert batch["video_grid_thw"].tolist() == [
            [v["pixel_values_videos"].shape[0], v["pixel_values_videos"].shape[2] // 16,
             v["pixel_values_videos"].shape[3] // 16] for v in videos]
        for v, m in zip(videos, (m for m in refs if m.kind == "video")):
            assert int((v["input_ids"] == IMAGE).sum()) == m.tokens  # the processor's own expansion

        # Audio: each clip's valid mel frames equal the processor's (clips padded to the pack's longest).
        features = [(o["input_features"], o["input_features_mask"]) for o in outs if "input_features" in o]
        clips = [m for m in refs if m.kind == "audio"]
        assert batch["input_features"].shape[0] == len(clips) == sum(len(f) for f, _ in features)
        row = 0
        for feats, mask in features:
            for i in range(len(feats)):
                mine, mine_mask = batch["input_features"][row], batch["input_features_mask"][row]
                n = int(mask[i].sum())
                assert int(mine_mask.sum()) == n and mine_mask[:n].all()
                assert torch.equal(mine[:feats.shape[1]], feats[i])
                assert not mine[feats.shape[1]:].any()
                row += 1
        token_counts = [int((o["input_ids"] == SO_EMB).sum()) for o in outs if "input_features" in o]
        assert sum(token_counts) == sum(m.tokens for m in clips)


def test_megatron_bridge_layout(torchvision, folder, settings, records):
    """The batch Megatron-Bridge's `nemotron_omni_step` reads: all image and frame patches in placeholder order
    with their pixel sizes and frame counts, audio features with lengths that give each clip's token count."""
    manifest = manifest_of(settings)
    processors = nemotron_processors(manifest, folder)
    for record in records:
        batch = read(record, manifest, processors)
        mb = megatron_bridge_batch(batch, temporal_patch_dim=settings.video_temporal_patch_dim)
        visual = [m for m in record.media_refs if m.kind != "audio"]
        images = iter(torch.split(batch["pixel_values"], batch["image_grid_hw"].prod(-1).tolist()))
        videos = iter(torch.split(batch["pixel_values_videos"], batch["video_grid_thw"].prod(-1).tolist()))
        blocks, sizes, frames = [], [], []
        for m in visual:
            t, h, w = m.grid_thw
            block = next(images if m.kind == "image" else videos)
            if m.kind == "video" and t == 1:  # one frame: given twice, so the temporal embedder takes it
                block, t = torch.cat([block, block]), 2
            blocks.append(block)
            sizes += [[h * 16, w * 16]] * t
            frames.append(t)
        assert {"imgs_sizes", "num_frames", "sound_clips", "sound_length", "visual_inputs"} <= mb.keys()
        assert torch.equal(mb["visual_inputs"].pixel_values, torch.cat(blocks)[None])
        assert mb["imgs_sizes"].dtype == mb["num_frames"].dtype == torch.int64
        assert mb["imgs_sizes"].tolist() == sizes and mb["num_frames"].tolist() == frames
        # every patch row belongs to one size entry (the vision encoder's THD boundaries)
        assert sum(h // 16 * w // 16 for h, w in sizes) == mb["visual_inputs"].pixel_values.shape[1]
        # image and video-chunk placeholders: one per projected feature (2x2 pixel shuffle; tubelets of 2 frames)
        features = sum(h * w // 4 * (1 if m.kind == "image" else -(-t // 2)) for m in visual
                       for t, h, w in [m.grid_thw])
        assert int((mb["tokens"] == IMAGE).sum()) == features
        clips = [m for m in record.media_refs if m.kind == "audio"]
        if not clips:
            assert mb["sound_clips"] is None and mb["sound_length"] is None
            continue
        assert mb["sound_clips"] is batch["input_features"] and mb["sound_length"].dtype == torch.int64
        for length, m in zip(mb["sound_length"].tolist(), clips):
            assert length <= mb["sound_clips"].shape[1]
            for _ in range(3):  # the encoder's three stride-2 convolutions (kernel 3, padding 1)
                length = (length + 2 - 3) // 2 + 1
            assert length == m.tokens


def test_stored_facts_that_disagree_are_refused(torchvision, folder, settings, records):
    manifest = manifest_of(settings)
    processors = nemotron_processors(manifest, folder)
    record = records[0]

    def changed(member: str, **change) -> PackRecord:
        segments = [replace(s, media=[replace(m, **change) if m.member == member else m for m in s.media])
                    for s in record.segments]
        return replace(record, segments=segments)

    image = next(m for m in record.media_refs if m.kind == "image")
    video = next(m for m in record.media_refs if m.kind == "video")
    audio = next(m for m in record.media_refs if m.kind == "audio")
    read(record, manifest, processors)  # the control: as built, it reads
    with pytest.raises(FormatError, match=f"pack train-000000000: {image.member} processes to grid"):
        read(changed(image.member, grid_thw=[1, image.grid_thw[1] + 2, image.grid_thw[2]]), manifest, processors)
    with pytest.raises(FormatError, match=f"{video.member} processes to grid"):
        read(changed(video.member, grid_thw=[video.grid_thw[0] - 1, *video.grid_thw[1:]]), manifest, processors)
    with pytest.raises(FormatError, match=f"{audio.member} decodes to"):
        read(changed(audio.member, samples=audio.samples + 1), manifest, processors)
    # a span that leaves out the video's last chunk no longer holds its placeholders
    with pytest.raises(FormatError, match=f"{video.member} of segment .* does not match its video tokens"):
        read(changed(video.member, span=[video.span[0], video.span[1] - 10]), manifest, processors)
    with pytest.raises(FormatError, match="does not match its audio tokens"):
        read(changed(audio.member, token_offset=audio.token_offset - 1), manifest, processors)
    with pytest.raises(ValueError, match="no processors"):
        read(record, manifest, None)
    grids = read(record, manifest, None, images=False)  # grids only: no processor needed
    assert grids["image_grid_hw"].tolist() == [m.grid_thw[1:] for m in record.media_refs if m.kind == "image"]
    assert "pixel_values" not in grids


# -- on disk: read_packs and the Energon task encoder find the processors in OUTPUT ------------------------------
@pytest.fixture(scope="module")
def dataset(folder, settings, records, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nemotron-out")
    name = shard_path("train", 0)
    index = write_tar(out / name, ((r.key, r.to_members()) for r in records))
    write_energon_metadata(out, {"train": [name]}, {name: index}, "7.4.1")
    (out / TOKENIZER_DIR).mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json"):
        (out / TOKENIZER_DIR / f).write_bytes((folder / f).read_bytes())
    fields = manifest_of(settings)
    manifest = Manifest(packtool="0.1.0", format=FORMAT_VERSION, fingerprint={}, settings={}, source="by hand",
                        splits={"train": [name]}, tokenizer={"fingerprint": "", "dir": TOKENIZER_DIR},
                        pad_token_id=PAD, eos_token_id=2, image_token_id=IMAGE, vision_start_token_id=None,
                        vision_end_token_id=None, image_processor=fields["image_processor"], seed=0, counts={},
                        packs={"train": len(records)})
    data = json.loads(manifest.to_bytes())
    data["audio_token_id"] = SO_EMB  # the audio placeholder id (a Manifest without the field ignores it)
    (out / MANIFEST).write_text(json.dumps(data))
    return out


def test_read_packs_and_energon_encoder(torchvision, folder, settings, records, dataset):
    from megatron.energon import WorkerConfig, get_savable_loader, get_val_dataset

    from packtool.runtime.loader import MegatronBridgeTaskEncoder, PackTaskEncoder, collate_packs
    from packtool.runtime.read import read_packs

    manifest = manifest_of(settings)
    direct = [read(r, manifest, nemotron_processors(manifest, folder)) for r in records]
    for mine, want in zip(read_packs(dataset), direct):
        for key in ("pixel_values", "pixel_values_videos", "input_features", "input_features_mask"):
            assert torch.equal(mine[key], want[key]), key

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)

    def loader(encoder, batch_size):
        return get_savable_loader(get_val_dataset(dataset, split_part="train", worker_config=wc,
                                                  batch_size=batch_size, task_encoder=encoder))

    for row in loader(PackTaskEncoder(), 1):
        want = direct[[r.key for r in records].index(row["pack_key"])]
        assert all(torch.equal(row[k], want[k]) for k in ("pixel_values", "pixel_values_videos", "input_features"))
    both = next(iter(loader(MegatronBridgeTaskEncoder(), 2)))
    want = megatron_bridge_batch(collate_packs(direct, PAD))
    assert both["pack_key"] == [r.key for r in records]
    for key in ("tokens", "imgs_sizes", "num_frames", "sound_clips", "sound_length", "cu_seqlens_q_padded"):
        assert torch.equal(both[key], want[key]), key
    assert torch.equal(both["visual_inputs"].pixel_values, want["visual_inputs"].pixel_values)
    # the second pack's clip-free rows pad nothing; the first pack's clips keep their features
    assert both["sound_clips"].shape[0] == sum(m.kind == "audio" for r in records for m in r.media_refs)
