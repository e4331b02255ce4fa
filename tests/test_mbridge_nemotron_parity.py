"""`--preset megatron-bridge-nemotron-omni` against Megatron-Bridge's own Nemotron Omni Energon path, sample by sample.

Megatron-Bridge's code runs as is (:mod:`mbridge_nemotron_ref`, in a process of its own): Energon's loader reads a
``ChatMLWebdataset`` through ``NemotronOmniTaskEncoder`` with its Energon recipe's settings (temporal video embedder)
and transformers' own Nemotron Omni processor of the demo folder, one sample a batch. packtool packs the same dataset
with the preset, its reader and ``megatron_bridge_batch`` read the packs back, and for every sample the tokens,
labels, loss mask, pixel values, ``imgs_sizes``, ``num_frames``, ``num_image_tiles``, ``sound_clips`` and
``sound_length`` must be identical. The differences packtool chooses are named and checked as such.

Versions: Megatron-Bridge 0.6.2 (its wheel, which `make` installs into ``.venv-mbridge/mbridge``; its compact
placeholders expanded by its own per-tubelet count, packed with ``audio_count="frames"``), and main where
``PACKTOOL_MBRIDGE_MAIN`` names a folder holding main's ``src/megatron/bridge`` (packed with the default
``audio_count="valid"``). Both run under the main environment's transformers (5.23): Megatron-Bridge's pins
(transformers 5.12.1) lack the ``nemotron_h_omni`` processor, and their ParakeetFeatureExtractor needs librosa.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
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
from packtool.runtime.megatron_batch import megatron_bridge_batch
from packtool.runtime.read import read_packs
from packtool.settings import EncodeSettings, PackSettings, PlanSettings

PRESET = "megatron-bridge-nemotron-omni"
FIELDS = {"imgs": "jpgs", "videos": "videos", "conversation": "json"}
HERE = Path(__file__).resolve().parent


def dataset_yaml(audio: bool, videos: str = "videos") -> dict:
    return {"__module__": "megatron.bridge.data.energon.task_encoder_utils", "__class__": "ChatMLWebdataset",
            "field_map": {**FIELDS, "videos": videos, **({"audio": "wav"} if audio else {})}, "subflavors": {}}


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    return png_bytes(np.array(demo.render_image(width, height, seed, mode=mode)))


def chat(*turns: str) -> bytes:
    roles = ["human", "gpt"]
    return json.dumps([{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]).encode()


def frames(n: int, width: int, height: int, seed: int) -> list[bytes]:
    return [picture(width, height, seed + k) for k in range(n)]


NONE = pickle.dumps([])


def visual_samples() -> dict[str, dict[str, bytes]]:
    """Images of several sizes (the canvas itself, smaller, larger, thin, grayscale), several images, frame-list
    videos of odd and even frame counts, mixed media, several turns, text only."""
    out: dict[str, dict[str, bytes]] = {}
    for i, (w, h) in enumerate([(512, 512), (64, 48), (640, 360), (37, 500), (1200, 900), (300, 200)]):
        out[f"one{i}"] = {"jpgs": pickle.dumps([picture(w, h, i)]), "videos": NONE,
                          "json": chat("<image>\nWhat is shown?", "Cells.")}
    out["gray"] = {"jpgs": pickle.dumps([picture(200, 100, 20, mode="L")]), "videos": NONE,
                   "json": chat("Describe <image>", "Gray blocks.")}
    out["two"] = {"jpgs": pickle.dumps([picture(56, 56, 21), picture(640, 180, 22)]), "videos": NONE,
                  "json": chat("Compare <image> and <image> here.", "The second is wider.")}
    out["adjacent"] = {"jpgs": pickle.dumps([picture(90, 60, 23), picture(60, 90, 24)]), "videos": NONE,
                       "json": chat("<image> <image>Same?", "No.")}
    out["turns"] = {"jpgs": pickle.dumps([picture(320, 240, 25), picture(150, 600, 26)]), "videos": NONE,
                    "json": chat("<image> Colours?", "Several.", "And this one <image>?", "Blue.")}
    out["text"] = {"jpgs": NONE, "videos": NONE, "json": chat("Say hello.", "Hello.", "Again?", "Hello.")}
    for i, (n, w, h) in enumerate([(1, 96, 64), (2, 128, 96), (3, 320, 240), (4, 64, 64), (7, 100, 50)]):
        out[f"video{i}"] = {"jpgs": NONE, "videos": pickle.dumps([frames(n, w, h, 100 + 10 * i)]),
                            "json": chat("<video>\nWhat happens?", "Nothing.")}
    out["mixed"] = {"jpgs": pickle.dumps([picture(200, 150, 50)]),
                    "videos": pickle.dumps([frames(3, 96, 96, 60)]),
                    "json": chat("<image> and <video>: the same?", "No.")}
    out["untagged"] = {"jpgs": pickle.dumps([picture(300, 120, 40)]), "videos": NONE,
                       "json": chat("What is in the picture?", "Blocks.")}
    return out


#: Clip lengths in samples at 16 kHz: the feature frame count (samples // 160) a multiple of 8 (12800: 80; 2560:
#: 16), one off it, short, over the 10 s cut.
CLIPS = {"a80": (12_800, 16_000), "a81": (12_960, 16_000), "a16": (2_560, 16_000), "a3s": (48_000, 16_000),
         "a12s": (192_000, 16_000), "a_short": (1_000, 16_000)}


def audio_samples() -> dict[str, dict[str, bytes]]:
    """One clip per sample (Megatron-Bridge's ChatML audio field): alone, with images (the clip goes after the last
    image), with a video, over several turns, stereo, FLAC, and one with a ``<audio>`` tag in its text."""
    out: dict[str, dict[str, bytes]] = {}
    for key, (samples, rate) in CLIPS.items():
        out[key] = {"jpgs": NONE, "videos": NONE, "wav": demo.make_audio("wav", samples=samples, rate=rate),
                    "json": chat("What is said?", "A tone.")}
    out["a_img"] = {"jpgs": pickle.dumps([picture(120, 80, 70), picture(80, 120, 71)]), "videos": NONE,
                    "wav": demo.make_audio("wav", samples=20_000, rate=16_000),
                    "json": chat("<image> and <image>: which one sounds?", "The first.")}
    out["a_video"] = {"jpgs": NONE, "videos": pickle.dumps([frames(2, 64, 48, 80)]),
                      "wav": demo.make_audio("wav", samples=16_160, rate=16_000),
                      "json": chat("Watch <video> and listen.", "Done.", "Again?", "Yes.")}
    out["a_stereo"] = {"jpgs": NONE, "videos": NONE,
                       "wav": demo.make_audio("wav", samples=8_000, rate=16_000, channels=2),
                       "json": chat("Hear this.", "Heard.")}
    out["a_flac"] = {"jpgs": NONE, "videos": NONE, "wav": demo.make_audio("flac", samples=24_000, rate=16_000),
                     "json": chat("And this?", "Another tone.")}
    out["a_tag"] = {"jpgs": NONE, "videos": NONE, "wav": demo.make_audio("wav", samples=8_000, rate=16_000),
                    "json": chat("<audio>\nWhat is said?", "A tone.")}
    return out


#: Encoded videos (container, frames, fps, width, height, audio track rate): under a second (one frame taken), a few
#: seconds at low rates (two frames, their labels at the taken frames' rate), 3 s at 30 fps (frames 0, 44, 89:
#: labels 0.00, 1.48, 2.97), 29.97 fps, odd taken counts, every frame (1 fps), audio tracks in the container.
VIDEO_FILES = {"f_mp4": ("mp4", 5, 12, 96, 64, None), "f_webm": ("webm", 7, 8, 64, 40, None),
               "f_mkv": ("mkv", 5, 2, 80, 48, None), "f_mov": ("mov", 9, 4, 64, 64, None),
               "f_avi": ("avi", 13, 5, 96, 64, None), "f_30fps": ("mp4", 90, 30, 64, 48, None),
               "f_ntsc": ("mp4", 70, 29.97, 112, 64, None), "f_odd": ("webm", 23, 3, 64, 48, None),
               "f_1fps": ("mkv", 3, 1, 64, 32, None), "f_aac": ("mp4", 31, 10, 64, 48, 16_000),
               "f_opus": ("webm", 26, 8, 96, 48, 16_000)}


def video_file(key: str) -> bytes:
    ext, n, fps, w, h, audio = VIDEO_FILES[key]
    return demo.make_video(ext, width=w, height=h, frames=n, fps=fps, audio_rate=audio)


def file_samples() -> dict[str, dict[str, bytes]]:
    """Megatron-Bridge's layout of one encoded video a sample (``field_map`` ``videos: mp4``: the member's bytes,
    which ``normalize_energon_vlm_sample`` takes as one video and its collate writes to a ``.mp4`` file for decord,
    whatever the container): the :data:`VIDEO_FILES`, one beside an image, one 48 pixels wide."""
    out = {key: {"jpgs": NONE, "mp4": video_file(key), "json": chat("<video>\nWhat happens?", "Nothing.")}
           for key in VIDEO_FILES}
    out["f_img"] = {"jpgs": pickle.dumps([picture(200, 150, 90)]),
                    "mp4": demo.make_video("mp4", width=80, height=64, frames=17, fps=6),
                    "json": chat("<image> and <video>: the same?", "No.", "Sure?", "Yes.")}
    out["f_w48"] = {"jpgs": NONE, "mp4": demo.make_video("mp4", width=48, height=64, frames=4, fps=2),
                    "json": chat("<video>\nWhat happens?", "Nothing.")}
    return out


def file_clip_samples() -> dict[str, dict[str, bytes]]:
    """An encoded video with an image and an audio clip (the clip after the video's last ``</img>``)."""
    return {"fa_all": {"jpgs": pickle.dumps([picture(90, 120, 91)]),
                       "mp4": demo.make_video("mkv", width=64, height=48, frames=22, fps=7, audio_rate=16_000),
                       "wav": demo.make_audio("wav", samples=24_000, rate=16_000),
                       "json": chat("<video> then <image>: what is heard?", "A tone.")},
            "fa_short": {"jpgs": NONE, "mp4": demo.make_video("mp4", width=64, height=48, frames=3, fps=25),
                         "wav": demo.make_audio("wav", samples=12_800, rate=16_000),
                         "json": chat("Watch <video> and listen.", "Done.")}}


#: Samples Megatron-Bridge's path cannot take: decord reads frames 48 pixels wide as 4 channels, its JPEG step
#: raises, Energon skips the sample; packtool refuses it with that reason.
UNREADABLE = {"f_w48"}


def write(root: Path, samples: dict[str, dict[str, bytes]], audio: bool, videos: str = "videos") -> Path:
    demo.write_shard(root / "s-0.tar", samples.items())
    demo.prepare_energon(root, ["s-0.tar"], {"train": ["s-0.tar"]}, dataset_yaml=dataset_yaml(audio, videos))
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    import nemotron_omni_model

    return nemotron_omni_model.write_model_folder(tmp_path_factory.mktemp("mbnemotron") / "nemotron")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mbnemotron-data")
    return {"visual": write(root / "visual", visual_samples(), False),
            "audio": write(root / "audio", audio_samples(), True),
            "files": write(root / "files", file_samples(), False, "mp4"),
            "files_audio": write(root / "files_audio", file_clip_samples(), True, "mp4")}


def decord_dir() -> Path | None:
    """Where decord is (Megatron-Bridge's video decoder): ``PACKTOOL_DECORD_DIR``, else the wheel's folder
    (`make` installs it there)."""
    named = os.environ.get("PACKTOOL_DECORD_DIR")
    found = Path(named) if named else roots()["0.6.2"]
    return found if (found / "decord").is_dir() else None


def roots() -> dict[str, Path]:
    """Megatron-Bridge versions to compare with: the wheel (`make`), and main's source where named."""
    wheel = mbridge_ref.MBRIDGE_DIR
    if not mbridge_ref.available(wheel):
        wheel = Path(sys.prefix).parent / ".venv-mbridge" / "mbridge"
    found = {"0.6.2": wheel}
    main = os.environ.get("PACKTOOL_MBRIDGE_MAIN")
    if main:
        found["main"] = Path(main) / "src"
    return found


def bridge(version: str, dataset: Path, folder: Path, tmp: Path) -> dict[str, dict]:
    """Megatron-Bridge's batch of every sample it keeps, by key (run in a process of its own; 0.6.2's compact
    placeholders expanded)."""
    pytest.importorskip("transformers.models.nemotron_h_omni",
                        reason="transformers' Nemotron Omni processor (5.23+) runs in Megatron-Bridge's collate")
    if dataset.name in ("audio", "files_audio"):
        pytest.importorskip("soundfile", reason="Megatron-Bridge's Energon audio decoder reads clips with soundfile")
    decord = decord_dir()
    if dataset.name.startswith("files") and decord is None:
        pytest.skip("decord (Megatron-Bridge's video decoder) is not here (`make` installs it beside the wheel; "
                    "PACKTOOL_DECORD_DIR names another folder)")
    root = roots().get(version)
    if root is None or not (root / "megatron" / "bridge").is_dir():
        pytest.skip(f"Megatron-Bridge {version} is not here (`make` installs 0.6.2; PACKTOOL_MBRIDGE_MAIN names "
                    f"main's checkout)")
    target = tmp / f"{version}-{dataset.name}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent / "examples"),
                                                        os.environ.get("PYTHONPATH", "")])}
    if decord is not None:
        env["PACKTOOL_DECORD_DIR"] = str(decord)
    subprocess.run([sys.executable, str(HERE / "mbridge_nemotron_ref.py"), str(root), str(dataset), str(folder),
                    str(target)], check=True, env=env)
    found = torch.load(target, weights_only=False)
    if version != "0.6.2":
        return found
    image = json.loads((folder / "tokenizer.json").read_text())
    image_id = next(t["id"] for t in image["added_tokens"] if t["content"] == "<image>")
    return {key: compact_to_expanded(sample, image_id) for key, sample in found.items()}


