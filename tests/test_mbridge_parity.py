"""`--preset megatron-bridge-qwen-vl` against Megatron-Bridge's own Qwen-VL Energon path, sample by sample.

Megatron-Bridge's code runs as is (its wheel, imported by :mod:`mbridge_ref`): Energon's own loader reads a
``ChatMLWebdataset`` (Megatron-Bridge's converter layout: pickled encoded images in ``jpgs``) through
``QwenVLTaskEncoder`` (qwen_vl_utils' ``process_vision_info`` then the Qwen2.5-VL processor), one sample a batch.
packtool packs the same dataset with the preset and its reader reads the packs back. For every sample the tokens,
labels, loss mask, image grids and pixel values must be identical; the differences packtool chooses are named
(untagged images, video files: Megatron-Bridge's path cannot read them, so they are compared with Megatron-Bridge
given their decoded frames) and checked as such. Megatron-Bridge's ``process_vision`` calls the processor the way
transformers <= 5.12.1 accepts (Megatron-Bridge's pin): these tests run in that environment (`make test`).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import demo
import mbridge_ref
from packtool.format import load_manifest
from packtool.packer.pipeline import pack
from packtool.packer.sources.safepickle import png_bytes
from packtool.runtime.read import read_packs
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from packtool.verify.packs import verify_output

DATASET_YAML = {"__module__": "megatron.bridge.data.energon.task_encoder_utils", "__class__": "ChatMLWebdataset",
                "field_map": {"imgs": "jpgs", "videos": "videos", "conversation": "json"}, "subflavors": {}}
IGNORE = -100


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    return png_bytes(np.array(demo.render_image(width, height, seed, mode=mode)))


def chat(*turns: str) -> bytes:
    roles = ["human", "gpt"]
    return json.dumps([{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]).encode()


#: Image sizes: one-step and two-step grids differ for many (604x172: 18x62 two-step, 18x60 one-step), thin and
#: large ones hit qwen_vl_utils' own bounds, small ones the preset's minimum.
SIZES = [(604, 172), (64, 48), (300, 200), (1200, 900), (37, 500), (2000, 1500), (448, 448), (500, 37),
         (1000, 120), (90, 40), (777, 333), (28, 28)]


def samples() -> dict[str, dict[str, bytes]]:
    none = pickle.dumps([])
    out: dict[str, dict[str, bytes]] = {}
    for i, (w, h) in enumerate(SIZES):
        out[f"one{i}"] = {"jpgs": pickle.dumps([picture(w, h, i)]), "videos": none,
                          "json": chat("<image>\nWhat is shown?", "Cells.")}
    out["two"] = {"jpgs": pickle.dumps([picture(56, 56, 20), picture(640, 180, 21)]), "videos": none,
                  "json": chat("Compare <image> and <image> here.", "The second is wider.")}
    out["turns"] = {"jpgs": pickle.dumps([picture(320, 240, 22), picture(150, 600, 23)]), "videos": none,
                    "json": chat("<image> Colours?", "Several.", "And this one <image>?", "Blue.")}
    out["gray"] = {"jpgs": pickle.dumps([picture(200, 100, 24, mode="L")]), "videos": none,
                   "json": chat("Describe <image>", "Gray blocks.")}
    out["text"] = {"jpgs": none, "videos": none, "json": chat("Say hello.", "Hello.", "Again?", "Hello.")}
    out["eleven"] = {"jpgs": pickle.dumps([picture(40, 40, 30 + i) for i in range(11)]), "videos": none,
                     "json": chat("<image>" * 11 + "How many?", "Eleven.")}
    out["untagged"] = {"jpgs": pickle.dumps([picture(300, 120, 40)]), "videos": none,
                       "json": chat("What is in the picture?", "Blocks.")}
    for i, (n, w, h) in enumerate([(8, 320, 240), (5, 128, 96), (4, 640, 360), (61, 64, 48)]):
        frames = [picture(w, h, 100 + 10 * i + k) for k in range(n)]
        out[f"video{i}"] = {"jpgs": none, "videos": pickle.dumps([frames]),
                            "json": chat("<video>\nWhat happens?", "Nothing.")}
    out["mixed"] = {"jpgs": pickle.dumps([picture(200, 150, 50)]),
                    "videos": pickle.dumps([[picture(96, 96, 60 + k) for k in range(3)]]),
                    "json": chat("<image> and <video>: the same?", "No.")}
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mbparity") / "wds"
    demo.write_shard(root / "s-0.tar", samples().items())
    demo.prepare_energon(root, ["s-0.tar"], {"train": ["s-0.tar"]}, dataset_yaml=DATASET_YAML)
    return root


def qwen_processor(folder: Path):
    """The Qwen2.5-VL processor Megatron-Bridge builds from a model folder (transformers' default backend)."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = AutoTokenizer.from_pretrained(folder)
    return tok, Qwen2_5_VLProcessor(image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tok,
                                    video_processor=Qwen2VLVideoProcessor(), chat_template=tok.chat_template)


@pytest.fixture(scope="module")
def bridge(dataset, demo_dir) -> dict[str, dict]:
    """Megatron-Bridge's batch of every sample it keeps, by key (its padding removed)."""
    return bridge_batches(dataset, demo_dir / "tokenizer")


def packed_samples(out: Path) -> dict[str, dict]:
    """Each packed sample as the reader gives it: its tokens, labels, loss mask, image grids and pixel values."""
    manifest = load_manifest(out)
    got = {}

    def runs(ids: torch.Tensor, token: int) -> int:
        hit = (ids == token).int()
        return int(((hit[1:] - hit[:-1]) == 1).sum() + hit[0])  # runs of placeholders: one per item

    for batch in read_packs(out, pad_to="segments"):
        cu, starts = batch["cu_seqlens_unpadded"].tolist(), batch["cu_seqlens_padded"].tolist()
        grids, video_grids = batch["image_grid_thw"], batch["video_grid_thw"]
        patches = list(torch.split(batch["pixel_values"], [int(g.prod()) for g in grids]))
        video_patches = list(torch.split(batch["pixel_values_videos"], [int(g.prod()) for g in video_grids]))
        first = first_video = 0
        for i, key in enumerate(batch["keys"]):
            a, n = starts[i], cu[i + 1] - cu[i]
            ids = batch["tokens"][0, a:a + n]
            images, videos = runs(ids, manifest["image_token_id"]), runs(ids, manifest["video_token_id"])
            got[key] = {"tokens": ids.tolist(), "labels": batch["labels"][0, a:a + n].tolist(),
                        "loss_mask": batch["loss_mask"][0, a:a + n].tolist(),
                        "grid": grids[first:first + images].tolist(),
                        "pixels": torch.cat(patches[first:first + images]) if images else None,
                        "video_grid": video_grids[first_video:first_video + videos].tolist(),
                        "video_pixels": torch.cat(video_patches[first_video:first_video + videos]) if videos else None,
                        "second_per_grid_ts": batch["second_per_grid_ts"][first_video:first_video + videos].tolist()}
            first += images
            first_video += videos
    return got


@pytest.fixture(scope="module")
def packed(dataset, demo_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mbparity-out") / "out"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=8192, allow_pickle=True,
                                           preset="megatron-bridge-qwen-vl"), PlanSettings(shard_size="4"))
    pack(dataset, out, settings, workers=1, progress=False)
    return out


