"""Media of every kind through ``pack`` and the ledger: no sample is ever packed without a media item it references
or carries. Videos, audio and images are generated offline (PyAV, numpy, PIL); the shards are real tars and the
ledger is read back from parquet."""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("av")

import mediafixture as mf
import packfixture as fx
from mediafixture import write_source
from packtool.errors import ConfigError
from packtool.format import Manifest
from packtool.packer.pipeline import pack
from packtool.packer.sources.conversation import member_kind
from packtool.settings import EncodeSettings, PackSettings, PlanSettings

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
        "video_tag": ({"json": chat("<video>What happens?"), "mp4": video()}, "packed", ""),
        "video_untagged": ({"json": chat("What happens?"), "clip.webm": video(ext="webm")}, "packed", ""),
        "video_part": ({"json": chat([{"type": "video", "video": "clip.mov"}, {"type": "text", "text": "Why?"}]),
                        "clip.mov": video(ext="mov")}, "packed", ""),
        "video_frames": ({"json": chat("<video>Frames."), **{f"video.{i}.png": png(i) for i in range(4)}},
                         "packed", ""),
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
        "pickled_video": ({"json": chat("<video>Frames."), "videos": pickle.dumps([[png(0), png(1)]])}, "error",
                          "pickled member 'videos' refused"),
    }


def packed_media(out: Path) -> dict[str, list[tuple[str, bytes]]]:
    """Segment key -> its media as (kind, bytes of each member: one, or a frame list's frames), read from the
    packed tars."""
    return {seg.key: [(m.kind, [media[n] for n in m.members]) for m in seg.media]
            for seg, _, _, media in fx.packed_segments(out)}


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
        assert sorted(data for _, members in packed[key] for data in members) == source, key
        assert ledger[key]["images"] == len(packed[key]), key


def test_named_content_parts_set_the_media_order(media_run):
    expected, _, packed = media_run
    members = expected["image_parts_named"][0]
    assert [data for _, (data,) in packed["image_parts_named"]] == [members["b.png"], members["a.png"]]
    assert [kind for kind, _ in packed["video_frames"]] == ["video"]


# -- Qwen2.5-VL video: tokens and reader tensors equal transformers' processor ------------------------------------
QWEN_VIDEOS = {  # key -> (user text, videos (ext, width, height, frames, fps), images (w, h), frame lists (n, w, h))
    "short_mp4": ("<video>What happens?", [("mp4", 64, 48, 6, 4)], [], []),
    "long_webm": ("Describe <video> please.", [("webm", 90, 60, 31, 10)], [], []),
    "two_videos": ("<video> then <video>?", [("mkv", 57, 41, 9, 8), ("avi", 112, 84, 12, 24)], [], []),
    "video_image": ("<image><video>Same?", [("mov", 72, 40, 10, 5)], [(50, 70)], []),
    "frames": ("<video>Frames.", [], [], [(6, 44, 36)]),
}


def qwen_sample(user, videos, images, frame_lists):
    members = {"json": chat(user)}
    for i, (ext, w, h, n, fps) in enumerate(videos):
        members[f"{i}.{ext}"] = mf.make_video(ext, width=w, height=h, frames=n, fps=fps)
    for i, (w, h) in enumerate(images):
        members[f"{i}.png"] = mf.make_image(w, h, seed=i)
    for n, w, h in frame_lists:
        members.update({f"video.{i}.png": mf.make_image(w, h, seed=10 + i) for i in range(n)})
    return members


