"""Nemotron Omni through ``pack``: every packed segment's tokens equal transformers' ``nemotron_h_omni`` processor's
``input_ids`` for the same rendered conversation and media.

The model folder is built offline (``examples/nemotron_omni_model.py``); images, videos (mp4, webm, mkv, avi,
frame lists) and audio (wav, flac, mp3) are generated with PyAV, numpy and PIL; the source and the packs are real
tar shards. The processor imports torchvision; without it these tests are skipped with that reason.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("av")

import mediafixture as mf
import packfixture as fx
from packtool.errors import ConfigError
from packtool.format import Manifest
from packtool.media import decode_audio, decode_frames, decode_video, probe_frames, probe_video
from packtool.packer.pipeline import pack
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from test_media_pack import write_source

PACK_SIZE = 16384
REPLY = "a short answer"

# key -> (turns: user texts (with media tags) and replies alternating, media members in tag order per kind)
# A member is ("image", w, h) | ("video", ext, w, h, frames, fps) | ("frames", n, w, h) | ("audio", ext, rate,
# channels, seconds).
SAMPLES: dict[str, tuple[list[str], list[tuple]]] = {
    "image_audio": (["<image>Look, then <audio> listen.", REPLY], [("image", 50, 70), ("audio", "wav", 16000, 1, 1.0)]),
    "two_images": (["<image><image>Which is wider?", "the first"], [("image", 640, 480), ("image", 33, 90)]),
    "mp4": (["Watch <video> closely.", REPLY], [("video", "mp4", 64, 48, 30, 24)]),
    "webm_flac": (["<video>\nAnd the sound: <audio>", "music"], [("video", "webm", 80, 80, 25, 12),
                                                                  ("audio", "flac", 44100, 2, 2.3)]),
    "mkv_image_mp3": (["<image> <video> <audio> all of it?", "yes"], [("image", 120, 90),
                                                                       ("video", "mkv", 97, 33, 15, 2.5),
                                                                       ("audio", "mp3", 22050, 1, 1.5)]),
    "two_videos": (["First <video> then <video>.", "both move"], [("video", "mp4", 96, 32, 13, 6.5),
                                                                  ("video", "avi", 64, 64, 20, 10)]),
    "frames": (["<video>Frames.", "they change"], [("frames", 5, 44, 36)]),
    "second_turn_audio": (["<image>What is it?", "a picture", "And <audio>?", "a tone"],
                          [("image", 30, 30), ("audio", "wav", 8000, 2, 0.37)]),
    "text_only": (["Just text.", REPLY], []),
}


def media_bytes(spec: tuple, seed: int) -> bytes | list[bytes]:
    kind = spec[0]
    if kind == "image":
        return mf.make_image(spec[1], spec[2], seed=seed)
    if kind == "video":
        _, ext, w, h, n, fps = spec
        return mf.make_video(ext, width=w, height=h, frames=n, fps=fps)
    if kind == "frames":
        _, n, w, h = spec
        return [mf.make_image(w, h, seed=seed + i) for i in range(n)]
    _, ext, rate, channels, seconds = spec
    return mf.make_audio(ext, samples=round(seconds * rate), rate=rate, channels=channels)


def source_sample(turns: list[str], specs: list[tuple]) -> tuple[dict[str, bytes], list[bytes | list[bytes]]]:
    """Members of a ShareGPT sample and its media (in tag order per kind)."""
    roles = ["human", "gpt"] * len(turns)
    members = {"json": json.dumps({"conversations": [{"from": r, "value": t} for r, t in zip(roles, turns)]}).encode()}
    media = []
    for i, spec in enumerate(specs):
        data = media_bytes(spec, seed=i)
        media.append(data)
        if spec[0] == "frames":
            members.update({f"video.{j}.png": f for j, f in enumerate(data)})
        else:
            members[f"{i}.{spec[1] if spec[0] in ('video', 'audio') else 'png'}"] = data
    return members, media


@pytest.fixture(scope="module")
def nemotron_folder(tmp_path_factory) -> Path:
    import nemotron_omni_model

    return nemotron_omni_model.write_model_folder(tmp_path_factory.mktemp("nemotron") / "model")


@pytest.fixture(scope="module", params=["plain", "sampling"])
def nemotron_run(request, torchvision, nemotron_folder, tmp_path_factory):
    """The folder as is (every frame, no audio limit), or with videos sampled at 2 fps and audio cut to 0.5 s by
    the settings; each sample packed alone (one per pack)."""
    root = tmp_path_factory.mktemp(f"nemotron-{request.param}")
    sources = {k: source_sample(*v) for k, v in SAMPLES.items()}
    write_source(root / "src", {k: v[0] for k, v in sources.items()})
    overrides = {"video_fps": 2.0, "audio_max_seconds": 0.5} if request.param == "sampling" else {}
    settings = PackSettings(EncodeSettings(tokenizer=str(nemotron_folder), pack_size=PACK_SIZE, **overrides),
                            PlanSettings(shard_size="4", max_segments=1))
    pack(root / "src", root / "out", settings, workers=1, progress=False, max_error_rate=1.0)
    ledger = {r["key"]: r for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    return sources, ledger, root / "out", overrides


def expected_ids(processor, turns: list[str], specs: list[tuple], media: list, overrides: dict):
    """The processor's outputs for the sample, rendered by the folder's chat template, and the audio waveforms it
    was given. The processor takes one video per call: every video but the first is expanded by a call of its own on
    ``<video>`` alone, and that text is put in its place before the whole call."""
    from PIL import Image
    from transformers.video_utils import VideoMetadata

    messages = []
    for i, text in enumerate(turns):
        if i % 2:
            messages.append({"role": "assistant", "content": text})
            continue
        content = []
        for piece in text.replace("<image>", "\0image\0").replace("<video>", "\0video\0").replace(
                "<audio>", "\0audio\0").split("\0"):
            if piece in ("image", "video", "audio"):
                content.append({"type": piece})
            elif piece:
                content.append({"type": "text", "text": piece})
        messages.append({"role": "user", "content": content})
    rendered = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    video_call = {"do_sample_frames": False}
    images, videos, waves = [], [], []
    for spec, data in zip(specs, media):
        if spec[0] == "image":
            images.append(Image.open(io.BytesIO(data)))
        elif spec[0] == "audio":
            limit = overrides.get("audio_max_seconds")
            waves.append(decode_audio(data, rate=16000, max_samples=None if limit is None else int(limit * 16000)))
        else:
            facts = (probe_frames(data, max_pixels=10**8) if spec[0] == "frames"
                     else probe_video(data, max_pixels=10**8))
            frames = (decode_frames(data, range(facts.frames)) if spec[0] == "frames"
                      else decode_video(data, range(facts.frames)))
            # The frames the video processor's own sampler picks (every frame without sampling), with their numbers
            # in the metadata as transformers' video loader states them: the processor writes the times of its
            # frame labels from those numbers (when it samples by itself it labels the unsampled numbers).
            indices = list(range(facts.frames))
            if "video_fps" in overrides:
                meta = VideoMetadata(**facts.metadata())
                indices = processor.video_processor.sample_frames(meta, fps=overrides["video_fps"]).tolist()
            videos.append((frames[indices], VideoMetadata(**facts.metadata(), frames_indices=indices)))
    for frames, meta in videos[1:]:
        alone = processor(text="<video>", videos=[frames], video_metadata=meta, **video_call)
        piece = processor.tokenizer.decode(alone["input_ids"][0])
        at = rendered.index("<video>", rendered.index("<video>") + 1)
        rendered = rendered[:at] + piece + rendered[at + len("<video>"):]
    call: dict = {}
    if images:
        call["images"] = images
    if videos:
        call.update(videos=[videos[0][0]], video_metadata=videos[0][1], **video_call)
    if waves:
        call["audio"] = waves
    return processor(text=rendered, return_tensors="np", **call), waves


def test_tokens_equal_the_processor(nemotron_run, nemotron_folder):
    from transformers import AutoProcessor

    sources, ledger, out, overrides = nemotron_run
    processor = AutoProcessor.from_pretrained(nemotron_folder)
    tok = processor.tokenizer
    image_id, audio_id = tok.convert_tokens_to_ids("<image>"), tok.convert_tokens_to_ids("<so_embedding>")
    expected_status = {k: "packed" for k in SAMPLES}
    if overrides:  # a frame list has no rate to sample by (the processor refuses it too)
        expected_status["frames"] = "error"
        assert "no frame rate" in ledger["frames"]["reason"]
    assert {k: r["status"] for k, r in ledger.items()} == expected_status, ledger
    segments = {seg.key: (seg, tokens, targets, members) for seg, tokens, targets, members in
                fx.packed_segments(out)}
    assert set(segments) == {k for k, s in expected_status.items() if s == "packed"}
    for key, (seg, tokens, targets, members) in segments.items():
        turns, specs = SAMPLES[key]
        expected, waves = expected_ids(processor, turns, specs, sources[key][1], overrides)
        assert tokens.tolist() == expected["input_ids"][0].tolist(), key
        replies = tok.decode(tokens[targets.astype(bool)].tolist())
        assert replies == "".join(t + "<|im_end|>" for t in turns[1::2]), key
        assert ledger[key]["tokens"] == len(tokens) and ledger[key]["images"] == len(specs)
        # Media: bytes unchanged, in tag order; each item's span and placeholders where the tokens say.
        assert [m.kind for m in seg.media] == [{"frames": "video"}.get(s[0], s[0]) for s in specs]
        for m, data in zip(seg.media, sources[key][1]):
            assert [members[n] for n in m.members] == (data if isinstance(data, list) else [data])
        images = [m for m in seg.media if m.kind == "image"]
        if images:
            assert [m.grid_thw for m in images] == [[1, *g] for g in expected["image_grid_hw"].tolist()]
        waves_left = list(waves)
        for m in seg.media:
            a, b = m.span
            embed = audio_id if m.kind == "audio" else image_id
            assert a <= m.token_offset < b and tokens[m.token_offset] == embed
            assert int((tokens[a:b] == embed).sum()) == m.tokens
            assert tok.convert_ids_to_tokens(int(tokens[b - 1])) == ("<so_end>" if m.kind == "audio" else "</img>")
            if m.kind == "image":
                assert tokens[a] == tok.convert_tokens_to_ids("<img>")
            if m.kind == "audio":
                assert tokens[a] == tok.convert_tokens_to_ids("<so_start>")
                assert m.samples == len(waves_left.pop(0)) and m.grid_thw == []
            if m.kind == "video":
                assert tok.decode(tokens[a:a + 4].tolist()).lstrip().startswith("Frame 1 ")
                assert m.grid_thw[0] == len(m.frame_indices) and m.total_frames >= len(m.frame_indices)
        videos = [m for m in seg.media if m.kind == "video"]
        if videos and "pixel_values_videos" in expected:
            assert videos[0].grid_thw[0] == expected["pixel_values_videos"].shape[0]
        # Nothing but the media spans holds media tokens.
        outside = np.ones(len(tokens), bool)
        for m in seg.media:
            outside[m.span[0]:m.span[1]] = False
        assert not np.isin(tokens[outside], [image_id, audio_id]).any()


def test_manifest_describes_the_family(nemotron_run, nemotron_folder):
    _, _, out, overrides = nemotron_run
    manifest = Manifest.read(out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(nemotron_folder)
    ids = tok.convert_tokens_to_ids
    assert manifest.image_processor["family"] == "nemotron_omni"
    assert manifest.image_processor["fps"] == overrides.get("video_fps")
    assert manifest.image_processor["audio_max_seconds"] == overrides.get("audio_max_seconds")
    assert (manifest.image_token_id, manifest.vision_start_token_id, manifest.vision_end_token_id) == (
        ids("<image>"), ids("<img>"), ids("</img>"))
    assert (manifest.audio_token_id, manifest.audio_start_token_id, manifest.audio_end_token_id) == (
        ids("<so_embedding>"), ids("<so_start>"), ids("<so_end>"))
    assert manifest.video_token_id is None and manifest.video_processor is None


def test_settings_of_another_family_do_not_apply(nemotron_folder, demo_dir):
    from packtool.packer.encoder import Encoder

    with pytest.raises(ConfigError, match="video_min_pixels do not apply to a Nemotron Omni"):
        Encoder(EncodeSettings(tokenizer=str(nemotron_folder), pack_size=1024, video_min_pixels=100))
    with pytest.raises(ConfigError, match="audio_max_seconds applies to Nemotron Omni model folders"):
        Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=1024, audio_max_seconds=3))
    with pytest.raises(ConfigError, match="has no processor"):
        Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=1024, media_tokens="processor"))


def encode(folder: Path, turns: list[str], specs: list[tuple], **settings):
    """One sample through the encoder (no shards): its :class:`packtool.packer.encoder.Encoded` row."""
    from packtool.packer.encoder import Encoder
    from packtool.packer.sources import RawSample

    members, _ = source_sample(turns, specs)
    raw = RawSample("k", "s.tar", 0, members, {p: (0, len(d)) for p, d in members.items()})
    return Encoder(EncodeSettings(tokenizer=str(folder), **settings)).encode_many([raw])[0]


TWO_TURNS = (["<image>What is it?", "a picture", "Watch <video> and hear <audio>.", "a clip with sound"],
             [("image", 40, 30), ("video", "mp4", 64, 48, 8, 4), ("audio", "wav", 16000, 1, 0.5)])


def test_truncation_never_cuts_inside_a_media_span(nemotron_folder):
    full = encode(nemotron_folder, *TWO_TURNS, pack_size=PACK_SIZE)
    assert full.status == "packed" and [m.kind for m in full.media] == ["image", "video", "audio"]
    image, video, audio = (m.span for m in full.media)
    # A per-pack cap on media items or media tokens counts every kind: the cut comes before the item over it.
    for cap, at in (({"max_images": 1}, video[0]), ({"max_images": 2}, audio[0]),
                    ({"max_image_tokens": full.media[0].tokens + full.media[1].tokens}, audio[0])):
        cut = encode(nemotron_folder, *TWO_TURNS, pack_size=PACK_SIZE, **cap)
        assert cut.status == "truncated" and len(cut.tokens) == at, cap
        assert cut.tokens.tolist() == full.tokens[:at].tolist()
        assert [m.span for m in cut.media] == [m.span for m in full.media if m.span[1] <= at]
    # A pack size that ends inside the video's frame labels or placeholders cuts before the video.
    for inside in (video[0] + 3, (video[0] + video[1]) // 2, video[1] - 1):
        cut = encode(nemotron_folder, *TWO_TURNS, pack_size=inside)
        assert cut.status == "truncated" and len(cut.tokens) == video[0], inside
        assert [m.kind for m in cut.media] == ["image"]
    assert encode(nemotron_folder, *TWO_TURNS, pack_size=image[1] - 1).status == "dropped"


def test_a_text_cut_before_tokenizing_keeps_the_media_exact(nemotron_folder):
    """A text far longer than a pack is cut before it is tokenized; an expansion that runs past the cut is left
    out with everything after it."""
    # The video's expansion (about 7,000 characters) starts before the cut at 65,536 characters and ends after it.
    long = ["<image>First?", "an image", "word " * 12600 + "<video> and <audio>?", "more"]
    full = encode(nemotron_folder, long, TWO_TURNS[1], pack_size=PACK_SIZE * 4)
    assert full.status == "packed" and len(full.media) == 3
    cut = encode(nemotron_folder, long, TWO_TURNS[1], pack_size=512)
    assert cut.status == "truncated" and "at least" in cut.reason
    assert cut.tokens.tolist() == full.tokens[:512].tolist()
    assert cut.media == full.media[:1]


@pytest.mark.parametrize("sample", ["image_audio", "mkv_image_mp3", "second_turn_audio", "text_only"])
def test_processor_mode_equals_the_rules(torchvision, nemotron_folder, sample):
    """The folder's own processor on every sample gives the tokens, targets and media spans of the fast rules."""
    rule = encode(nemotron_folder, *SAMPLES[sample], pack_size=PACK_SIZE)
    processor = encode(nemotron_folder, *SAMPLES[sample], pack_size=PACK_SIZE, media_tokens="processor")
    assert rule.status == processor.status == "packed"
    assert processor.tokens.tolist() == rule.tokens.tolist()
    assert processor.targets.tolist() == rule.targets.tolist()
    keys = ("kind", "token_offset", "tokens", "grid_thw", "samples")
    assert [{k: getattr(m, k) for k in keys} for m in processor.media] == \
        [{k: getattr(m, k) for k in keys} for m in rule.media]
    for p, r in zip(processor.media, rule.media):  # items with only spaces between them: a space more at most
        assert p.span == r.span or (sample == "mkv_image_mp3" and p.span[0] <= r.span[0]
                                    and r.span[1] <= p.span[1] <= r.span[1] + 1)
    spans = [m.span for m in processor.media]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint, in order
    # The processor decodes each clip before its plan: the store records its samples first (the rules' after).
    assert [m.decoded for m in processor.media] == [m.kind == "audio" for m in rule.media]
    assert not any(m.decoded for m in rule.media)


def test_a_text_only_template_gets_the_processors_placeholders(nemotron_folder, tmp_path):
    """A chat template that renders message text only (no media parts) gets each tag as the text placeholder the
    processor expands (``<audio>`` becomes ``<so_embedding>``): the sample encodes as with the folder's own
    template, which renders media parts."""
    import shutil

    folder = tmp_path / "text-only"
    shutil.copytree(nemotron_folder, folder)
    (folder / "chat_template.jinja").write_text(
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    parts = encode(nemotron_folder, *TWO_TURNS, pack_size=PACK_SIZE)
    text = encode(folder, *TWO_TURNS, pack_size=PACK_SIZE)
    assert parts.status == "packed" and text.status == "packed", text.reason
    assert [m.kind for m in text.media] == ["image", "video", "audio"]
    assert text.tokens.tolist() == parts.tokens.tolist() and text.targets.tolist() == parts.targets.tolist()
    assert text.media == parts.media
