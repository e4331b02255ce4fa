"""Media probing and token rules, checked against transformers' own processors on generated media.

The exactness tests build real processors (Qwen2.5-VL from the demo model folder, Nemotron Omni from
``examples/nemotron_omni_model.py``), hand them the decoded media, and compare their ``input_ids`` (and grids,
``second_per_grid_ts``, pixel values) with what packtool's rules compute from probed facts alone. Those processors
import torchvision; without it these tests are skipped with that reason, and the probing tests still run.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import mediafixture as mf
from packtool.errors import ConfigError
from packtool.families.nemotron_omni.family import NemotronOmniSettings, expand_placeholders
from packtool.families.qwen2_vl import Qwen2VLSettings
from packtool.media import decode_audio, decode_frames, decode_video, probe_audio, probe_frames, probe_video

MAX_PIXELS = 4096 * 4096

# (extension, width, height, frames, fps): durations from 0.3 s to 6 s, odd sizes, fractional rates.
VIDEOS = [
    ("mp4", 64, 48, 30, 24),
    ("mp4", 96, 32, 13, 6.5),
    ("webm", 80, 80, 25, 12),
    ("mkv", 97, 33, 15, 2.5),
    ("mov", 48, 96, 9, 30),
    ("avi", 64, 64, 20, 10),
]
# (extension, native rate, channels, seconds)
AUDIO = [
    ("wav", 16000, 1, 1.0),
    ("wav", 8000, 2, 0.37),
    ("flac", 44100, 2, 2.3),
    ("mp3", 22050, 1, 1.5),
    ("ogg", 48000, 1, 0.8),
    ("m4a", 44100, 2, 3.1),
]


def _video(spec) -> bytes:
    ext, w, h, n, fps = spec
    return mf.make_video(ext, width=w, height=h, frames=n, fps=fps)


# ---------------------------------------------------------------------------------------------------------------
# Probing (no torchvision needed)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", VIDEOS, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}-{s[3]}f-{s[4]}fps")
def test_probe_video_reads_the_container(spec):
    ext, w, h, n, fps = spec
    data = _video(spec)
    facts = probe_video(data, max_pixels=MAX_PIXELS)
    assert (facts.width, facts.height, facts.frames) == (w, h, n)
    assert facts.fps == pytest.approx(fps)
    assert facts.duration == pytest.approx(n / fps, abs=0.05)
    assert facts.frame_count_source == ("demux" if ext in ("mkv", "webm") else "header")
    decoded = probe_video(data, max_pixels=MAX_PIXELS, decode=True)
    assert decoded.frames == n and decoded.frame_count_source == "decode"
    frames = decode_video(data, [0, n - 1])
    assert frames.shape == (2, h, w, 3) and frames.dtype == np.uint8


def test_decode_video_matches_transformers_pyav_loader(tmp_path):
    """The frames packtool decodes are the frames transformers' own PyAV loader returns for the same indices."""
    from transformers.video_utils import load_video

    data = _video(VIDEOS[0])
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    indices = [0, 3, 7, 29]
    theirs, meta = load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata, **_: np.array(indices))
    facts = probe_video(data, max_pixels=MAX_PIXELS)
    assert (meta.total_num_frames, meta.fps) == (facts.frames, facts.fps)
    assert np.array_equal(decode_video(data, indices), theirs)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty video"),
        (b"not a video at all" * 10, "unreadable video"),
        (mf.make_audio("wav", samples=800, rate=8000), "no video stream"),
        (mf.make_video("avi", width=64, height=48, frames=0), "video has no frames"),
        (mf.make_video("mkv", width=64, height=48, frames=0), "unreadable video"),
        (mf.make_video("mp4", width=64, height=48, frames=0), "no video stream"),
    ],
    ids=["empty", "garbage", "audio-only", "zero-frames-avi", "zero-frames-mkv", "zero-frames-mp4"],
)
def test_probe_video_rejects_with_a_reason(data, reason):
    with pytest.raises(ValueError, match=reason):
        probe_video(data, max_pixels=MAX_PIXELS)


