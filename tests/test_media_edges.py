"""Media edges: many-channel audio, cut clips, clips too short for features, tiny videos, and media work that must
stay bounded by what a sample is allowed to cost. Real files made here, real decoders, transformers' processors as
the oracles."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import mediafixture as mf

ROOT = Path(__file__).resolve().parents[1]


# -- audio of many channels ------------------------------------------------------------------------------------
def wav_pcm16(samples: np.ndarray, rate: int) -> bytes:
    """A WAV written by the standard library (``samples``: ``(channels, n)`` int16; no channel mask)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(samples.shape[0])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(samples.T).tobytes())
    return buf.getvalue()


def flac_pcm16(samples: np.ndarray, rate: int) -> bytes:
    """A FLAC of ``samples`` (``(channels, n)`` int16) encoded by FFmpeg through PyAV (FLAC takes up to 8)."""
    import av

    layout = {6: "5.1", 8: "7.1"}[samples.shape[0]]
    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.T).reshape(1, -1), format="s16",
                                           layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


def tones(channels: int, n: int) -> np.ndarray:
    """``(channels, n)`` int16: a different tone per channel."""
    t = np.arange(n) / 16000
    return np.stack([8000 * np.sin(2 * np.pi * 200 * (c + 1) * t) for c in range(channels)]).astype(np.int16)


_DECODE_IN_A_CHILD = """
import sys, numpy as np
from packtool.media.audio import decode_audio, probe_audio
data = open(sys.argv[1], "rb").read()
facts = probe_audio(data, decode=True)
wave = decode_audio(data, rate=16000)
np.save(sys.argv[2], wave)
print(facts.channels, facts.samples)
"""


