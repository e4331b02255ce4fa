"""Media of every kind through ``pack`` and the ledger: no sample is ever packed without a media item it references
or carries. Videos, audio and images are generated offline (PyAV, numpy, PIL); the shards are real tars and the
ledger is read back from parquet."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("av")

import demo  # noqa: E402
import mediafixture as mf  # noqa: E402
from packtool.pipeline import pack  # noqa: E402
from packtool.settings import EncodeSettings, PackSettings, PlanSettings  # noqa: E402
from packtool.sources.conversation import member_kind  # noqa: E402

PACK_SIZE = 4096


def chat(user, reply: str = "a short answer", **extra) -> bytes:
    """A ShareGPT chat; ``user`` is text or a list of OpenAI-style content parts (then ChatML roles)."""
    if isinstance(user, str):
        turns = [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]
    else:
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return json.dumps({"conversations": turns, **extra}).encode()


def video(frames: int = 6, ext: str = "mp4") -> bytes:
    return mf.make_video(ext, width=64, height=48, frames=frames, fps=4)


def wav() -> bytes:
    return mf.make_audio("wav", samples=8000, rate=16000)


def png(seed: int = 0) -> bytes:
    return mf.make_image(40, 30, seed=seed)


#: key -> (members, expected ledger status, a piece of the reason). Statuses of kinds the demo model folder takes
#: are ``packed``; every other sample is an error with its reason.
def cases() -> dict[str, tuple[dict[str, bytes], str, str]]:
    return {
        "image_tag": ({"json": chat("<image>Describe it."), "jpg": png()}, "packed", ""),
        "image_parts_named": ({"json": chat([{"type": "image", "image": "b.png"}, {"type": "text", "text": "Then"},
                                             {"type": "image_url", "image_url": {"url": "a.png"}}]),
                               "a.png": png(1), "b.png": png(2)}, "packed", ""),
        "text_only": ({"json": chat("Just text.")}, "packed", ""),
        "video_tag": ({"json": chat("<video>What happens?"), "mp4": video()}, "error", "no rule for videos"),
        "video_untagged": ({"json": chat("What happens?"), "clip.webm": video(ext="webm")}, "error",
                           "no rule for videos"),
        "video_part": ({"json": chat([{"type": "video", "video": "clip.mov"}, {"type": "text", "text": "Why?"}]),
                        "clip.mov": video(ext="mov")}, "error", "no rule for videos"),
        "video_frames": ({"json": chat("<video>Frames."), **{f"video.{i}.png": png(i) for i in range(4)}}, "error",
                         "no rule for videos"),
        "audio_tag": ({"json": chat("<audio>Transcribe."), "wav": wav()}, "error", "no rule for audio"),
        "audio_part": ({"json": chat([{"type": "input_audio"}, {"type": "text", "text": "Say?"}]), "flac":
                        mf.make_audio("flac", samples=4000, rate=8000)}, "error", "no rule for audio"),
        "two_tags_one_video": ({"json": chat("<video><video>Both?"), "mp4": video()}, "error",
                               "2 <video> tags but 1 videos"),
        "video_tag_no_member": ({"json": chat("<video>Where?")}, "error", "1 <video> tags but 0 videos"),
        "audio_tag_image_member": ({"json": chat("<audio>Hear?"), "jpg": png()}, "error",
                                   "1 <audio> tags but 0 audio clips"),
        "unreadable_video": ({"json": chat("<video>Bad."), "mp4": b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64},
                             "error", "unreadable video"),
        "unreadable_audio": ({"json": chat("Bad."), "wav": b"RIFF\x10\x00\x00\x00WAVEjunk"}, "error",
                             "unreadable audio"),
        "unsupported_format": ({"json": chat("<image>Photo."), "heic": b"\x00\x00\x00\x18ftypheic"}, "error",
                               "media format packtool cannot read"),
        "inline_audio": ({"json": chat([{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(wav()).decode(), "format": "wav"}}, {"type": "text", "text": "Hm?"}])},
                         "error", "carries its data inline"),
        "unreferenced_member": ({"json": chat("<image>One.", image="0.jpg"), "0.jpg": png(0), "1.jpg": png(1)},
                                "error", "image member '1.jpg' is not referenced"),
        "frame_gap": ({"json": chat("<video>Gap."), "video.0.png": png(0), "video.2.png": png(2)}, "error",
                      "not numbered 0..1 without gaps"),
        "frame_sizes": ({"json": chat("<video>Sizes."), "video.0.png": png(0),
                         "video.1.png": mf.make_image(20, 20)}, "error", "frames differ in size"),
        "video_in_reply": ({"json": chat("Look.", reply="<video>here"), "mp4": video()}, "error",
                           "tag <video> lies in assistant turn"),
    }


def write_source(root: Path, samples: dict[str, dict[str, bytes]]) -> None:
    demo.write_shard(root / "shards/media.tar", samples.items())
    meta = root / ".nv-meta"
    meta.mkdir(parents=True)
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": ["shards/media.tar"]}}))
    (meta / "dataset.yaml").write_text(yaml.safe_dump({"__module__": "megatron.energon",
                                                       "__class__": "CrudeWebdataset"}))
    (meta / ".info.json").write_text(json.dumps({"shard_counts": {"shards/media.tar": len(samples)}}))


def packed_media(out: Path) -> dict[str, list[tuple[str, bytes]]]:
    """Segment key -> its media as (kind, bytes), read from the packed tars."""
    found = {}
    for shard in sorted(out.glob("train/*.tar")):
        records: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for m in tar:
                key, _, part = m.name.partition(".")
                records.setdefault(key, {})[part] = tar.extractfile(m).read()
        for parts in records.values():
            for seg in json.loads(parts["json"])["segments"]:
                found[seg["key"]] = [(m["kind"], parts[m["member"]]) for m in seg["media"]]
    return found


@pytest.fixture(scope="module")
def media_run(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    expected = cases()
    write_source(root / "src", {k: v[0] for k, v in expected.items()})
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=PACK_SIZE),
                            PlanSettings(shard_size="4"))
    pack(root / "src", root / "out", settings, workers=1, progress=False, max_error_rate=1.0)
    ledger = {r["key"]: r for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    return expected, ledger, packed_media(root / "out")


def test_every_media_sample_has_its_ledger_fate(media_run):
    expected, ledger, _ = media_run
    assert set(ledger) == set(expected)
    for key, (_, status, reason) in expected.items():
        row = ledger[key]
        assert row["status"] == status, (key, row["reason"])
        assert reason in row["reason"], (key, row["reason"])


def test_no_sample_is_packed_without_its_media(media_run):
    """Every kept sample holds, byte for byte, every media member of its source sample (frames of a frame list
    count as one video), and the ledger counts them."""
    expected, ledger, packed = media_run
    kept = [k for k, r in ledger.items() if r["status"] in ("packed", "truncated")]
    assert set(kept) == set(packed) and kept
    for key in kept:
        members = expected[key][0]
        source = sorted(data for part, data in members.items() if member_kind(part) is not None)
        assert sorted(data for _, data in packed[key]) == source, key
        assert ledger[key]["images"] == len(packed[key]), key


def test_named_content_parts_set_the_media_order(media_run):
    expected, _, packed = media_run
    members = expected["image_parts_named"][0]
    assert [data for _, data in packed["image_parts_named"]] == [members["b.png"], members["a.png"]]