def test_probe_video_guards_frame_size_and_truncation():
    data = _video(VIDEOS[0])
    with pytest.raises(ValueError, match="exceeds the limit"):
        probe_video(data, max_pixels=64 * 47)
    with pytest.raises(ValueError, match="ended after 5 frames; frame 29 was wanted"):
        decode_video(_video(("mp4", 64, 48, 5, 24)), [2, 29])


def test_probe_frames_and_decode_frames():
    frames = [mf.make_image(40, 30, seed=i) for i in range(5)]
    facts = probe_frames(frames, max_pixels=MAX_PIXELS, fps=2.0)
    assert (facts.width, facts.height, facts.frames, facts.fps, facts.duration) == (40, 30, 5, 2.0, 2.5)
    assert probe_frames(frames, max_pixels=MAX_PIXELS).fps is None
    assert decode_frames(frames, [1, 4]).shape == (2, 30, 40, 3)
    with pytest.raises(ValueError, match="differ in size"):
        probe_frames([*frames, mf.make_image(41, 30)], max_pixels=MAX_PIXELS)
    with pytest.raises(ValueError, match="empty"):
        probe_frames([], max_pixels=MAX_PIXELS)


@pytest.mark.parametrize("spec", AUDIO, ids=lambda s: f"{s[0]}-{s[1]}Hz-{s[2]}ch")
def test_probe_audio_counts_what_decoding_yields(spec):
    ext, rate, channels, seconds = spec
    samples = round(seconds * rate)
    data = mf.make_audio(ext, samples=samples, rate=rate, channels=channels)
    facts = probe_audio(data)
    assert facts.channels == channels
    assert facts.sample_count_source == ("header" if ext in ("wav", "flac") else "decode")
    if ext in ("wav", "flac", "mp3"):
        assert (facts.samples, facts.sample_rate) == (samples, rate)
    assert probe_audio(data, decode=True).samples == facts.samples
    for target in (16000, 8000):
        wave = decode_audio(data, rate=target)
        expected = facts.samples if facts.sample_rate == target else -(-facts.samples * target // facts.sample_rate)
        assert wave.dtype == np.float32 and wave.ndim == 1 and len(wave) == expected
    assert len(decode_audio(data, rate=16000, max_samples=1000)) == 1000


def test_probe_audio_reads_the_track_of_a_video():
    data = mf.make_video("mp4", width=64, height=48, frames=12, fps=6, audio_rate=16000)
    facts = probe_audio(data)
    assert facts.sample_rate == 16000 and facts.duration == pytest.approx(2.0, abs=0.1)
    assert probe_video(data, max_pixels=MAX_PIXELS).frames == 12


@pytest.mark.parametrize(("data", "reason"), [(b"", "empty audio"), (b"\x00" * 300, "unreadable audio"),
                                              (mf.make_image(8, 8), "unreadable audio|no audio stream")])
def test_probe_audio_rejects_with_a_reason(data, reason):
    with pytest.raises(ValueError, match=reason):
        probe_audio(data)


# ---------------------------------------------------------------------------------------------------------------
# Settings from model folders (no torchvision needed)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    """The demo Qwen2-VL-style folder: a preprocessor config, no video config (like the public Qwen2.5-VL)."""
    import demo

    return demo.build_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def qwen_sampling_folder(qwen_folder, tmp_path_factory) -> Path:
    """The same folder plus a ``video_preprocessor_config.json`` that samples 2 frames per second."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("qwen_video") / "model"
    shutil.copytree(qwen_folder, out)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": 2.0,
             "min_frames": 4, "max_frames": 12, "size": {"shortest_edge": 3136, "longest_edge": 56 * 56 * 4},
             "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video))
    return out


@pytest.fixture(scope="module")
def qwen_capped_folder(qwen_folder, tmp_path_factory) -> Path:
    """A video config that bounds a video's total pixels (``cap_pixels_per_frame``) by a small token budget."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("qwen_capped") / "model"
    shutil.copytree(qwen_folder, out)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "cap_pixels_per_frame": True, "max_video_tokens": 40,
             "size": {"shortest_edge": 3136, "longest_edge": 200704}}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video))
    return out