@pytest.mark.parametrize("fmt,channels", [("wav", 6), ("wav", 8), ("wav", 12), ("flac", 6), ("flac", 8)])
def test_many_channel_audio_decodes_to_the_channel_mean(fmt, channels, tmp_path):
    """6, 8 and 12 channels (FLAC stops at 8) decode to the mean of the channels, in a child process: PyAV's
    planar conversion of 8 or more channels crashed the process, which must fail this test, not pytest."""
    samples = tones(channels, 3000)
    data = (wav_pcm16 if fmt == "wav" else flac_pcm16)(samples, 16000)
    (tmp_path / f"clip.{fmt}").write_bytes(data)
    child = subprocess.run([sys.executable, "-c", _DECODE_IN_A_CHILD, str(tmp_path / f"clip.{fmt}"),
                            str(tmp_path / "wave.npy")], capture_output=True, text=True, timeout=120,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.split() == [str(channels), "3000"]
    expected = (samples.astype(np.float32) / 32768).mean(axis=0)
    np.testing.assert_allclose(np.load(tmp_path / "wave.npy"), expected, atol=1e-6)


# -- a long clip cut to --audio-max-seconds ----------------------------------------------------------------------
def test_a_cut_clip_is_resampled_only_up_to_the_cut(monkeypatch):
    """``decode_audio`` resamples the samples before the cut (and a margin), not the whole clip: an 8 Hz clip of
    ~83 minutes cut to 30 s hands soxr a few thousand samples, and the waveform equals, to the bit, the whole
    clip resampled and then cut (checked on a clip small enough to resample whole)."""
    import soxr

    from packtool.media.audio import decode_audio

    given: list[int] = []
    resample = soxr.resample
    monkeypatch.setattr(soxr, "resample", lambda x, *a, **k: (given.append(len(x)), resample(x, *a, **k))[1])
    long_clip = wav_pcm16(tones(1, 40_000), 8)
    wave_ = decode_audio(long_clip, rate=16000, max_samples=30 * 16000)
    assert len(wave_) == 30 * 16000 and given == [30 * 8 + 4096]
    for rate, seconds in ((8, 600), (22050, 4), (44100, 3)):
        clip = wav_pcm16(tones(1, rate * seconds), rate)
        cut = decode_audio(clip, rate=16000, max_samples=16000 * seconds // 3 + 7)
        whole = decode_audio(clip, rate=16000)
        assert np.array_equal(cut, whole[:len(cut)]), rate


# -- a YAML alias bomb -------------------------------------------------------------------------------------------
def test_a_yaml_alias_bomb_is_refused_in_one_line(demo_dir, tmp_path):
    """~700 bytes of nested aliases in dataset.yaml (9^12 values once expanded) stop ``pack`` at once with a
    one-line error; a file whose aliases expand to little still reads."""
    from typer.testing import CliRunner

    from packtool.cli import app
    from packtool.errors import FormatError
    from packtool.format import read_mapping

    chat = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    src = mf.write_source(tmp_path / "src", {"a": {"json": chat.encode()}})
    lines = ["__module__: megatron.energon", "__class__: CrudeWebdataset", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 13)]
    (src / ".nv-meta/dataset.yaml").write_text("\n".join(lines) + "\n")
    with pytest.raises(FormatError, match="aliases expand it to more than 1,000,000 values"):
        read_mapping(src / ".nv-meta/dataset.yaml", "dataset file")
    result = CliRunner().invoke(app, ["pack", str(src), str(tmp_path / "out"), "--tokenizer",
                                      str(demo_dir / "tokenizer"), "--pack-size", "512"])
    assert result.exit_code != 0 and "aliases expand it to more than" in result.output, result.output
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output, result.output
    small = tmp_path / "small.yaml"
    small.write_text("base: &b {x: 1}\nthere: *b\n")
    assert read_mapping(small, "file") == {"base": {"x": 1}, "there": {"x": 1}}


# -- videos 1 or 3 pixels high -----------------------------------------------------------------------------------
def chat_of(user: str, reply: str = "a short answer") -> bytes:
    return json.dumps({"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}).encode()


def test_videos_one_or_three_pixels_high_read_with_the_counted_grid(torchvision, demo_dir, tmp_path):
    """transformers reads a THWC array 1 or 3 pixels high as channels first unless told: the reader tells it, so
    its grid is the one counted at pack time and its pixels are the processor's on the frames as they are."""
    import torch
    from transformers.video_utils import VideoMetadata

    from packtool.families.qwen2_vl.reader import video_processor_from_manifest
    from packtool.format import load_manifest
    from packtool.media import decode_frames
    from packtool.packer.pipeline import pack
    from packtool.runtime.read import read_packs
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    samples = {f"h{h}": {"json": chat_of("<video>What moves?"),
                         **{f"video.{i}.png": mf.make_image(64, h, seed=i) for i in range(4)}} for h in (1, 3)}
    mf.write_source(tmp_path / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                            PlanSettings(shard_size="4"))
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    batches = list(read_packs(tmp_path / "out"))
    manifest = load_manifest(tmp_path / "out")
    processor = video_processor_from_manifest(manifest)
    grids = [g for b in batches for g in b["video_grid_thw"].tolist()]
    values = torch.cat([b["pixel_values_videos"] for b in batches])
    assert len(grids) == 2
    expected_values = []
    for key in sorted(samples):  # one pack: segments in pack order, which the keys follow here
        frames = decode_frames([samples[key][f"video.{i}.png"] for i in range(4)], [0, 1, 2, 3])
        meta = VideoMetadata(total_num_frames=4, fps=None, width=64, height=frames.shape[1],
                             frames_indices=[0, 1, 2, 3])
        ours = processor(videos=[frames], video_metadata=[meta], do_sample_frames=False,
                         input_data_format="channels_last", return_tensors="pt")
        wrong = processor(videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt")
        assert ours["video_grid_thw"].tolist() != wrong["video_grid_thw"].tolist()  # the control
        assert ours["video_grid_thw"].tolist()[0] in grids, key
        expected_values.append(ours["pixel_values_videos"])
    keys = [k for b in batches for k in b["keys"]]
    order = [sorted(samples).index(k) for k in keys]
    assert values.shape == torch.cat([expected_values[i] for i in order]).shape
    assert (values == torch.cat([expected_values[i] for i in order])).all()


# -- the processor mode: audio, Qwen2-Audio, LLaVA-OneVision videos -----------------------------------------------
AUDIO_TEMPLATE = (  # Qwen2-Audio's shape: audio parts only, each rendered with its number
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}"
    "{{- 'Audio ' + loop.index|string + ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@pytest.fixture(scope="module")
def processor_folders(torchvision, tmp_path_factory) -> dict[str, Path]:
    """Processor folders made offline on the Nemotron demo tokenizer (with ``<video>`` and Qwen2-Audio's tokens
    added): LLaVA (images only), Qwen2-Audio (audio only) and LLaVA-OneVision (images and videos)."""
    from transformers import (
        AutoTokenizer,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    import nemotron_omni_model
    from test_media_pack import llava_folder

    root = tmp_path_factory.mktemp("processors")
    base = nemotron_omni_model.write_model_folder(root / "nemotron")
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": ["<video>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]})
    Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tok,
                        chat_template=AUDIO_TEMPLATE).save_pretrained(root / "qwen2_audio")
    LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size={"height": 56, "width": 56}, image_grid_pinpoints=[[56, 56]]),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 56, "width": 56}), tokenizer=tok,
        num_image_tokens=16, vision_feature_select_strategy="full",
        chat_template=nemotron_omni_model.chat_template()).save_pretrained(root / "onevision")
    return {"llava": llava_folder(root / "llava", base), "qwen2_audio": root / "qwen2_audio",
            "onevision": root / "onevision"}