def packed(dataset: Path, folder: Path, out: Path, **settings) -> Path:
    encode = EncodeSettings(tokenizer=str(folder), pack_size=8192, allow_pickle=True, **settings)
    pack(dataset, out, PackSettings(encode, PlanSettings(shard_size="4")), workers=1, progress=False)
    return out


def packed_samples(out: Path) -> dict[str, dict]:
    """Each packed sample as packtool's reader and ``megatron_bridge_batch`` give it, in Megatron-Bridge's fields."""
    manifest = load_manifest(out)
    img, so = manifest["vision_start_token_id"], manifest["audio_start_token_id"]
    got = {}
    for batch in read_packs(out, pad_to="segments"):
        mb = megatron_bridge_batch(batch)
        cu, starts = batch["cu_seqlens_unpadded"].tolist(), batch["cu_seqlens_padded"].tolist()
        kinds = iter(batch["media_kinds"])
        videos = iter(batch["video_grid_thw"].tolist())
        pixels = mb["visual_inputs"].pixel_values[0] if mb["visual_inputs"] is not None else None
        sizes, nframes, tiles = mb["imgs_sizes"], mb["num_frames"], mb.get("num_image_tiles")
        clips, lengths = mb["sound_clips"], mb["sound_length"]
        at = {"patch": 0, "size": 0, "item": 0, "tile": 0, "clip": 0}
        for i, key in enumerate(batch["keys"]):
            a, n = starts[i], cu[i + 1] - cu[i]
            ids = batch["tokens"][0, a:a + n]
            blocks, n_clips = int((ids == img).sum()), int((ids == so).sum())
            items = []
            while blocks > 0 or n_clips > 0:
                kind = next(kinds)
                if kind == "audio":
                    n_clips -= 1
                    items.append(("audio", 0))
                    continue
                frames_ = 1 if kind == "image" else next(videos)[0]
                blocks -= 1 if kind == "image" else -(-frames_ // 2)
                items.append((kind, max(frames_, 2) if kind == "video" else 1))
            sample: dict = {"tokens": ids, "labels": batch["labels"][0, a:a + n],
                            "loss_mask": batch["loss_mask"][0, a:a + n]}
            model_frames = sum(f for k, f in items if k != "audio")
            if model_frames:
                p, s, t = at["patch"], at["size"], at["item"]
                sample["pixel_values"] = pixels[p:p + 1024 * model_frames]
                sample["imgs_sizes"] = sizes[s:s + model_frames]
                sample["num_frames"] = nframes[t:t + sum(k != "audio" for k, _ in items)]
                n_tiles = sum(1 if k == "image" else -(-f // 2) for k, f in items if k != "audio")
                sample["num_image_tiles"] = tiles[at["tile"]:at["tile"] + n_tiles]
                at["patch"] += 1024 * model_frames
                at["size"] += model_frames
                at["item"] += len(sample["num_frames"])
                at["tile"] += n_tiles
            n_audio = sum(k == "audio" for k, _ in items)
            if n_audio:
                sample["sound_clips"] = clips[at["clip"]:at["clip"] + n_audio]
                sample["sound_length"] = lengths[at["clip"]:at["clip"] + n_audio]
                at["clip"] += n_audio
            got[key] = sample
    return got


def compact_to_expanded(theirs: dict, image_id: int) -> dict:
    """Megatron-Bridge 0.6.2's compact rows (one ``<image>`` per image or tubelet, which its model expands) with the
    k-th placeholder repeated to its own count (``num_image_tiles[k]`` × its per-tubelet tokens), the labels and
    loss mask at it repeated with it."""
    ids = theirs["tokens"]
    at = torch.nonzero(ids == image_id).flatten()
    if not len(at):
        return theirs
    repeat = torch.ones_like(ids)
    repeat[at] = theirs["num_image_tiles"].to(ids.dtype) * theirs["per_tubelet"]
    return {**theirs, **{k: torch.repeat_interleave(theirs[k], repeat) for k in ("tokens", "labels", "loss_mask")}}


def ledger(out: Path) -> dict[str, dict]:
    return {r["key"]: r for r in pq.read_table(out / "ledger.parquet").to_pylist()}


#: Audio count each Megatron-Bridge version takes (:data:`packtool.settings.AudioCount`).
AUDIO_COUNT = {"0.6.2": "frames", "main": "valid"}
#: Samples whose difference packtool chooses (docs/trainers.md, "Megatron-Bridge's Nemotron Omni path"): an
#: untagged image (trained, placed before the text; Megatron-Bridge leaves it out) and a ``<audio>`` tag (refused;
#: Megatron-Bridge trains the tag as text).
NAMED = {"untagged", "a_tag"}
FIELD_NAMES = ("tokens", "labels", "loss_mask", "pixel_values", "imgs_sizes", "num_frames", "num_image_tiles",
               "sound_clips", "sound_length")


@pytest.fixture(scope="module")
def runs(datasets, folder, tmp_path_factory):
    """``(version, dataset) -> (Megatron-Bridge's samples, packtool's output)``, made once each."""
    tmp = tmp_path_factory.mktemp("mbnemotron-runs")
    cache: dict = {}

    def get(version: str, name: str):
        if (version, name) not in cache:
            theirs = bridge(version, datasets[name], folder, tmp)
            out = tmp / f"{name}-{AUDIO_COUNT[version]}"
            if not out.exists():
                packed(datasets[name], folder, out, preset=PRESET, audio_count=AUDIO_COUNT[version])
            cache[version, name] = theirs, out
        return cache[version, name]

    return get


def differing(mine: dict, theirs: dict) -> list[str]:
    """The fields of one sample that differ (``sound_clips``: packtool's pads to the pack's longest clip)."""
    bad = []
    for name in FIELD_NAMES:
        ours, ref = mine.get(name), theirs.get(name)
        if name == "pixel_values" and ref is not None:
            ref = ref[0]
        if name == "sound_clips" and ours is not None and ref is not None:
            ours, pad = ours[:, :ref.shape[1]], ours[:, ref.shape[1]:]
            if pad.any():
                bad.append("sound_clips padding")
        if ours is None and ref is None:
            continue
        if ours is None or ref is None or ours.shape != ref.shape or ours.dtype != ref.dtype or \
                not torch.equal(ours, ref):
            bad.append(name)
    return bad


@pytest.mark.parametrize("name", ["visual", "audio"])
@pytest.mark.parametrize("version", ["0.6.2", "main"])
def test_every_sample_equals_megatron_bridge(runs, version, name):
    """Tokens, labels, loss mask, pixel values (bfloat16), imgs_sizes, num_frames, num_image_tiles, sound_clips and
    sound_length of every sample both keep: identical."""
    theirs, out = runs(version, name)
    mine = packed_samples(out)
    expected = set(visual_samples() if name == "visual" else audio_samples())
    assert set(theirs) == expected  # Megatron-Bridge trains every sample
    assert set(mine) == expected - {"a_tag"}
    compared = sorted(expected - NAMED)
    assert len(compared) >= 9
    problems = {key: differing(mine[key], theirs[key]) for key in compared}
    assert {k: v for k, v in problems.items() if v} == {}
    if name == "audio":  # each clip's tokens: three ceil-halvings of the features' valid length or frame count
        for key, (samples, _) in CLIPS.items():
            frames = min(samples, 160_000) // 160 + (AUDIO_COUNT[version] == "frames")
            assert int((mine[key]["tokens"] == load_manifest(out)["audio_token_id"]).sum()) == -(-frames // 8)


@pytest.mark.parametrize("version", ["0.6.2", "main"])
def test_untagged_image_is_in_the_ledger(runs, version):
    """The untagged image is trained, placed before the text, and the ledger says so (Megatron-Bridge trains that
    sample's text only)."""
    theirs, out = runs(version, "visual")
    rows = ledger(out)
    assert rows["untagged"]["status"] == "packed"
    assert "1 untagged media placed before the first user text" in rows["untagged"]["reason"]
    assert packed_samples(out)["untagged"]["num_frames"].tolist() == [1] and theirs["untagged"]["num_frames"] is None
    assert all(r["reason"] == "" for k, r in rows.items() if k != "untagged")


@pytest.mark.parametrize("version", ["0.6.2", "main"])
def test_audio_tag_is_refused(runs, folder, version):
    """A ``<audio>`` tag is refused with the reason (Megatron-Bridge trains it as text)."""
    from transformers import AutoTokenizer

    theirs, out = runs(version, "audio")
    rows = ledger(out)
    assert rows["a_tag"]["status"] == "error" and "a <audio> tag in the text" in rows["a_tag"]["reason"]
    assert "<audio>\nWhat is said?" in AutoTokenizer.from_pretrained(folder).decode(theirs["a_tag"]["tokens"])
    assert all(r["reason"] == "" for k, r in rows.items() if k != "a_tag")


def test_preset_output_verifies(runs):
    """verify re-derives every plan of the preset's output (both audio counts) and finds nothing."""
    from packtool.verify.packs import verify_output

    for version in AUDIO_COUNT:
        for name in ("visual", "audio", "files", "files_audio"):
            try:
                _, out = runs(version, name)
            except pytest.skip.Exception:
                continue
            assert verify_output(out) == []


def test_several_packs_in_one_batch(runs):
    """``collate_packs`` keeps the preset's own fields: ``num_image_tiles`` and the media of every pack, in order."""
    from packtool.runtime.loader import collate_packs

    _, out = runs("0.6.2", "visual")
    rows = list(read_packs(out, pad_to="segments")) * 2  # (the samples fill one pack: it goes in twice)
    one = [megatron_bridge_batch(r) for r in rows]
    both = megatron_bridge_batch(collate_packs(rows, pad_token_id=0))
    assert torch.equal(both["num_image_tiles"], torch.cat([b["num_image_tiles"] for b in one]))
    assert torch.equal(both["num_frames"], torch.cat([b["num_frames"] for b in one]))
    assert torch.equal(both["visual_inputs"].pixel_values, torch.cat([b["visual_inputs"].pixel_values for b in one], 1))


def token_rows(out: Path) -> dict[str, list[int]]:
    """Each packed sample's tokens (media not decoded)."""
    got = {}
    for batch in read_packs(out, pad_to="segments", images=False):
        cu, starts = batch["cu_seqlens_unpadded"].tolist(), batch["cu_seqlens_padded"].tolist()
        for i, key in enumerate(batch["keys"]):
            got[key] = batch["tokens"][0, starts[i]:starts[i] + cu[i + 1] - cu[i]].tolist()
    return got


def test_controls_differ(runs, datasets, folder, tmp_path):
    """Controls: transformers' processor (no preset) gives other tokens for the same samples; the other audio count
    other tokens (a clip of 12,800 samples: 80 feature frames) and other sound lengths."""
    theirs, out = runs("0.6.2", "visual")
    default = token_rows(packed(datasets["visual"], folder, tmp_path / "default"))
    keys = ("one0", "one1", "two", "video2", "text")
    assert [k for k in keys if default[k] != theirs[k]["tokens"].tolist()] == ["one0", "one1", "two", "video2"]
    theirs, _ = runs("0.6.2", "audio")  # frame counts
    valid = packed_samples(packed(datasets["audio"], folder, tmp_path / "valid", preset=PRESET))
    assert {"tokens", "sound_length"} <= set(differing(valid["a80"], theirs["a80"]))
    assert differing(valid["a81"], theirs["a81"]) == ["sound_length"]


@pytest.mark.parametrize("name", ["files", "files_audio"])
@pytest.mark.parametrize("version", ["0.6.2", "main"])
def test_encoded_videos_equal_megatron_bridge(runs, folder, version, name):
    """Encoded videos (decord and a JPEG round trip in Megatron-Bridge; PyAV and the same round trip with PIL in
    packtool): tokens (the frames taken, their labels), labels, loss mask, pixel values, imgs_sizes, num_frames,
    num_image_tiles, sound_clips and sound_length of every sample: identical. The video decord misreads is skipped
    by Megatron-Bridge and refused by packtool with the reason."""
    theirs, out = runs(version, name)
    mine = packed_samples(out)
    expected = set(file_samples() if name == "files" else file_clip_samples())
    assert set(theirs) == expected - UNREADABLE
    assert set(mine) == expected - UNREADABLE
    problems = {key: differing(mine[key], theirs[key]) for key in sorted(theirs)}
    assert {k: v for k, v in problems.items() if v} == {}
    rows = ledger(out)
    for key in expected & UNREADABLE:
        assert rows[key]["status"] == "error" and "reads frames 48 pixels wide as 4 channels" in rows[key]["reason"]
    if name == "files":  # the 3 s clip at 30 fps: frames 0, 44 and 89, labelled at 2 / (89 / 30) fps
        from transformers import AutoTokenizer

        text = AutoTokenizer.from_pretrained(folder).decode(mine["f_30fps"]["tokens"])
        assert "frame 2 sampled at 1.48 seconds" in text and "Frame 3 sampled at 2.97 seconds" in text
        assert mine["f_30fps"]["num_frames"].tolist() == [3]


def test_encoded_video_controls_differ(runs, folder, tmp_path):
    """Control: the frames Megatron-Bridge takes of the 3 s clip at 30 fps (0, 44, 89), decoded by PyAV and given
    as a lossless frame list, have the same layout but other labels (a frame list is labelled at 1 fps) and other
    pixel values (no JPEG round trip)."""
    from packtool.media import decode_video

    theirs, _ = runs("0.6.2", "files")
    frames_ = [png_bytes(f) for f in decode_video(video_file("f_30fps"), [0, 44, 89])]
    listed = write(tmp_path / "listed", {"f_30fps": {"jpgs": NONE, "videos": pickle.dumps([frames_]),
                                                     "json": chat("<video>\nWhat happens?", "Nothing.")}}, False)
    mine = packed_samples(packed(listed, folder, tmp_path / "out", preset=PRESET))["f_30fps"]
    ref = theirs["f_30fps"]
    assert mine["tokens"].shape == ref["tokens"].shape and not torch.equal(mine["tokens"], ref["tokens"])
    assert differing(mine, ref) == ["tokens", "pixel_values"]


#: Widths whose decoded rows decord pads to another multiple of the width (measured: 4 channels at 24, 48 and 72
#: pixels, 6 at 16), and widths it reads right.
DECORD_WIDTHS = (16, 24, 44, 48, 50, 64, 72, 80, 96, 120)


def test_decord_channel_rule(tmp_path):
    """:func:`decord_channels` (why the preset refuses some widths) against decord itself, run in a process of its
    own (its FFmpeg and PyAV's do not share one), on an mp4 of each width."""
    from packtool.families.nemotron_omni.mbridge import decord_channels

    found = decord_dir()
    if found is None:
        pytest.skip("decord is not here (`make` installs it beside the wheel; PACKTOOL_DECORD_DIR names another)")
    for w in DECORD_WIDTHS:
        (tmp_path / f"{w}.mp4").write_bytes(demo.make_video("mp4", width=w, height=32, frames=2, fps=4))
    code = ("import sys, decord; sys.stdout.write(' '.join(str(decord.VideoReader(p)[0].shape[2]) "
            "for p in sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, *(str(tmp_path / f"{w}.mp4") for w in DECORD_WIDTHS)],
                            check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(found)})
    measured = dict(zip(DECORD_WIDTHS, map(int, result.stdout.split()), strict=True))
    assert measured == {w: decord_channels(w) for w in DECORD_WIDTHS}
    assert {w: c for w, c in measured.items() if c != 3} == {16: 6, 24: 4, 48: 4, 72: 4}


#: The interpreter of Megatron-Bridge's own pins (`make` builds it beside the main environment).
PINS_PYTHON = Path(sys.prefix).parent / ".venv-mbridge" / "bin" / "python"

#: Every tensor of every batch ``megatron_bridge_batch`` gives for an output, saved to a file (run under either
#: interpreter).
BATCH_TENSORS = """
import sys, torch
from packtool.runtime.megatron_batch import megatron_bridge_batch
from packtool.runtime.read import read_packs
rows = []
for batch in read_packs(sys.argv[1]):
    mb = megatron_bridge_batch(batch)
    visual = mb.pop("visual_inputs", None)
    row = {k: v for k, v in mb.items() if isinstance(v, torch.Tensor)}
    if visual is not None:
        row["pixel_values"] = visual.pixel_values
    rows.append(row)
torch.save(rows, sys.argv[2])
"""


def test_reader_runs_in_megatron_bridge_environment(runs, tmp_path):
    """The preset's reader reads no model folder, so it runs where Megatron-Bridge trains: under its pins (Python
    3.12, transformers 5.12.1, whose Parakeet features take librosa, Megatron-Bridge's `audio` extra) every tensor
    of every batch of the preset's outputs (images, frame lists, encoded videos, audio) equals the main
    environment's."""
    if not PINS_PYTHON.exists():
        pytest.skip(f"Megatron-Bridge's pins environment is not at {PINS_PYTHON} "
                    "(`make test` builds it: Python 3.12 and "
                    f"constraints-mbridge.txt)")
    compared = []
    for name in ("visual", "audio", "files", "files_audio"):
        try:
            _, out = runs("0.6.2", name)
        except pytest.skip.Exception:
            continue
        for python, tag in ((PINS_PYTHON, "pins"), (Path(sys.executable), "main")):
            subprocess.run([str(python), "-c", BATCH_TENSORS, str(out), str(tmp_path / f"{name}-{tag}.pt")],
                           check=True)
        pins, main = (torch.load(tmp_path / f"{name}-{tag}.pt") for tag in ("pins", "main"))
        assert len(pins) == len(main) > 0, name
        for theirs, mine in zip(pins, main):
            assert theirs.keys() == mine.keys(), name
            assert [k for k in mine if not torch.equal(theirs[k], mine[k])] == [], name
        compared.append(name)
    assert "visual" in compared