@pytest.fixture(scope="module")
def nemotron_folder(tmp_path_factory) -> Path:
    import nemotron_omni_model

    return nemotron_omni_model.write_model_folder(tmp_path_factory.mktemp("nemotron") / "model")


@pytest.fixture(scope="module")
def nemotron_sampling_folder(nemotron_folder, tmp_path_factory) -> Path:
    """Same tokenizer; video sampled at 2 fps, smaller image budget and video tiles."""
    from tokenizers import Tokenizer

    import nemotron_omni_model

    return nemotron_omni_model.write_model_folder(
        tmp_path_factory.mktemp("nemotron_s") / "model",
        tokenizer=Tokenizer.from_file(str(nemotron_folder / "tokenizer.json")),
        image={"min_num_patches": 64, "max_num_patches": 256},
        video={"do_sample_frames": True, "fps": 2, "video_target_num_patches": 256},
    )


def test_qwen_settings_follow_the_folder(qwen_folder, qwen_sampling_folder):
    plain = Qwen2VLSettings.from_folder(qwen_folder)
    assert plain.video_config == "preprocessor_config.json"
    assert (plain.video_min_pixels, plain.video_max_pixels) == (plain.image.min_pixels, plain.image.max_pixels)
    assert plain.do_sample_frames is False
    sampling = Qwen2VLSettings.from_folder(qwen_sampling_folder)
    assert sampling.video_config == "video_preprocessor_config.json"
    assert (sampling.do_sample_frames, sampling.fps, sampling.max_frames, sampling.video_max_pixels) == (
        True, 2.0, 12, 56 * 56 * 4)
    over = Qwen2VLSettings.from_folder(qwen_folder, fps=1, max_frames=8, video_max_pixels=28 * 28 * 16)
    assert (over.do_sample_frames, over.fps, over.max_frames, over.video_max_pixels) == (True, 1.0, 8, 28 * 28 * 16)
    manifest = over.manifest()
    assert manifest["family"] == "qwen2_vl" and manifest["fps"] == 1.0 and manifest["image"]["type"] == "qwen2_vl"
    with pytest.raises(ConfigError, match="exactly one"):
        Qwen2VLSettings.from_folder(qwen_folder, fps=1, num_frames=4)


def test_nemotron_settings_follow_the_folder(nemotron_folder, nemotron_sampling_folder, tmp_path):
    plain = NemotronOmniSettings.from_folder(nemotron_folder)
    assert plain == NemotronOmniSettings(video_config="processor_config.json")
    s = NemotronOmniSettings.from_folder(nemotron_sampling_folder, audio_max_seconds=2)
    assert (s.min_num_patches, s.max_num_patches, s.video_target_num_patches) == (64, 256, 256)
    assert (s.do_sample_frames, s.fps, s.audio_max_seconds, s.max_audio_samples) == (True, 2.0, 2, 32000)
    assert s.manifest()["family"] == "nemotron_omni"
    from tokenizers import Tokenizer

    import nemotron_omni_model

    tok = Tokenizer.from_file(str(nemotron_folder / "tokenizer.json"))
    bad = nemotron_omni_model.write_model_folder(tmp_path / "bad", tokenizer=tok, audio={"sampling_rate": 22050})
    with pytest.raises(ConfigError, match="22050 Hz"):
        NemotronOmniSettings.from_folder(bad)


def test_expand_placeholders_counts_must_match():
    assert expand_placeholders("a<x>b<y>c<x>", {"<x>": ["1", "2"], "<y>": ["3"]}) == "a1b3c2"
    assert expand_placeholders("keep <x>", {"<x>": []}) == "keep <x>"
    with pytest.raises(ValueError, match="more <x>"):
        expand_placeholders("<x><x>", {"<x>": ["1"]})
    with pytest.raises(ValueError, match="1 <x> placeholders for 2"):
        expand_placeholders("<x>", {"<x>": ["1", "2"]})