def pack_processor_mode(folder: Path, samples: dict, out: Path) -> dict[str, dict]:
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    mf.write_source(out.parent / f"{out.name}-src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=4096, media_tokens="processor"),
                            PlanSettings(shard_size="4"))
    pack(out.parent / f"{out.name}-src", out, settings, workers=1, progress=False, max_error_rate=1.0)
    return {r["key"]: r for r in pq.read_table(out / "ledger.parquet").to_pylist()}


def test_processor_mode_quarantines_audio_for_a_model_without_audio(processor_folders, tmp_path):
    """One audio clip in a dataset for an image-only model is that sample's error row, not the run's end."""
    ledger = pack_processor_mode(processor_folders["llava"], {
        "image": {"json": chat_of("<image>What is it?"), "png": mf.make_image(40, 30)},
        "audio": {"json": chat_of("<audio>What is said?"), "wav": mf.make_audio("wav", samples=8000, rate=16000)},
    }, tmp_path / "out")
    assert ledger["image"]["status"] == "packed"
    assert ledger["audio"]["status"] == "error" and "takes no audio" in ledger["audio"]["reason"], ledger["audio"]


def test_processor_mode_renders_audio_parts_for_an_audio_only_template(processor_folders, tmp_path):
    """Qwen2-Audio's template takes audio parts and no image part: probed per media kind, the audio tag becomes
    its part, and the tokens are the processor's on the rendered conversation."""
    from transformers import AutoProcessor

    import packfixture as fx
    from packtool.media.audio import decode_audio

    clips = {"a": mf.make_audio("wav", samples=8000, rate=16000),
             "b": mf.make_audio("flac", samples=20000, rate=22050)}
    ledger = pack_processor_mode(processor_folders["qwen2_audio"], {
        key: {"json": chat_of("<audio>What is said?", "a tone"), ("wav" if key == "a" else "flac"): data}
        for key, data in clips.items()}, tmp_path / "out")
    assert {k: r["status"] for k, r in ledger.items()} == {"a": "packed", "b": "packed"}, ledger
    processor = AutoProcessor.from_pretrained(processor_folders["qwen2_audio"])
    audio_id = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    for seg, tokens, targets, _ in fx.packed_segments(tmp_path / "out"):
        messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is said?"}]},
                    {"role": "assistant", "content": "a tone"}]
        text = processor.apply_chat_template(messages, tokenize=False)
        wave = decode_audio(clips[seg.key], rate=16000)
        expected = processor(text=[text], audio=[wave], sampling_rate=16000)["input_ids"][0]
        assert tokens.tolist() == list(expected), seg.key
        assert "<audio>" not in processor.tokenizer.decode(tokens.tolist())
        assert seg.media[0].tokens == int((tokens == audio_id).sum()) > 1
        assert processor.tokenizer.decode(tokens[targets.astype(bool)].tolist()) == "a tone<|im_end|>"