@pytest.fixture(scope="module", params=["plain", "sampling"])
def qwen_run(request, demo_dir, tmp_path_factory):
    """The demo folder as is (no video config: every frame, image pixel bounds), or with a video config sampling 2
    frames a second and the flags overriding it to 3 fps; each sample packed alone (one per pack)."""
    import shutil

    root = tmp_path_factory.mktemp(f"qwen-{request.param}")
    folder = root / "model"
    shutil.copytree(demo_dir / "tokenizer", folder)
    overrides = {}
    if request.param == "sampling":
        (folder / "video_preprocessor_config.json").write_text(json.dumps({
            "video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": 2.0, "min_frames": 2,
            "max_frames": 16, "size": {"shortest_edge": 3136, "longest_edge": 56 * 56 * 4}}))
        overrides = {"video_fps": 3.0}
    samples = {k: qwen_sample(*v[:1], *v[1:]) for k, v in QWEN_VIDEOS.items()}
    write_source(root / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=PACK_SIZE, **overrides),
                            PlanSettings(shard_size="4", max_segments=1))
    pack(root / "src", root / "out", settings, workers=1, progress=False, max_error_rate=1.0)
    ledger = {r["key"]: r for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    if request.param == "sampling":  # a frame list has no rate to sample by (the processor refuses it too)
        assert ledger["frames"]["status"] == "error" and "no frame rate" in ledger["frames"]["reason"]
        del samples["frames"]
    assert all(ledger[k]["status"] == "packed" for k in samples), ledger
    return folder, samples, root / "out", overrides


def test_qwen_video_tokens_and_tensors_equal_the_processor(torchvision, qwen_run):
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from packtool.format import load_manifest
    from packtool.media import decode_frames, decode_video, probe_frames, probe_video
    from packtool.runtime.read import read_packs

    folder, samples, out, overrides = qwen_run
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
                                    tokenizer=AutoTokenizer.from_pretrained(folder),
                                    video_processor=Qwen2VLVideoProcessor.from_pretrained(folder))
    manifest = load_manifest(out)
    assert manifest.video_processor["fps"] == overrides.get("video_fps", manifest.video_processor["fps"])
    batches = {b["keys"][0]: b for b in read_packs(out, "train")}
    assert set(batches) == set(samples)
    for key, members in samples.items():
        user, videos, images, frame_lists = QWEN_VIDEOS[key][0], *QWEN_VIDEOS[key][1:]
        arrays, metas = [], []
        for i, (ext, *_rest) in enumerate(videos):
            facts = probe_video(members[f"{i}.{ext}"], max_pixels=10**8)
            arrays.append(decode_video(members[f"{i}.{ext}"], range(facts.frames)))
            metas.append(VideoMetadata(**facts.metadata()))
        for n, _, _ in frame_lists:
            frames = [members[f"video.{i}.png"] for i in range(n)]
            arrays.append(decode_frames(frames, range(n)))
            metas.append(VideoMetadata(**probe_frames(frames, max_pixels=10**8).metadata()))
        content = []
        for piece in user.replace("<image>", "\0image\0").replace("<video>", "\0video\0").split("\0"):
            if piece in ("image", "video"):
                content.append({"type": piece})
            elif piece:
                content.append({"type": "text", "text": piece})
        text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content},
                                              {"role": "assistant", "content": "a short answer"}], tokenize=False)
        call = {}
        video_settings = processor.video_processor
        if manifest.video_processor["do_sample_frames"]:
            call = {"do_sample_frames": True, "fps": manifest.video_processor["fps"],
                    "min_frames": video_settings.min_frames, "max_frames": video_settings.max_frames}
        if images:
            call["images"] = [Image.open(io.BytesIO(members[f"{i}.png"])) for i in range(len(images))]
        expected = processor(text=[text], videos=arrays, video_metadata=metas, return_tensors="pt", **call)
        batch = batches[key]
        n = int(batch["cu_seqlens_unpadded"][1])
        assert batch["tokens"][0, :n].tolist() == expected["input_ids"][0].tolist(), key
        assert batch["video_grid_thw"].tolist() == expected["video_grid_thw"].tolist(), key
        assert batch["second_per_grid_ts"].tolist() == pytest.approx(expected["second_per_grid_ts"].tolist(),
                                                                     rel=1e-6), key
        assert batch["pixel_values_videos"].dtype == expected["pixel_values_videos"].dtype
        assert (batch["pixel_values_videos"] == expected["pixel_values_videos"]).all(), key
        if images:
            assert (batch["pixel_values"] == expected["pixel_values"]).all(), key


# -- Megatron-Bridge's pickled video frame lists -------------------------------------------------------------------
def jpeg(seed: int) -> bytes:
    return mf.make_image(44, 36, seed=seed, fmt="JPEG")