def ledger(out: Path) -> dict[str, dict]:
    return {r["key"]: r for r in pq.read_table(out / "ledger.parquet").to_pylist()}


def test_every_sample_equals_megatron_bridge(bridge, packed):
    """Tokens, labels, loss mask, image and video grids, second_per_grid_ts and pixel values of every sample both
    keep, identical (videos: 61 frames keep the first 60)."""
    mine = packed_samples(packed)
    compared = set(bridge) - {"untagged"}
    assert compared == set(samples()) - {"eleven", "untagged"}  # Megatron-Bridge skips the 11-image sample
    assert set(mine) == set(samples()) - {"eleven"}
    for key in sorted(compared):
        theirs, ours = bridge[key], mine[key]
        assert ours["tokens"] == theirs["tokens"], key
        assert ours["labels"] == theirs["labels"], key
        assert ours["loss_mask"] == theirs["loss_mask"], key
        assert ours["grid"] == theirs["grid"], key
        assert ours["video_grid"] == theirs["video_grid"], key
        assert ours["second_per_grid_ts"] == theirs["second_per_grid_ts"], key
        for name in ("pixels", "video_pixels"):
            if theirs[name] is None:
                assert ours[name] is None, key
            else:
                assert torch.equal(ours[name], theirs[name]), (key, name)