def test_processor_mode_onevision_videos_pack_read_and_verify(processor_folders, tmp_path):
    """LLaVA-OneVision: two videos of unequal frame counts in one sample pack (the processor was asked to stack
    them); the reader reads a pack with videos (tokens, labels, the processor's own media tensors) and verify
    agrees."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from packtool.media import decode_video
    from packtool.runtime.read import read_packs
    from packtool.verify.packs import verify_output

    clips = {4: mf.make_video("mp4", width=48, height=32, frames=4, fps=4),
             6: mf.make_video("mkv", width=40, height=24, frames=6, fps=3)}
    ledger = pack_processor_mode(processor_folders["onevision"], {
        "one": {"json": chat_of("<video>What moves?"), "mp4": clips[4]},
        "two": {"json": chat_of("<video> and <video>: which is longer?", "the second"), "a.mp4": clips[4],
                "b.mkv": clips[6]},
        "image": {"json": chat_of("<image>And this?"), "png": mf.make_image(40, 30)},
    }, tmp_path / "out")
    assert {k: r["status"] for k, r in ledger.items()} == dict.fromkeys(("one", "two", "image"), "packed"), ledger
    assert verify_output(tmp_path / "out") == []
    processor = AutoProcessor.from_pretrained(processor_folders["onevision"])
    tokens_only = list(read_packs(tmp_path / "out", images=False))
    batches = list(read_packs(tmp_path / "out"))
    assert [b["tokens"].tolist() for b in batches] == [b["tokens"].tolist() for b in tokens_only]
    assert "media_inputs" not in tokens_only[0]
    videos = [inputs["pixel_values_videos"][0] for b in batches
              for kind, inputs in zip(b["media_kinds"], b["media_inputs"]) if kind == "video"]
    images = [inputs["pixel_values"] for b in batches
              for kind, inputs in zip(b["media_kinds"], b["media_inputs"]) if kind == "image"]
    expected_image = processor.image_processor(images=[Image.open(io.BytesIO(mf.make_image(40, 30)))],
                                               return_tensors="pt")["pixel_values"]
    assert len(images) == 1 and torch.equal(images[0], expected_image)
    expected = [processor.video_processor(videos=[decode_video(clips[n], list(range(n)))], return_tensors="pt")[
        "pixel_values_videos"][0] for n in (4, 4, 6)]
    assert sorted(v.shape[0] for v in videos) == [4, 4, 6]
    for v in videos:
        assert any(v.shape == e.shape and torch.equal(v, e) for e in expected)
    from packtool.runtime.loader import collate_packs

    rows = [*batches, *tokens_only]  # stacked rows keep every item's kind, and the inputs of rows that have them
    stacked = collate_packs(rows, 0)
    assert stacked.media.media_kinds == [k for b in rows for k in b["media_kinds"]] and len(rows) > 1
    assert [id(x) for x in stacked["media_inputs"]] == [id(x) for b in batches for x in b["media_inputs"]]


# -- m4a lengths and clips too short for features -----------------------------------------------------------------
def test_m4a_length_is_the_declared_one_not_the_builds(tmp_path):
    """An AAC clip's samples are those its MP4 edit list declares, at probe and at decode alike, not the decoder's
    whole frames (PyAV 18 keeps the encoder's end padding, 19 drops it): a 0.05 s clip is 800 samples, 1 token."""
    import av

    import nemotron_omni_model
    from packtool.families.nemotron_omni import NemotronOmniSettings
    from packtool.media.audio import decode_audio, probe_audio

    rule = NemotronOmniSettings.from_folder(nemotron_omni_model.write_model_folder(tmp_path / "model"))
    for samples, rate in ((800, 16000), (8000, 16000), (16000, 44100), (22050, 22050)):
        data = mf.make_audio("m4a", samples=samples, rate=rate)
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            declared = int(stream.duration)
            decoded = sum(f.samples for f in container.decode(stream))
        assert abs(declared - samples) <= rate // 1000 + 1 and decoded % 1024 == 0  # the edit list vs whole frames
        facts = probe_audio(data, decode=True)
        assert facts.samples == declared, (samples, rate)
        assert len(decode_audio(data, rate=rate)) == declared
        assert len(decode_audio(data, rate=16000)) == rule.audio_samples(facts)
    assert rule.audio_tokens(probe_audio(mf.make_audio("m4a", samples=800, rate=16000))) == 1


def test_clips_too_short_for_two_feature_frames_are_quarantined(torchvision, tmp_path):
    """Parakeet normalizes each mel bin over the clip's ``samples // hop`` frames with a sample standard
    deviation: under two frames (320 samples at 16 kHz) its features are NaN. Such a clip is quarantined, in the
    rule mode and the processor mode; 320 samples pack."""
    from transformers import AutoProcessor

    import nemotron_omni_model

    folder = nemotron_omni_model.write_model_folder(tmp_path / "model")
    extractor = AutoProcessor.from_pretrained(folder).feature_extractor
    tone = mf.waveform(400, 16000, 1)[0]
    assert np.isnan(extractor([tone[:319]], sampling_rate=16000, return_tensors="np")["input_features"]).any()
    assert np.isfinite(extractor([tone[:320]], sampling_rate=16000, return_tensors="np")["input_features"]).all()
    samples = {f"n{n}": {"json": chat_of("<audio>What is said?"), "wav": mf.make_audio("wav", samples=n, rate=16000)}
               for n in (100, 319, 320)}
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    mf.write_source(tmp_path / "src", samples)
    for mode in ("rule", "processor"):
        settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=4096, media_tokens=mode),
                                PlanSettings(shard_size="4"))
        pack(tmp_path / "src", tmp_path / mode, settings, workers=1, progress=False, max_error_rate=1.0)
        ledger = {r["key"]: r for r in pq.read_table(tmp_path / mode / "ledger.parquet").to_pylist()}
        assert ledger["n320"]["status"] == "packed", (mode, ledger["n320"]["reason"])
        for key in ("n100", "n319"):
            assert ledger[key]["status"] == "error" and "NaN" in ledger[key]["reason"], (mode, ledger[key])