def test_nemotron_audio_rule_is_the_processors_estimate():
    """The processor's own pure-Python counting helper (importable without torchvision) agrees for every length."""
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import NemotronH_Omni_Reasoning_V3Processor

    from packtool.media import AudioFacts

    settings = NemotronOmniSettings()

    class Counter:  # the attributes the helper reads from a processor instance
        audio_hop_length, audio_subsampling_factor = 160, 8

    for n in [1, 159, 160, 161, 1279, 1280, 1281, 16000, 16001, 48000 * 7 + 13]:
        expected = max(1, NemotronH_Omni_Reasoning_V3Processor._estimate_audio_num_embeddings(Counter(), n))
        assert settings.audio_tokens(AudioFacts(n, 16000, 1, "header")) == expected, n


# ---------------------------------------------------------------------------------------------------------------
# Exactness against the transformers processors (torchvision needed)
# ---------------------------------------------------------------------------------------------------------------


def _qwen_processor(folder: Path):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=Qwen2VLVideoProcessor.from_pretrained(folder),
    )


def _full_video(data: bytes, facts) -> np.ndarray:
    return decode_video(data, range(facts.frames))


QWEN_SAMPLES = {
    # name: (videos, images (w, h), frames-list videos)
    "one-video": ([VIDEOS[0]], [], []),
    "two-videos": ([VIDEOS[1], VIDEOS[2]], [], []),
    "video-and-image": ([VIDEOS[3]], [(50, 70)], []),
    "three-containers": ([VIDEOS[4], VIDEOS[5], VIDEOS[0]], [(300, 40)], []),
    "frames-list": ([], [], [(6, 44, 36)]),
}


@pytest.mark.parametrize("folder_kind", ["plain", "sampling", "override-fps", "capped"])
@pytest.mark.parametrize("sample", list(QWEN_SAMPLES), ids=str)
def test_qwen_rule_equals_processor(torchvision, qwen_folder, qwen_sampling_folder, qwen_capped_folder, folder_kind,
                                    sample):
    from transformers.video_utils import VideoMetadata

    folder = {"sampling": qwen_sampling_folder, "capped": qwen_capped_folder}.get(folder_kind, qwen_folder)
    overrides = {"fps": 1.5, "min_frames": 2} if folder_kind == "override-fps" else {}
    settings = Qwen2VLSettings.from_folder(folder, **overrides)
    processor = _qwen_processor(folder)
    video_specs, image_sizes, frame_lists = QWEN_SAMPLES[sample]

    videos, facts, metas = [], [], []
    for spec in video_specs:
        data = _video(spec)
        f = probe_video(data, max_pixels=MAX_PIXELS)
        videos.append(_full_video(data, f))
        facts.append(f)
        metas.append(VideoMetadata(**f.metadata()))
    for n, w, h in frame_lists:
        frames = [mf.make_image(w, h, seed=i) for i in range(n)]
        f = probe_frames(frames, max_pixels=MAX_PIXELS)
        videos.append(decode_frames(frames, range(n)))
        facts.append(f)
        metas.append(VideoMetadata(**f.metadata()))
    if settings.do_sample_frames and any(f.fps is None for f in facts):
        with pytest.raises(ValueError, match="no frame rate"):
            settings.video(next(f for f in facts if f.fps is None))
        pytest.skip("a frame list without a rate cannot be sampled by rate (the processor refuses too)")
    images = [mf.make_image(w, h, seed=7) for w, h in image_sizes]

    text = "<|im_start|>user\n" + "".join(
        f"clip {i}: <|vision_start|><|video_pad|><|vision_end|>\n" for i in range(len(videos))
    ) + "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in images) + "What happens?<|im_end|>\n"

    pil_images = [Image.open(io.BytesIO(b)) for b in images]
    call = {"do_sample_frames": settings.do_sample_frames, "cap_pixels_per_frame": settings.cap_pixels_per_frame}
    if settings.do_sample_frames:
        call.update(fps=settings.fps, min_frames=settings.min_frames, max_frames=settings.max_frames)
    out = _call_qwen(processor, text, videos, pil_images, metas, call)

    plans = [settings.video(f) for f in facts]
    expanded = expand_placeholders(text, {
        settings.video_token: [settings.video_text(f) for f in facts],
        settings.image_token: [settings.image_text(im.width, im.height) for im in pil_images],
    })
    ids = processor.tokenizer(expanded)["input_ids"]
    assert out["input_ids"][0].tolist() == ids
    assert out["video_grid_thw"].tolist() == [list(p.grid_thw) for p in plans]
    import torch

    assert torch_equal(out["second_per_grid_ts"], torch.tensor([p.second_per_grid_ts for p in plans]))
    assert sum(p.tokens for p in plans) == sum(1 for t in ids if t == processor.video_token_id)

    # The reader's path: decode only the planned frames and hand them over as they are.
    first = _video(video_specs[0]) if video_specs else None
    if first is not None:
        f0 = facts[0]
        mine = decode_video(first, plans[0].indices)
        kwargs = settings.processor_kwargs(f0)
        alone = processor.video_processor(videos=[mine], video_metadata=[VideoMetadata(**kwargs["video_metadata"])],
                                          do_sample_frames=False, return_metadata=True)
        full = processor.video_processor(videos=[videos[0]], video_metadata=[VideoMetadata(**f0.metadata())],
                                         return_metadata=True, **call)
        assert torch_equal(alone["pixel_values_videos"], full["pixel_values_videos"])
        assert alone["video_metadata"][0].sampled_fps == full["video_metadata"][0].sampled_fps