@pytest.fixture(scope="module")
def pickled_run(demo_dir, tmp_path_factory):
    """The same video as numbered members and as one video of a pickled ``videos`` list (next to a second one),
    packed for the Qwen demo folder with ``allow_pickle``; plus the quarantined forms of a pickled list."""
    root = tmp_path_factory.mktemp("pickled")
    first, second = [jpeg(i) for i in range(5)], [png(i) for i in range(3)]
    samples = {
        "numbered": {"json": chat("<video>Frames."), **{f"clip.{i}.jpg": f for i, f in enumerate(first)}},
        "pickled": {"json": chat("<video>Frames."), "videos": pickle.dumps([first])},
        "pickled_two": {"json": chat("<video> and <video>?"), "videos": pickle.dumps([first, second], protocol=2)},
        "decoded": {"json": chat("<video>Arrays."), "videos": pickle.dumps([[np.zeros((3, 28, 28), np.float32)]])},
        "no_frames": {"json": chat("<video>None."), "videos": pickle.dumps([[]])},
        "not_image": {"json": chat("<video>Junk."), "videos": pickle.dumps([[b"not an image"]])},
        "tag_count": {"json": chat("<video>One?"), "videos": pickle.dumps([first, second])},
    }
    write_source(root / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=PACK_SIZE,
                                           allow_pickle=True), PlanSettings(shard_size="4"))
    pack(root / "src", root / "out", settings, workers=1, progress=False, max_error_rate=1.0)
    ledger = {r["key"]: r for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    segments = {seg.key: (seg, tokens, media) for seg, tokens, _, media in fx.packed_segments(root / "out")}
    return samples, (first, second), ledger, segments


def test_pickled_frame_list_packs_like_numbered_members(pickled_run):
    samples, (first, second), ledger, segments = pickled_run
    assert {k: r["status"] for k, r in ledger.items()} == {
        "numbered": "packed", "pickled": "packed", "pickled_two": "packed", "decoded": "error", "no_frames": "error",
        "not_image": "error", "tag_count": "error"}
    (numbered, numbered_tokens, numbered_media), (pickled, pickled_tokens, pickled_media) = (
        segments["numbered"], segments["pickled"])
    assert pickled_tokens.tolist() == numbered_tokens.tolist()
    (ref,), (want,) = pickled.media, numbered.media
    assert (ref.kind, ref.tokens, ref.grid_thw, ref.total_frames, ref.frame_indices, ref.sha256) == (
        want.kind, want.tokens, want.grid_thw, want.total_frames, want.frame_indices, want.sha256)
    assert [pickled_media[n] for n in ref.frames] == first == [numbered_media[n] for n in want.frames]
    assert all(n.endswith(".jpg") for n in ref.frames) and len(ref.frames) == 5
    two, _, media = segments["pickled_two"]
    assert [[media[n] for n in m.frames] for m in two.media] == [first, second]
    assert [m.frames[0].rsplit(".", 1)[-1] for m in two.media] == ["jpg", "png"]
    assert ledger["pickled_two"]["images"] == 2


def test_pickled_frame_lists_that_cannot_pack_are_quarantined(pickled_run):
    _, _, ledger, _ = pickled_run
    assert "pickled video 0 holds 1 frames of 3x28x28 float32: videos of decoded frames are not supported" in \
        ledger["decoded"]["reason"]
    assert "pickled video 0 has no frames" in ledger["no_frames"]["reason"]
    assert "undecodable image" in ledger["not_image"]["reason"]
    assert "1 <video> tags but 2 videos" in ledger["tag_count"]["reason"]


def test_bridge_dataset_with_pickled_videos_packs_them(pickled_run, demo_dir, tmp_path):
    """Megatron-Bridge's layout (``ChatMLWebdataset``, ``field_map`` with ``jpgs`` and ``videos``): the videos of
    encoded frames pack as frame lists, bytes as stored, with the tokens of the same sample in members."""
    _, (first, second), _, segments = pickled_run
    fields = {"imgs": "jpgs", "videos": "videos", "conversation": "json"}
    samples = {
        "bridge": {"json": chat("<video>Frames."), "jpgs": pickle.dumps([]), "videos": pickle.dumps([first])},
        "bridge_mixed": {"json": chat("<image><video>Both?"), "jpgs": pickle.dumps([png(5)]),
                         "videos": pickle.dumps([second])},
    }
    write_source(tmp_path / "src", samples, dataset_yaml={"__class__": "ChatMLWebdataset", "field_map": fields,
                                                          "__module__": "megatron.bridge.data.energon"})
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=PACK_SIZE,
                                           allow_pickle=True), PlanSettings(shard_size="4"))
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    packed = {seg.key: (seg, tokens, media) for seg, tokens, _, media in fx.packed_segments(tmp_path / "out")}
    assert set(packed) == set(samples)
    seg, tokens, media = packed["bridge"]
    assert tokens.tolist() == segments["numbered"][1].tolist()
    assert [[media[n] for n in m.members] for m in seg.media] == [first]
    seg, _, media = packed["bridge_mixed"]
    assert [(m.kind, [media[n] for n in m.members]) for m in seg.media] == [("image", [png(5)]), ("video", second)]