# -- the Qwen reader's image pixels are AutoProcessor's ----------------------------------------------------------
def test_qwen_reader_pixels_equal_the_auto_processors(torchvision, demo_dir, tmp_path):
    """The reader builds the image processor on the backend ``AutoProcessor`` loads (torchvision when installed),
    so its ``pixel_values`` are the model processor's on the same images; the PIL backend (the control) is not."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from packtool.packer.pipeline import pack
    from packtool.runtime.read import read_packs
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    images = {"a": mf.make_image(40, 30, seed=1), "b": mf.make_image(333, 177, seed=2, fmt="JPEG"),
              "c": mf.make_image(517, 389, seed=3)}
    mf.write_source(tmp_path / "src", {k: {"json": chat_of("<image>What is it?"), "png": v} for k, v in images.items()})
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=4096),
                            PlanSettings(shard_size="4"))
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    (batch,) = list(read_packs(tmp_path / "out"))
    pil = [Image.open(io.BytesIO(images[k])) for k in batch["keys"]]
    auto = AutoImageProcessor.from_pretrained(demo_dir / "tokenizer")
    expected = auto(images=pil, return_tensors="pt")
    assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(batch["pixel_values"], expected["pixel_values"].to(torch.float32))
    config = json.loads((demo_dir / "tokenizer/preprocessor_config.json").read_text())
    other = Qwen2VLImageProcessorPil(**{k: config[k] for k in (
        "min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")})
    control = torch.from_numpy(other(images=pil, return_tensors="np")["pixel_values"])
    assert (control - batch["pixel_values"]).abs().max() > 1e-3


# -- Nemotron Omni frame labels under --video-fps ------------------------------------------------------------------
def test_nemotron_frame_labels_are_the_sampled_frames_real_times(torchvision, tmp_path):
    """With ``--video-fps`` packtool labels each sampled frame with its real time in the video (frame 6 of a 7 fps
    video: 0.71 s), as the processor does for pre-sampled frames given with their metadata; transformers' own
    sampling labels the k-th sampled frame at k / fps of the source, as if the sampled frames were consecutive
    (0.14 s): the control shows the two differ here."""
    import av
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    import nemotron_omni_model
    import packfixture as fx
    from packtool.media import decode_video
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    folder = nemotron_omni_model.write_model_folder(tmp_path / "model")
    clip = mf.make_video("mp4", width=64, height=48, frames=10, fps=7)
    mf.write_source(tmp_path / "src", {"v": {"json": chat_of("<video>What moves?"), "mp4": clip}})
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=8192, video_fps=2.0),
                            PlanSettings(shard_size="4"))
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    ((seg, tokens, _, _),) = list(fx.packed_segments(tmp_path / "out"))
    assert seg.media[0].frame_indices == [0, 5]
    processor = AutoProcessor.from_pretrained(folder)
    text = processor.tokenizer.decode(tokens.tolist())
    assert "Frame 1 sampled at 0.00 seconds and frame 2 sampled at 0.71 seconds: " in text
    with av.open(io.BytesIO(clip)) as container:
        total = container.streams.video[0].frames
    own = processor(text=["<video>"], videos=[decode_video(clip, list(range(total)))], do_sample_frames=True, fps=2,
                    video_metadata=VideoMetadata(total_num_frames=total, fps=7.0, width=64, height=48,
                                                 duration=total / 7, frames_indices=list(range(total))))
    own_text = processor.tokenizer.decode(own["input_ids"][0])
    assert "frame 2 sampled at 0.14 seconds" in own_text and "0.71" not in own_text


# -- work bounded by what a sample may cost -----------------------------------------------------------------------
def raw_sample(key: str, members: dict[str, bytes], index: int = 0):
    from packtool.packer.sources import RawSample

    return RawSample(key, "s.tar", index, members, {p: (0, len(d)) for p, d in members.items()})


def test_turns_over_max_turns_are_quarantined_before_rendering(demo_dir, monkeypatch):
    """Locating the replies renders a prefix per reply (work that grows with the square of the turns): a
    conversation over ``max_turns`` is an error row without one render; under it, renders grow with its replies."""
    from packtool.packer.encoder import Encoder
    from packtool.settings import EncodeSettings

    calls: list[int] = []
    render = Encoder.render
    monkeypatch.setattr(Encoder, "render", lambda self, messages, add_generation_prompt=False: (
        calls.append(len(messages)), render(self, messages, add_generation_prompt))[1])
    encoder = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=1 << 20, max_turns=200))

    def conversation(turns: int) -> bytes:
        return json.dumps({"conversations": [{"from": ("human", "gpt")[i % 2], "value": f"turn {i} text {i % 7}"}
                                             for i in range(turns)]}).encode()

    for turns in (20, 40, 200):  # each shape once: renders at most two holed layouts of (1 + replies) renders
        calls.clear()
        (enc,) = encoder.encode_many([raw_sample(f"t{turns}", {"json": conversation(turns)})])
        assert enc.status == "packed" and 0 < len(calls) <= 2 * (turns // 2 + 1) + 2, (turns, len(calls))
    calls.clear()
    (enc,) = encoder.encode_many([raw_sample("long", {"json": conversation(4000)})])
    assert enc.status == "error" and "4000 messages > max_turns 200" in enc.reason and calls == []


def test_media_written_and_decoded_pixels_count_against_the_sample_caps(demo_dir):
    """A pickled list naming one image 60 times is small to read and writes that image 60 times: the written bytes
    count against ``max_sample_bytes``; decoded pixels (every image, every frame given to the processor) count
    against ``max_sample_pixels``."""
    import pickle

    from packtool.packer.encoder import Encoder
    from packtool.settings import EncodeSettings
    from test_mbridge_input import DATASET_YAML, chat

    picture = np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    none = pickle.dumps([])
    listed = {"jpgs": pickle.dumps([picture] * 60), "videos": none, "json": chat("<image>" * 60 + "Same?", "yes")}
    one = {"jpgs": pickle.dumps([picture]), "videos": none, "json": chat("<image>Same?", "yes")}
    assert len(listed["jpgs"]) < 100_000
    settings = dict(tokenizer=str(demo_dir / "tokenizer"), pack_size=1 << 16, allow_pickle=True)
    capped = Encoder(EncodeSettings(**settings, max_sample_bytes=1_000_000), DATASET_YAML)
    many, single = capped.encode_many([raw_sample("many", listed), raw_sample("one", one, 1)])
    assert single.status == "packed", single.reason
    assert many.status == "error" and "would write" in many.reason and "max_sample_bytes 1000000" in many.reason
    pixels = Encoder(EncodeSettings(**settings, max_sample_pixels=160 * 120 * 3), DATASET_YAML)
    three = {"jpgs": pickle.dumps([picture] * 3), "videos": none, "json": chat("<image>" * 3 + "Same?", "yes")}
    four = {"jpgs": pickle.dumps([picture] * 4), "videos": none, "json": chat("<image>" * 4 + "Same?", "yes")}
    ok, over = pixels.encode_many([raw_sample("three", three), raw_sample("four", four, 1)])
    assert ok.status == "packed", ok.reason
    assert over.status == "error" and f"{4 * 160 * 120} decoded pixels > max_sample_pixels" in over.reason
    frames = {"json": chat_of("<video>What moves?"), **{f"video.{i}.png": mf.make_image(64, 48, seed=i)
                                                        for i in range(4)}}
    video = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=1 << 16,
                                   max_sample_pixels=64 * 48 * 3))
    (enc,) = video.encode_many([raw_sample("video", frames)])
    assert enc.status == "error" and f"{4 * 64 * 48} decoded pixels" in enc.reason, enc.reason


_PACK_VERIFY_READ_IN_A_CHILD = """
import sys
from pathlib import Path
from packtool.packer.pipeline import pack
from packtool.runtime.read import read_packs
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from packtool.verify.packs import verify_output
src, out, folder, mode = map(str, sys.argv[1:])
settings = PackSettings(EncodeSettings(tokenizer=folder, pack_size=4096, media_tokens=mode),
                        PlanSettings(shard_size="4"))