def _call_qwen(processor, text, videos, images, metas, call):
    """The processor on the whole decoded videos (it samples them itself when told to)."""
    kwargs = dict(call)
    if videos:
        kwargs.update(videos=videos, video_metadata=metas)
    if images:
        kwargs["images"] = images
    return processor(text=[text], return_tensors="pt", **kwargs)


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


NEMOTRON_SAMPLES = {
    # name: (images (w, h), video (a VIDEOS entry, "frames", "frames@2fps" or None), audio (AUDIO entries))
    "image-and-audio": ([(50, 70)], None, [AUDIO[2]]),
    "images-and-two-clips": ([(640, 480), (33, 900), (16, 16)], None, [AUDIO[0], AUDIO[5]]),
    "video": ([], VIDEOS[0], []),
    "webm-video": ([], VIDEOS[2], []),
    "mkv-video-image-audio": ([(120, 90)], VIDEOS[3], [AUDIO[3]]),
    "video-with-its-audio": ([], "av", ["av"]),
    "frames-list": ([], "frames", []),
    "frames-list-with-rate": ([], "frames@2fps", [AUDIO[4]]),
}


def _nemotron_video(kind):
    """(facts, decoder) of the sample's video: decoder(indices) -> frames array."""
    if kind == "av":
        data = mf.make_video("mp4", width=64, height=40, frames=16, fps=8, audio_rate=22050)
    elif isinstance(kind, str):
        frames = [mf.make_image(44, 36, seed=i) for i in range(7)]
        facts = probe_frames(frames, max_pixels=MAX_PIXELS, fps=2.0 if kind.endswith("2fps") else None)
        return facts, lambda idx: decode_frames(frames, idx)
    else:
        data = _video(kind)
    return probe_video(data, max_pixels=MAX_PIXELS), lambda idx: decode_video(data, idx)


def _nemotron_audio(kind):
    if kind == "av":
        return mf.make_video("mp4", width=64, height=40, frames=16, fps=8, audio_rate=22050)
    ext, rate, channels, seconds = kind
    return mf.make_audio(ext, samples=round(seconds * rate), rate=rate, channels=channels)