# -- Processor mode: the model folder's own processor expands the placeholders ------------------------------------
def llava_folder(root: Path, tokenizer_dir: Path) -> Path:
    """A LLaVA processor folder made offline: a tokenizer with ``<image>`` as an added token, ChatML, and a CLIP
    image processor at 56 pixels (16 patches of 14: 16 ``<image>`` tokens per image)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    import nemotron_omni_model

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), patch_size=14, image_token="<image>",
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=nemotron_omni_model.chat_template())
    processor.save_pretrained(root)
    return root


LLAVA = {  # key -> (turns, image sizes)
    "one": (["<image>What is it?", "a picture"], [(40, 30)]),
    "two_lines": (["<image>\n<image>\nSame?", "no"], [(40, 30), (90, 20)]),
    "adjacent": (["<image><image>Which?", "the left one"], [(64, 64), (20, 50)]),
    "second_turn": (["Hello.", "hi", "And <image> now?", "a gradient"], [(33, 77)]),
    "text": (["Just text.", "fine"], []),
}


@pytest.fixture(scope="module")
def llava_run(torchvision, tmp_path_factory):
    import nemotron_omni_model

    root = tmp_path_factory.mktemp("llava")
    folder = llava_folder(root / "model", nemotron_omni_model.write_model_folder(root / "nemotron"))
    samples = {}
    for key, (turns, sizes) in LLAVA.items():
        roles = ["human", "gpt"] * len(turns)
        members = {"json": json.dumps({"conversations": [{"from": r, "value": t}
                                                         for r, t in zip(roles, turns)]}).encode()}
        members.update({f"{i}.png": mf.make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)})
        samples[key] = members
    write_source(root / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=PACK_SIZE, media_tokens="processor"),
                            PlanSettings(shard_size="4"))
    pack(root / "src", root / "out", settings, workers=1, progress=False, max_error_rate=1.0)
    ledger = {r["key"]: r for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    return folder, samples, ledger, root


def test_processor_mode_packs_another_family_exactly(llava_run):
    from PIL import Image
    from transformers import AutoProcessor

    folder, samples, ledger, root = llava_run
    assert {k: r["status"] for k, r in ledger.items()} == dict.fromkeys(LLAVA, "packed"), ledger
    processor = AutoProcessor.from_pretrained(folder)
    tok, image_id = processor.tokenizer, processor.image_token_id
    segments = {seg.key: (seg, tokens, targets, media) for seg, tokens, targets, media in fx.packed_segments(
        root / "out")}
    for key, (turns, sizes) in LLAVA.items():
        seg, tokens, targets, media = segments[key]
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        images = [Image.open(io.BytesIO(samples[key][f"{i}.png"])) for i in range(len(sizes))]
        expected = processor(text=rendered, images=images or None)["input_ids"][0]
        assert tokens.tolist() == expected, key
        assert tok.decode(tokens[targets.astype(bool)].tolist()) == "".join(t + "<|im_end|>" for t in turns[1::2])
        assert [media[m.member] for m in seg.media] == [samples[key][f"{i}.png"] for i in range(len(sizes))]
        last = 0
        for m in seg.media:  # each span holds its item's placeholders and no other; spans disjoint, in order
            assert m.tokens == 16 and (tokens[m.token_offset:m.token_offset + 16] == image_id).all(), key
            assert last <= m.span[0] <= m.token_offset and m.token_offset + m.tokens <= m.span[1], key
            assert int((tokens[m.span[0]:m.span[1]] == image_id).sum()) == 16, key
            last = m.span[1]
        assert int((tokens == image_id).sum()) == 16 * len(sizes)
    manifest = Manifest.read(root / "out")
    assert manifest.image_processor == {"family": "processor", "processor_class": "LlavaProcessor"}
    assert manifest.image_token_id == image_id and manifest.settings["media_tokens"] == "processor"


def test_without_a_rule_media_need_the_processor_mode(llava_run, tmp_path):
    folder, samples, _, root = llava_run
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=PACK_SIZE), PlanSettings(shard_size="4"))
    # The folder's image settings (nested in processor_config.json, as save_pretrained writes them) are another
    # family's: refused before OUTPUT is touched, naming the ways out, as for the same settings in
    # preprocessor_config.json.
    with pytest.raises(ConfigError, match="'CLIPImageProcessor' is no Qwen2-VL one.*processor mode"):
        pack(root / "src", tmp_path / "out", settings, workers=1, progress=False, max_error_rate=1.0)
    assert not (tmp_path / "out").exists()


def test_processor_mode_equals_the_qwen_rules(torchvision, demo_dir, tmp_path):
    """The Qwen2.5-VL processor of the demo folder gives, sample for sample, the tokens, targets and media of the
    fast rules (images, videos, frame lists)."""
    import shutil

    from packtool.packer.encoder import Encoder
    from packtool.packer.sources import RawSample

    folder = tmp_path / "model"
    shutil.copytree(demo_dir / "tokenizer", folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    raws = [RawSample(key, "s.tar", i, members, {p: (0, len(d)) for p, d in members.items()})
            for i, (key, members) in enumerate((k, qwen_sample(*v)) for k, v in QWEN_VIDEOS.items())]
    rule = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=PACK_SIZE)).encode_many(raws)
    proc = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=PACK_SIZE,
                                  media_tokens="processor")).encode_many(raws)
    keys = ("kind", "token_offset", "tokens", "span", "grid_thw", "frame_indices")
    for r, p in zip(rule, proc):
        assert r.status == p.status == "packed", (r.key, r.reason, p.reason)
        assert p.tokens.tolist() == r.tokens.tolist() and p.targets.tolist() == r.targets.tolist(), r.key
        assert [{k: getattr(m, k) for k in keys} for m in p.media] == \
            [{k: getattr(m, k) for k in keys} for m in r.media], r.key