def test_limits_and_untagged_images_are_in_the_ledger(bridge, packed):
    """The 11-image sample is dropped (Megatron-Bridge skips it); the untagged image is trained, placed before the
    text, and the ledger says so (Megatron-Bridge trains that sample's text only)."""
    rows = ledger(packed)
    assert rows["eleven"]["status"] == "dropped"
    assert rows["eleven"]["reason"] == "over limit: 11 images > sample_max_images 10"
    assert rows["untagged"]["status"] == "packed"
    assert "1 untagged media placed before the first user text" in rows["untagged"]["reason"]
    assert all(r["reason"] == "" for k, r in rows.items() if k not in ("eleven", "untagged"))
    mine = packed_samples(packed)["untagged"]
    assert len(mine["grid"]) == 1 and bridge["untagged"]["grid"] == []


def test_one_step_resize_differs(bridge, dataset, demo_dir, tmp_path):
    """Control: the processor's rule alone (the preset's bounds, no first resize) gives other grids."""
    out = tmp_path / "one-step"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=8192, allow_pickle=True,
                                           media_first=True, target_newline_after_eot=True, min_pixels=200_704,
                                           max_pixels=1_003_520), PlanSettings(shard_size="4"))
    pack(dataset, out, settings, workers=1, progress=False)
    mine = packed_samples(out)
    differ = [k for k in bridge if k in mine and mine[k]["grid"] != bridge[k]["grid"]]
    assert "one0" in differ and len(differ) >= 3, differ


# ---------------------------------------------------------------------------------------------------------------
# Encoded video files (mp4, webm, mkv, mov, avi members)
# ---------------------------------------------------------------------------------------------------------------

#: Encoded videos: (extension, frames, fps, width, height): odd and even frame counts, several rates and sizes, one
#: past the 60-frame cut, one large enough for the video bounds, one thin.
VIDEO_FILES = [("mp4", 8, 4, 128, 96), ("webm", 7, 10, 160, 120), ("mkv", 9, 2, 96, 64), ("mov", 6, 25, 200, 150),
               ("avi", 5, 12, 64, 48), ("mp4", 75, 30, 64, 48), ("mp4", 4, 24, 640, 360), ("webm", 3, 5, 320, 48)]


def video_files() -> dict[str, list[tuple[str, bytes]]]:
    """Each encoded-video sample's videos: member names and bytes, in placeholder order."""
    out = {f"file{i}": [(ext, demo.make_video(ext, width=w, height=h, frames=n, fps=fps))]
           for i, (ext, n, fps, w, h) in enumerate(VIDEO_FILES)}
    out["filemixed"] = [("mp4", demo.make_video("mp4", width=112, height=80, frames=5, fps=8))]
    # 64 frames of 1280x720: past the 60-frame cut and, all 60 kept, past the visual-token limit (dropped by both).
    out["filebig"] = [("mp4", demo.make_video("mp4", width=1280, height=720, frames=64, fps=30))]
    out["filetwo"] = [("video0.mp4", demo.make_video("mp4", width=96, height=96, frames=6, fps=6)),
                      ("video1.mkv", demo.make_video("mkv", width=160, height=90, frames=11, fps=15))]
    return out


def video_file_chat(key: str) -> bytes:
    if key == "filemixed":
        return chat("<image> and <video>: the same?", "No.")
    if key == "filetwo":
        return chat("Is <video> longer than <video>?", "No.")
    return chat("<video>\nWhat happens?", "Nothing.")