@pytest.mark.parametrize("folder_kind", ["plain", "sampling", "audio-limit"])
@pytest.mark.parametrize("sample", list(NEMOTRON_SAMPLES), ids=str)
def test_nemotron_rule_equals_processor(torchvision, nemotron_folder, nemotron_sampling_folder, folder_kind, sample):
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    folder = nemotron_sampling_folder if folder_kind == "sampling" else nemotron_folder
    settings = NemotronOmniSettings.from_folder(folder, **({"audio_max_seconds": 1.2}
                                                          if folder_kind == "audio-limit" else {}))
    processor = AutoProcessor.from_pretrained(folder)
    image_sizes, video_kind, audio_kinds = NEMOTRON_SAMPLES[sample]

    images = [Image.open(io.BytesIO(mf.make_image(w, h, seed=3))) for w, h in image_sizes]
    audio_bytes = [_nemotron_audio(k) for k in audio_kinds]
    audio_facts = [probe_audio(b) for b in audio_bytes]
    waves = [decode_audio(b, rate=settings.audio_sampling_rate, max_samples=settings.max_audio_samples)
             for b in audio_bytes]
    assert [len(w) for w in waves] == [settings.audio_samples(f) for f in audio_facts]

    text = "<|im_start|>user\n" + "".join("<image>\n" for _ in images)
    call: dict = {}
    video_texts = []
    if video_kind is not None:
        facts, decode = _nemotron_video(video_kind)
        if settings.do_sample_frames and facts.fps is None:
            with pytest.raises(ValueError, match="no frame rate"):
                settings.video(facts)
            return
        plan = settings.video(facts)
        kwargs = settings.processor_kwargs(facts)
        call["videos"] = [decode(plan.indices)]
        call["do_sample_frames"] = kwargs["do_sample_frames"]
        if "video_metadata" in kwargs:
            call["video_metadata"] = VideoMetadata(**kwargs["video_metadata"])
        text += "Watch <video> closely.\n"
        video_texts.append(settings.video_text(facts))
        if settings.do_sample_frames:
            assert len(plan.indices) < facts.frames or facts.fps <= settings.fps
            # The frames packtool picks are the frames the video processor samples itself.
            full = processor.video_processor(videos=[decode(range(facts.frames))], do_sample_frames=True,
                                             video_metadata=[VideoMetadata(**facts.metadata())])
            mine = processor.video_processor(videos=call["videos"], do_sample_frames=False)
            assert torch_equal(full["pixel_values_videos"], mine["pixel_values_videos"])
            assert full["num_tokens"] == mine["num_tokens"]
    text += "".join("Listen: <so_embedding>\n" for _ in waves) + "Describe it all.<|im_end|>\n"
    if images:
        call["images"] = images
    if waves:
        call["audio"] = waves

    out = processor(text=text, return_tensors="pt", **call)

    expanded = settings.expand(
        text,
        images=[settings.image_text(im.width, im.height, n_images=len(images)) for im in images],
        videos=video_texts,
        audio=[settings.audio_text(f) for f in audio_facts],
    )
    ids = processor.tokenizer(expanded)["input_ids"]
    assert out["input_ids"][0].tolist() == ids
    if images:
        grids = [list(settings.image_grid(im.width, im.height, n_images=len(images))) for im in images]
        assert out["image_grid_hw"].tolist() == grids
    if video_kind is not None:
        assert out["pixel_values_videos"].shape[0] == len(plan.indices)
        assert ("sampled at" in video_texts[0]) == (facts.fps is not None)
    if waves:
        assert out["input_features"].shape[0] == len(waves)


def test_nemotron_two_videos_expand_one_by_one(torchvision, nemotron_folder):
    """The processor takes one video per call: each of a sample's videos expands as if it were alone."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    settings = NemotronOmniSettings.from_folder(nemotron_folder)
    processor = AutoProcessor.from_pretrained(nemotron_folder)
    pieces = []
    for spec in (VIDEOS[1], VIDEOS[4]):
        data = _video(spec)
        facts = probe_video(data, max_pixels=MAX_PIXELS)
        kwargs = settings.processor_kwargs(facts)
        out = processor(text="<video>", videos=[decode_video(data, settings.video(facts).indices)],
                        do_sample_frames=False, video_metadata=VideoMetadata(**kwargs["video_metadata"]))
        assert processor.tokenizer.decode(out["input_ids"][0]) == settings.video_text(facts)
        pieces.append(settings.video_text(facts))
    both = settings.expand("A <video> then B <video>.", videos=pieces)
    assert both == f"A {pieces[0]} then B {pieces[1]}."


@pytest.mark.parametrize("width, height", [(1_000_000, 16), (16, 1_000_000)])
def test_nemotron_grid_refuses_an_image_the_processor_cannot_grid(width, height):
    """transformers' get_patch_grid_size divides by zero when a side scales to no patch: a clear reason instead."""
    with pytest.raises(ValueError, match="too elongated"):
        NemotronOmniSettings().image_grid(width, height)
    assert NemotronOmniSettings().image_grid(300_000, 20) == (2, 11170)