pack(Path(src), Path(out), settings, workers=1, progress=False)
assert verify_output(Path(out)) == [], "verify"
batches = list(read_packs(out))
print(sum(len(b["keys"]) for b in batches))
"""


def test_an_eight_channel_clip_packs_verifies_and_reads(torchvision, tmp_path):
    """An 8-channel WAV and FLAC in a Nemotron Omni dataset: pack, verify and the reader, in a child process (they
    all died by SIGSEGV in PyAV's planar conversion; the processor mode decodes through the same function)."""
    import nemotron_omni_model

    folder = nemotron_omni_model.write_model_folder(tmp_path / "model")
    samples = {"wav": {"json": chat_of("<audio>What is said?"), "wav": wav_pcm16(tones(8, 8000), 16000)},
               "flac": {"json": chat_of("<audio>What is said?"), "flac": flac_pcm16(tones(8, 8000), 16000)}}
    mf.write_source(tmp_path / "src", samples)
    for mode in ("rule",):
        child = subprocess.run([sys.executable, "-c", _PACK_VERIFY_READ_IN_A_CHILD, str(tmp_path / "src"),
                                str(tmp_path / mode), str(folder), mode], capture_output=True, text=True,
                               timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                 "HOME": str(tmp_path)})
        assert child.returncode == 0, (mode, child.returncode, child.stderr[-2000:])
        assert child.stdout.split()[-1] == "2", child.stdout