def frame_list_dataset(root: Path, fps: float | None = None) -> Path:
    """Megatron-Bridge's frame-list layout of the encoded videos: every frame as decoded (PyAV, lossless PNG), or
    with ``fps`` the frames transformers' ``Qwen2VLVideoProcessor`` samples at that rate."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from packtool.media import decode_video, probe_video

    frame_lists: dict[str, dict[str, bytes]] = {}
    for key, videos in video_files().items():
        lists = []
        for _, data in videos:
            facts = probe_video(data, max_pixels=1 << 30, decode=True)
            indices = range(facts.frames) if fps is None else Qwen2VLVideoProcessor().sample_frames(
                VideoMetadata(total_num_frames=facts.frames, fps=facts.fps), fps=fps).tolist()
            lists.append([png_bytes(f) for f in decode_video(data, indices)])
        jpgs = [picture(200, 150, 70)] if key == "filemixed" else []
        frame_lists[key] = {"jpgs": pickle.dumps(jpgs), "videos": pickle.dumps(lists), "json": video_file_chat(key)}
    demo.write_shard(root / "s-0.tar", frame_lists.items())
    demo.prepare_energon(root, ["s-0.tar"], {"train": ["s-0.tar"]}, dataset_yaml=DATASET_YAML)
    return root


@pytest.fixture(scope="module")
def file_datasets(tmp_path_factory) -> tuple[Path, Path]:
    """The encoded videos twice: as members (what packtool packs), and, for Megatron-Bridge, as its frame-list
    layout holding every frame of each video, since its Energon path cannot read a video file (see
    :func:`test_megatron_bridge_skips_encoded_video_bytes`)."""
    mbridge_ref.load("models.qwen_vl.data.energon")  # skips before building them where it is not installed
    root = tmp_path_factory.mktemp("mbparity-files")
    members: dict[str, dict[str, bytes]] = {}
    for key, videos in video_files().items():
        image = {"png": picture(200, 150, 70)} if key == "filemixed" else {}
        members[key] = {**dict(videos), **image, "json": video_file_chat(key)}
    demo.write_shard(root / "files/s-0.tar", members.items())
    demo.prepare_energon(root / "files", ["s-0.tar"], {"train": ["s-0.tar"]},
                         dataset_yaml={"__module__": "megatron.energon", "__class__": "CrudeWebdataset"})
    return root / "files", frame_list_dataset(root / "frames")


def bridge_batches(dataset: Path, folder: Path, **limits) -> dict[str, dict]:
    """Megatron-Bridge's batch of every sample its Energon path keeps, by key (its padding removed)."""
    energon = mbridge_ref.load("models.qwen_vl.data.energon")
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    tok, processor = qwen_processor(folder)
    encoder = energon.QwenVLTaskEncoder(tok, processor, max_padding_length=8192, **limits)
    loader = get_loader(get_val_dataset(dataset, split_part="train", batch_size=1, task_encoder=encoder,
                                        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0)))
    out = {}
    for batch in loader:
        real = batch["attention_mask"][0].bool()
        vi = batch["visual_inputs"]
        grid = getattr(vi, "image_grid_thw", None) if vi is not None else None
        video_grid = getattr(vi, "video_grid_thw", None) if vi is not None else None
        out[batch["__keys__"][0]] = {
            "tokens": batch["input_ids"][0][real].tolist(), "labels": batch["labels"][0][real].tolist(),
            "loss_mask": batch["loss_mask"][0][real].tolist(),
            "grid": [] if grid is None else grid.tolist(),
            "pixels": None if grid is None else vi.pixel_values.float(),
            "video_grid": [] if video_grid is None else video_grid.tolist(),
            "video_pixels": None if video_grid is None else vi.pixel_values_videos.float(),
            "second_per_grid_ts": [] if video_grid is None else vi.second_per_grid_ts.tolist(),
        }
    return out


@pytest.fixture(scope="module")
def bridge_frames(file_datasets, demo_dir) -> dict[str, dict]:
    """Megatron-Bridge's batches of the video files' frame lists."""
    return bridge_batches(file_datasets[1], demo_dir / "tokenizer")


def test_encoded_videos_equal_megatron_bridge_on_their_frames(file_datasets, bridge_frames, demo_dir, tmp_path):
    """packtool packs each video file; Megatron-Bridge reads the same video's decoded frames as a frame list.
    Tokens, labels, loss mask, grids, second_per_grid_ts and pixel values are identical for every sample."""
    assert_same_as_frames(file_datasets[0], bridge_frames, demo_dir, tmp_path, dropped={"filebig"})


def test_sampled_video_files_equal_megatron_bridge_on_their_frames(file_datasets, demo_dir, tmp_path):
    """With ``--video-fps 2`` packtool takes the frames transformers' rule samples at 2 fps: identical to
    Megatron-Bridge given those frames."""
    theirs = bridge_batches(frame_list_dataset(tmp_path / "frames", fps=2), demo_dir / "tokenizer")
    mine = assert_same_as_frames(file_datasets[0], theirs, demo_dir, tmp_path, video_fps=2)
    assert mine["filebig"]["video_grid"] == [[2, 40, 72]]  # 4 of its frames: within the limit
    assert mine["file5"]["video_grid"][0][0] == 2  # 75 frames at 30 fps: 4 of them at 2 fps (an even count)


def test_video_files_without_fetch_video_differ(file_datasets, bridge_frames, demo_dir, tmp_path):
    """Control: the preset's choices but the processor's resize alone (no fetch_video first) give other video
    grids, pixels and second_per_grid_ts."""
    out = tmp_path / "out"
    pack(file_datasets[0], out, PackSettings(EncodeSettings(
        tokenizer=str(demo_dir / "tokenizer"), pack_size=8192, media_first=True, target_newline_after_eot=True,
        min_pixels=200_704, max_pixels=1_003_520, video_min_pixels=200_704, video_max_pixels=1_003_520,
        video_keep_frames=60), PlanSettings(shard_size="4")), workers=1, progress=False)
    mine = packed_samples(out)
    differ = {name for key in bridge_frames for name in differences(mine[key], bridge_frames[key])}
    assert {"video_grid", "video_pixels", "second_per_grid_ts"} <= differ, differ