def test_nemotron_reader_reads_videos_one_or_three_pixels_high(torchvision, tmp_path):
    """The Nemotron Omni reader gives its video processor the frames with their layout said: its pixels equal the
    processor's on the same frames handed over channels first (unambiguous), for frames 1 and 3 pixels high."""
    import torch

    import nemotron_omni_model
    from packtool.families.nemotron_omni.reader import nemotron_processors
    from packtool.format import load_manifest
    from packtool.media import decode_frames
    from packtool.packer.pipeline import pack
    from packtool.runtime.read import read_packs
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    folder = nemotron_omni_model.write_model_folder(tmp_path / "model")
    frames = {h: [mf.make_image(64, h, seed=i) for i in range(4)] for h in (1, 3)}
    mf.write_source(tmp_path / "src", {f"h{h}": {"json": chat_of("<video>What moves?"),
                                                 **{f"video.{i}.png": f for i, f in enumerate(frames[h])}}
                                       for h in (1, 3)})
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=8192), PlanSettings(shard_size="4"))
    pack(tmp_path / "src", tmp_path / "out", settings, workers=1, progress=False)
    (batch,) = list(read_packs(tmp_path / "out"))
    processors = nemotron_processors(load_manifest(tmp_path / "out"), tmp_path / "out/.nv-meta/tokenizer")
    video, patch = processors.video, processors.settings.video_patch_size
    expected = []
    for key in batch["keys"]:
        array = decode_frames(frames[int(key[1:])], [0, 1, 2, 3])
        pixels = video(videos=[np.ascontiguousarray(array.transpose(0, 3, 1, 2))], do_sample_frames=False,
                       input_data_format="channels_first", return_tensors="pt")["pixel_values_videos"]
        n, c, h, w = pixels.shape  # laid out as patches, the reader's documented layout
        expected.append(pixels.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
                        .reshape(-1, c * patch * patch))
    assert torch.equal(batch["pixel_values_videos"], torch.cat(expected))