def assert_same_as_frames(files: Path, theirs_all: dict[str, dict], demo_dir: Path, tmp_path: Path,
                          dropped: frozenset[str] | set[str] = frozenset(), **settings) -> dict[str, dict]:
    """Pack the video files with the preset and compare every sample with Megatron-Bridge's batch; ``dropped``:
    the samples both leave out (packtool's ledger names the limit)."""
    out = tmp_path / "out"
    pack(files, out, PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=8192,
                                                 preset="megatron-bridge-qwen-vl", **settings),
                                  PlanSettings(shard_size="4")), workers=1, progress=False)
    assert verify_output(out, source=files) == []
    mine = packed_samples(out)
    assert set(theirs_all) == set(mine) == set(video_files()) - dropped
    assert all(ledger(out)[key]["reason"].startswith("over limit: ") for key in dropped)
    assert len(mine["filetwo"]["video_grid"]) == 2
    differ = [(key, name) for key in sorted(mine) for name in differences(mine[key], theirs_all[key])]
    assert differ == [], differ
    return mine


def differences(ours: dict, theirs: dict) -> list[str]:
    """The names of the fields where two samples differ."""
    out = [name for name in ("tokens", "labels", "loss_mask", "grid", "video_grid", "second_per_grid_ts")
           if ours[name] != theirs[name]]
    for name in ("pixels", "video_pixels"):
        if (ours[name] is None) != (theirs[name] is None) or (
                theirs[name] is not None and not torch.equal(ours[name], theirs[name])):
            out.append(name)
    return out


@pytest.fixture(scope="module")
def bytes_dataset(tmp_path_factory) -> Path:
    """Megatron-Bridge's layout with the video file itself as the ``videos`` field (``field_map`` ``videos: mp4``:
    the bytes, which ``normalize_energon_vlm_sample`` takes as one video)."""
    root = tmp_path_factory.mktemp("mbparity-bytes") / "wds"
    ext, n, fps, w, h = VIDEO_FILES[0]
    samples = {"file0": {ext: demo.make_video(ext, width=w, height=h, frames=n, fps=fps),
                         "json": video_file_chat("file0")}}
    demo.write_shard(root / "s-0.tar", samples.items())
    demo.prepare_energon(root, ["s-0.tar"], {"train": ["s-0.tar"]},
                         dataset_yaml={**DATASET_YAML, "field_map": {"videos": "mp4", "conversation": "json"}})
    return root


@pytest.mark.parametrize("limits", [{}, {"max_num_frames": None, "max_visual_tokens": None}], ids=["default", "off"])
def test_megatron_bridge_skips_encoded_video_bytes(bytes_dataset, bridge_frames, demo_dir, limits):
    """Megatron-Bridge's Qwen-VL Energon path cannot read a video file: its ``max_num_frames`` cut takes the file's
    byte count for a frame count and keeps its first 60 bytes, which transformers' video processor refuses in the
    ``max_visual_tokens`` check; without both limits qwen_vl_utils' ``fetch_video`` asserts a path or a frame list.
    Energon skips the sample either way (control: the same video as a frame list is kept). packtool trains it, and
    its ledger row says so. If this test fails, Megatron-Bridge reads video files now and the preset should
    follow."""
    assert bridge_batches(bytes_dataset, demo_dir / "tokenizer", **limits) == {}
    assert "file0" in bridge_frames


def test_video_files_are_trained_and_noted(bytes_dataset, demo_dir, tmp_path):
    """The preset packs the video file Megatron-Bridge skips, with a ledger note (frame lists get none:
    :func:`test_limits_and_untagged_images_are_in_the_ledger`)."""
    out = tmp_path / "out"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=8192,
                                           preset="megatron-bridge-qwen-vl"), PlanSettings(shard_size="4"))
    pack(bytes_dataset, out, settings, workers=1, progress=False)
    rows = ledger(out)
    assert rows["file0"]["reason"] == ("1 video file decoded and trained as a frame list (Megatron-Bridge's Qwen-VL "
                                      "Energon path cannot read video files and skips such a sample)")
    assert len(packed_samples(out)["file0"]["video_grid"]) == 1
