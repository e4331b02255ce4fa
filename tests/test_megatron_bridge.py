"""Megatron-Bridge: the batch its training steps consume, its data conventions as presets, and failing packs.

`step_view` and `packed_seq_fields` re-derive what Megatron-Bridge's `vlm_step` / `gpt_step` keep of a batch and the
`PackedSeqParams` fields its `get_packed_seq_params` builds, written from that code's behaviour (megatron.core is
not installable here): the steps read packed metadata only under the current keys (`cu_seqlens_q` present; the
legacy `cu_seqlens` key means the PADDED boundaries and only `gpt_step` reads it), move device keys with
`.cuda()` and host keys with `.cpu()` (both must be tensors), set every other key to None, and move
`visual_inputs` attribute by attribute. Qwen2.5-VL then rebuilds each sample from `cu_seqlens_q` (real lengths)
at `cu_seqlens_q_padded` (starts) to compute its 3-D RoPE positions.
"""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

import packfixture as fx
from packtool.errors import ConfigError, FormatError
from packtool.packer.encoder import Encoder
from packtool.packer.sources import RawSample, open_source, read_raw_samples
from packtool.packer.sources.conversation import conversation_adapter
from packtool.runtime.loader import MegatronBridgeTaskEncoder, PackDataset, PackTaskEncoder, collate_packs
from packtool.runtime.megatron_batch import megatron_bridge_batch
from packtool.runtime.read import read_packs
from packtool.settings import EncodeSettings, PackSettings

DEVICE_KEYS = {"cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"}
HOST_KEYS = {"max_seqlen_q", "max_seqlen_kv"}


def step_view(batch: dict, *, vlm: bool) -> dict:
    """The batch as Megatron-Bridge's `vlm_step` (vlm=True) or `gpt_step` keeps it (last pipeline stage)."""
    device = {"tokens", "input_ids", "position_ids", "labels", "loss_mask"}
    host: set[str] = set()
    if vlm:
        device.add("visual_inputs")
    if "cu_seqlens_q" in batch:
        device |= DEVICE_KEYS & batch.keys()
        host |= HOST_KEYS & batch.keys()
        if not vlm and batch.get("padding_mask") is not None:
            device.add("padding_mask")
    elif not vlm and "cu_seqlens" in batch:  # gpt_step's legacy format: cu_seqlens = padded boundaries
        device |= {"cu_seqlens", "cu_seqlens_unpadded"} & batch.keys()
        host |= {"cu_seqlens_argmin", "max_seqlen", "cu_seqlens_unpadded_argmin"} & batch.keys()
    out = {}
    for key, value in batch.items():
        if key == "visual_inputs" and key in device and value is not None:
            assert all(v is None or isinstance(v, torch.Tensor) for v in vars(value).values())
            out[key] = value
        elif key in device or key in host:
            assert value is None or isinstance(value, torch.Tensor), key  # .cuda() / .cpu()
            out[key] = value
        else:
            out[key] = None
    return out


def packed_seq_fields(view: dict) -> dict | None:
    """`PackedSeqParams` fields as `get_packed_seq_params` builds them from the step's packed metadata."""
    if view.get("cu_seqlens_q") is None:
        return None

    def squeeze(v):
        return None if v is None else v.squeeze()

    def scalar(v):
        v = squeeze(v)
        assert v.numel() == 1
        return int(v.item())

    q = squeeze(view["cu_seqlens_q"])
    return {"qkv_format": "thd", "cu_seqlens_q": q,
            "cu_seqlens_kv": squeeze(view.get("cu_seqlens_kv")) if view.get("cu_seqlens_kv") is not None else q,
            "cu_seqlens_q_padded": squeeze(view.get("cu_seqlens_q_padded")),
            "cu_seqlens_kv_padded": squeeze(view.get("cu_seqlens_kv_padded")),
            "max_seqlen_q": scalar(view["max_seqlen_q"]), "max_seqlen_kv": scalar(view["max_seqlen_kv"])}


def qwen_vl_rows(tokens: torch.Tensor, params: dict) -> list[list[int]]:
    """The samples Qwen2.5-VL's forward rebuilds from a THD row (real lengths at padded starts) for its RoPE."""
    q, padded = params["cu_seqlens_q"], params["cu_seqlens_q_padded"]
    assert padded.shape == q.shape
    lengths, starts = q.diff().tolist(), padded[:-1].tolist()
    return [tokens[0, s:s + n].tolist() for s, n in zip(starts, lengths)]


@pytest.fixture
def image_dataset(tmp_path):
    img = [(fx.image_bytes(60, 90, 1), "jpg"), (fx.image_bytes(112, 56, 2, "PNG"), "png"),
           (fx.image_bytes(70, 70, 3), "jpg")]
    packs = [[fx.chat_segment("v0", "what?", "a cat.", [img[0]]), fx.chat_segment("t1", "hi", "hello")],
             [fx.chat_segment("v2", "two", "same", img[1:])],
             [fx.chat_segment("t3", "text only", "ok")]]
    fx.write_packs(tmp_path, {"train": packs}, pack_size=128, align=4, image_processor=fx.QWEN_PROCESSOR,
                   packs_per_shard=2)
    return tmp_path, packs


def check_step_batch(mb: dict, segments: list[dict], *, align: int):
    """What Megatron-Bridge's steps and the THD kernels need of a batch, checked on both steps' views."""
    for vlm in (True, False):
        view = step_view(mb, vlm=vlm)
        params = packed_seq_fields(view)
        assert params is not None, "the step would treat the batch as unpacked"
        q, padded = params["cu_seqlens_q"], params["cu_seqlens_q_padded"]
        assert q.dtype == padded.dtype == torch.int32 and q.dim() == padded.dim() == 1
        assert torch.equal(params["cu_seqlens_kv"], q) and torch.equal(params["cu_seqlens_kv_padded"], padded)
        assert int(padded[-1]) == view["tokens"].shape[1]  # THD: the padded boundaries cover the row
        assert (padded % align == 0).all()  # context-parallel partitioning needs 2·cp-divisible segments
        assert (q.diff() <= padded.diff()).all() and q.diff().tolist() == [len(s["tokens"]) for s in segments]
        assert params["max_seqlen_q"] == params["max_seqlen_kv"] == int(padded.diff().max())
        assert qwen_vl_rows(view["tokens"], params) == [s["tokens"] for s in segments]
        assert view["labels"].shape == view["loss_mask"].shape == view["tokens"].shape == view["position_ids"].shape
        assert view["loss_mask"].dtype == torch.float32 and view["tokens"].dtype == torch.int64
        # loss only on real tokens: none in any segment's padding
        real = torch.zeros(view["tokens"].shape[1], dtype=torch.bool)
        for s, n in zip(padded[:-1].tolist(), q.diff().tolist()):
            real[s:s + n] = True
        assert view["loss_mask"][0, ~real].eq(0).all() and view["labels"][0, ~real].eq(-100).all()
        assert not vlm or view["visual_inputs"] is mb["visual_inputs"]
        assert vlm or torch.equal(view["padding_mask"][0], ~real)


def same_visual_inputs(a, b) -> bool:
    """Equal tensors (or both None) in every field."""
    pairs = zip(vars(a).values(), vars(b).values())
    return all(x is None and y is None or x is not None and y is not None and torch.equal(x, y) for x, y in pairs)


def check_visual_inputs(mb: dict, segments: list[dict]):
    """`visual_inputs` as the VLM step hands it to Qwen2.5-VL: `normalized_for_model()` kwargs whose patches match
    the grids and whose merged tokens match the image placeholders in the row."""
    media = [m for s in segments for m in s["media"]]
    if not media:
        assert mb["visual_inputs"] is None
        return
    kwargs = mb["visual_inputs"].normalized_for_model()
    assert set(kwargs) == {"pixel_values", "image_grid_thw"}
    pixels, grid = kwargs["pixel_values"], kwargs["image_grid_thw"]
    assert grid.dtype == torch.int64 and grid.tolist() == [m["grid_thw"] for m in media]
    assert pixels.dtype == torch.float32 and pixels.shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    assert int((mb["tokens"] == fx.IMAGE_PAD_ID).sum()) == int(grid.prod(-1).sum()) // 4


def test_megatron_bridge_batch_is_what_the_steps_read(image_dataset):
    path, packs = image_dataset
    for batch, segments in zip(read_packs(path), packs):
        # The plain reader batch carries no key a Megatron-Bridge step could misread.
        assert "cu_seqlens" not in batch and "cu_seqlens_q" not in batch
        assert packed_seq_fields(step_view(batch, vlm=False)) is None
        mb = megatron_bridge_batch(batch)
        check_step_batch(mb, segments, align=4)
        check_visual_inputs(mb, segments)
        assert mb["total_tokens"] == 128 and mb["attention_mask"] is None
        assert mb["max_seqlen_q"].shape == () and mb["max_seqlen_q"].dtype == torch.int32


def test_energon_megatron_bridge_task_encoder(image_dataset):
    """Through a real Energon loader: one pack per micro-batch equals `megatron_bridge_batch` of the reader's
    batch; two packs become one valid THD row."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_val_dataset

    path, packs = image_dataset
    by_key = {b["pack_key"]: (b, segs) for b, segs in zip(read_packs(path), packs)}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)

    def loader(batch_size):
        return get_savable_loader(get_val_dataset(path, split_part="train", worker_config=wc, batch_size=batch_size,
                                                  task_encoder=MegatronBridgeTaskEncoder()))

    seen = []
    for mb in loader(1):
        batch, segments = by_key[mb["pack_key"]]
        want = megatron_bridge_batch(batch)
        assert mb.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mb[key], value) and mb[key].dtype == value.dtype, key
            elif key == "visual_inputs" and value is not None:
                assert same_visual_inputs(mb[key], value)
            else:
                assert mb[key] == value, key
        check_step_batch(mb, segments, align=4)
        seen.append(mb["pack_key"])
    assert sorted(seen) == sorted(by_key)
    two = next(iter(loader(2)))
    segments = [s for k in two["pack_key"] for s in by_key[k][1]]
    check_step_batch(two, segments, align=4)
    check_visual_inputs(two, segments)
    assert two["tokens"].shape == (1, 256)


# -- Failing packs ----------------------------------------------------------------------------------------------
@pytest.fixture
def corrupt_dataset(tmp_path):
    """Three packs; the middle one's image member is cut in half (its record is otherwise well-formed)."""
    good = fx.chat_segment("v0", "what?", "a cat.", [(fx.image_bytes(60, 90, 1), "jpg")])
    bad = fx.chat_segment("v1", "and?", "a dog.", [(fx.image_bytes(60, 90, 2), "jpg")])
    bad["media"][0]["bytes"] = bad["media"][0]["bytes"][:300]
    packs = [[good], [bad], [fx.chat_segment("t2", "hi", "hello")]]
    fx.write_packs(tmp_path, {"train": packs}, pack_size=128, align=1, image_processor=fx.QWEN_PROCESSOR)
    return tmp_path


def test_corrupt_media_names_shard_pack_and_member(corrupt_dataset):
    where = r"train/pack-000000\.tar: pack train-000000001, member m0\.jpg: media does not decode"
    with pytest.raises(FormatError, match=where):
        list(read_packs(corrupt_dataset))
    with pytest.raises(FormatError, match=where):
        list(PackDataset(corrupt_dataset, shuffle=False))


def test_energon_loader_stops_at_a_corrupt_pack(corrupt_dataset, caplog):
    """Energon's default error handler logs and skips a failing sample; the task encoder stops instead, naming
    the shard, pack and member. `on_error="skip"` goes on, with a logged count."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset
    from megatron.energon.errors import FatalSampleError

    def keys(encoder):
        ds = get_val_dataset(corrupt_dataset, split_part="train", batch_size=1, task_encoder=encoder,
                             worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        return [b["pack_key"] for b in get_loader(ds)]

    for encoder in (PackTaskEncoder(), MegatronBridgeTaskEncoder()):
        with pytest.raises(FatalSampleError, match=r"pack-000000\.tar: pack train-000000001, member m0\.jpg"):
            keys(encoder)
    skipping = PackTaskEncoder(on_error="skip")
    with caplog.at_level(logging.WARNING, logger="packtool.runtime.loader"):
        assert keys(skipping) == ["train-000000000", "train-000000002"]
    assert skipping.skipped == 1
    assert any("skipped pack 1" in r.message and "train-000000001, member m0.jpg" in r.message
               for r in caplog.records)


# -- Conventions (presets) --------------------------------------------------------------------------------------
def png(w: int, h: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def raw(parts: dict, key: str = "k0") -> RawSample:
    r = RawSample(key=key, shard="shards/x.tar", index=0)
    for name, data in parts.items():
        r.parts[name] = data if isinstance(data, bytes) else json.dumps(data).encode()
        r.ranges[name] = (0, len(r.parts[name]))
    return r


def encoder(demo_dir, name="tokenizer", **kw) -> Encoder:
    return Encoder(EncodeSettings(tokenizer=str(demo_dir / name), pack_size=2048, **kw))


@pytest.mark.parametrize("name", ["tokenizer", "tokenizer-gen"])
def test_target_newline_after_eot_adds_one_target_per_assistant_turn(demo_dir, name):
    src = open_source(demo_dir / "dataset", ["train"])
    raws = list(read_raw_samples(src.root, src.splits["train"][0], src.excluded_samples))
    base, more = encoder(demo_dir, name).encode_many(raws), encoder(demo_dir, name, target_newline_after_eot=True)
    newline = more.tok.convert_tokens_to_ids("Ċ")
    im_end = more.tok.convert_tokens_to_ids("<|im_end|>")
    checked = 0
    for r, a, b in zip(raws, base, more.encode_many(raws)):
        assert a.status == b.status and np.array_equal(a.tokens, b.tokens)
        if a.status != "packed":
            continue
        turns = sum(m["role"] == "assistant" for m in conversation_adapter(r.parts).messages)
        added = np.flatnonzero(b.targets.astype(bool) & ~a.targets.astype(bool))
        assert len(added) == turns and not (a.targets & ~b.targets).any()
        assert (b.tokens[added] == newline).all() and (b.tokens[added - 1] == im_end).all()
        assert a.targets[added - 1].all()  # each follows a targeted end-of-turn token
        checked += 1
    assert checked >= 20


def test_media_first_moves_image_tags_before_the_turn_text(demo_dir):
    """Tokens equal transformers' own chat template over the turn as Megatron-Bridge's Qwen-VL task encoder builds
    it: the image parts first, then the text pieces stripped of their edge spaces."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    turns = [{"role": "user", "content": "Look <image> here. And <image>?"}, {"role": "assistant", "content": "ok"}]
    sample = raw({"json": {"messages": turns}, "0.png": png(60, 60, 1), "1.png": png(90, 40, 2)})
    moved = encoder(demo_dir, media_first=True)
    got, plain = moved.encode_many([sample])[0], encoder(demo_dir).encode_many([sample])[0]
    assert got.status == plain.status == "packed" and got.reason == ""
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Look"},
               {"type": "text", "text": "here. And"}, {"type": "text", "text": "?"}]
    tok = moved.tok
    ids = tok(tok.apply_chat_template([{"role": "user", "content": content}, turns[1]], tokenize=False),
              add_special_tokens=False)["input_ids"]
    cfg = json.loads((demo_dir / "tokenizer" / "preprocessor_config.json").read_text())
    counts = iter(np.prod(smart_resize(h, w, 28, cfg["min_pixels"], cfg["max_pixels"])) // 784
                  for w, h in ((60, 60), (90, 40)))
    expected = [t for i in ids for t in ([i] * next(counts) if i == moved.family.tokens.image_token_id else [i])]
    assert got.tokens.tolist() == expected
    for e in (got, plain):  # the targets stay the reply and its end-of-turn token
        assert tok.decode(e.tokens[e.targets.astype(bool)].tolist()) == "ok<|im_end|>"
    first_text = tok.encode("Look", add_special_tokens=False)[0]
    assert got.media[1].token_offset < list(got.tokens).index(first_text)  # both images before "Look"
    assert plain.media[0].token_offset > list(plain.tokens).index(first_text)  # unmoved: after "Look"


def test_preset_pixel_bounds_change_grids(demo_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sample = raw({"json": {"messages": [{"role": "user", "content": "<image>what?"},
                                        {"role": "assistant", "content": "ok"}]}, "0.png": png(64, 48)})
    preset = encoder(demo_dir, preset="megatron-bridge-qwen-vl")
    got, plain = preset.encode_many([sample])[0], encoder(demo_dir).encode_many([sample])[0]
    # qwen_vl_utils' fetch_image first: 64x48 -> 56x56 (multiples of 28, at least 4·28² pixels); then the
    # processor's rule with the preset's bounds on the resized image (one step from 64x48 would give 28x38).
    h, w = smart_resize(56, 56, 28, 200_704, 1_003_520)
    assert (h, w) == (448, 448) and smart_resize(48, 64, 28, 200_704, 1_003_520) == (392, 532)
    assert got.media[0].grid_thw == (1, h // 14, w // 14) != plain.media[0].grid_thw
    assert got.media[0].tokens == h * w // 784
    described = preset.family.manifest_entries()["image_processor"]
    assert described["min_pixels"] == 200_704 and described["max_pixels"] == 1_003_520
    assert (described["prefit_factor"], described["prefit_min_pixels"], described["prefit_max_pixels"],
            described["backend"]) == (28, 4 * 784, 16384 * 784, "torchvision")
    assert "prefit_factor" not in encoder(demo_dir).family.manifest_entries()["image_processor"]  # others unchanged


def test_fetch_image_resize_rounds_like_qwen_vl_utils():
    """qwen_vl_utils' rounding (a side at least one factor first, no floor when scaling down), not the
    processor's: they differ for very thin images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from packtool.families.qwen2_vl import fetch_image_resize

    assert fetch_image_resize(10, 1500, 28, 3136, 12_845_056) == (28, 1512)
    assert smart_resize(10, 1500, 28, 3136, 12_845_056) == (28, 700)
    assert fetch_image_resize(172, 604, 28, 3136, 12_845_056) == (168, 616)
    with pytest.raises(ValueError, match="aspect ratio"):
        fetch_image_resize(2, 500, 28, 3136, 12_845_056)


def test_sample_limits_drop_the_sample(demo_dir):
    """Megatron-Bridge's per-sample limits skip the whole sample: more than 10 images, or more visual tokens
    (counted by the processor's rule from the stored sizes) than the limit."""
    turns = [{"role": "user", "content": "<image>" * 11 + "how many?"}, {"role": "assistant", "content": "11"}]
    sample = raw({"json": {"messages": turns}, **{f"{i}.png": png(30, 30, i) for i in range(11)}})
    got = encoder(demo_dir, preset="megatron-bridge-qwen-vl").encode_many([sample])[0]
    assert (got.status, got.reason) == ("dropped", "over limit: 11 images > sample_max_images 10")
    assert encoder(demo_dir).encode_many([sample])[0].status == "packed"
    turns = [{"role": "user", "content": "<image><image>what?"}, {"role": "assistant", "content": "ok"}]
    sample = raw({"json": {"messages": turns}, "0.png": png(64, 48), "1.png": png(64, 48, 1)})
    limited = encoder(demo_dir, min_pixels=200_704, max_pixels=1_003_520, image_resize="qwen_vl_utils",
                      sample_max_visual_tokens=520)
    got = limited.encode_many([sample])[0]
    # 2 x 14·19 one-step tokens (what Megatron-Bridge counts for its limit), though each grid holds 16·16 tokens
    assert (got.status, got.reason) == ("dropped", "over limit: 532 visual tokens > sample_max_visual_tokens 520")


@pytest.mark.parametrize("preset", ["megatron-bridge-qwen-vl", "nemo-rl-qwen-vl"])
def test_qwen_presets_drop_an_over_long_sample_as_their_trainers_do(demo_dir, preset):
    """Megatron-Bridge's Qwen-VL encoder raises on a sample longer than ``seq_length`` and Energon skips it; NeMo-RL
    turns it into a stub with loss weight 0. Both train on nothing from it, so their presets drop it (the default
    truncates it and trains the prefix: the control); an explicit ``--overlong truncate`` is refused in one line."""
    from typer.testing import CliRunner

    from packtool.cli import app

    turns = [{"role": "user", "content": "tell me " * 40}, {"role": "assistant", "content": "yes " * 200}]
    sample = raw({"json": {"messages": turns}})
    folder = str(demo_dir / "tokenizer")
    got = Encoder(EncodeSettings(tokenizer=folder, pack_size=128, preset=preset)).encode_many([sample])[0]
    assert got.status == "dropped" and "128" in got.reason, (got.status, got.reason)
    assert Encoder(EncodeSettings(tokenizer=folder, pack_size=128)).encode_many([sample])[0].status == "truncated"
    assert EncodeSettings(tokenizer="m", pack_size=64, preset=preset).overlong == "drop"
    args = ["pack", str(demo_dir / "dataset"), str(demo_dir / "never-written"), "--tokenizer",
            str(demo_dir / "tokenizer"), "--pack-size", "2048", "--preset", preset, "--overlong", "truncate"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "sets overlong to 'drop', not 'truncate'" in result.output, result.output


def test_presets_fill_named_settings_and_are_recorded(demo_dir):
    s = EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, preset="megatron-bridge-qwen-vl")
    assert (s.target_newline_after_eot, s.media_first, s.min_pixels, s.max_pixels) == (True, True, 200_704,
                                                                                      1_003_520)
    described = PackSettings(s).describe()
    assert described["preset"] == "megatron-bridge-qwen-vl" and described["media_first"] is True
    assert EncodeSettings(**{k: v for k, v in described.items() if k in s.__dataclass_fields__}
                          | {"tokenizer": s.tokenizer}) == s  # a manifest's settings rebuild the same settings
    plain = EncodeSettings(tokenizer="m", pack_size=64)
    assert (plain.preset, plain.target_newline_after_eot, plain.media_first, plain.min_pixels) == (None, False,
                                                                                                    False, None)
    with pytest.raises(ConfigError, match="sets min_pixels to 200704, not 3136"):
        EncodeSettings(tokenizer="m", pack_size=64, preset="megatron-bridge-qwen-vl", min_pixels=3136)
    nemotron = EncodeSettings(tokenizer="m", pack_size=64, preset="megatron-bridge-nemotron-omni")
    assert (nemotron.target_newline_after_eot, nemotron.media_first, nemotron.audio_count) == (True, False, "valid")
    with pytest.raises(ConfigError, match="audio_count applies to --preset megatron-bridge-nemotron-omni only"):
        EncodeSettings(tokenizer="m", pack_size=64, audio_count="frames")
    with pytest.raises(ConfigError, match="unknown preset"):
        EncodeSettings(tokenizer="m", pack_size=64, preset="nope")  # type: ignore[arg-type]


def test_cli_preset(demo_dir, tmp_path):
    from typer.testing import CliRunner

    from packtool.cli import app

    args = ["pack", str(demo_dir / "dataset"), str(tmp_path / "out"), "--tokenizer", str(demo_dir / "tokenizer"),
            "--pack-size", "2048"]
    result = CliRunner().invoke(app, args + ["--preset", "megatron-bridge-nemotron-omni"])
    assert result.exit_code == 2 and "is for nemotron_omni model folders" in result.output, result.output
    result = CliRunner().invoke(app, args + ["--audio-count", "frames"])
    assert result.exit_code == 2 and "audio_count applies to --preset megatron-bridge-nemotron-omni" in result.output
    result = CliRunner().invoke(app, args + ["--preset", "megatron-bridge-qwen-vl", "--max-pixels", "5000"])
    assert result.exit_code == 2 and "sets max_pixels to 1003520, not 5000" in result.output
    result = CliRunner().invoke(app, args + ["--preset", "megatron-bridge-qwen-vl", "--cp-size", "2"])
    assert result.exit_code == 2 and "does not split sequences across context-parallel ranks" in result.output


def test_collate_then_bridge_keeps_segments(image_dataset):
    path, packs = image_dataset
    rows = list(read_packs(path, pad_to="segments"))
    mb = megatron_bridge_batch(collate_packs(rows, fx.PAD_ID))
    check_step_batch(mb, [s for p in packs for s in p], align=4)


def test_recipe_settings_follow_the_output(tmp_path):
    """The recipe's seq_length is the row length the reader gives; an alignment too small for the parallelism is
    refused (context parallelism splits each padded segment into 2·cp chunks); no val split turns validation off."""
    import megatron_bridge_recipe as recipe

    fx.write_packs(tmp_path, {"train": [[fx.chat_segment("a", "q", "x")]]}, pack_size=100, align=4)
    got = recipe.packed_settings(tmp_path, context_parallel=2)
    assert got == {"seq_length": next(read_packs(tmp_path))["tokens"].shape[1], "micro_batch_size": 1,
                   "has_val": False}
    with pytest.raises(ValueError, match="needs a multiple of 8"):
        recipe.packed_settings(tmp_path, context_parallel=4)
    with pytest.raises(ValueError, match="FP8 needs a row length that is a multiple of 16, .* rows of 100"):
        recipe.packed_settings(tmp_path, fp8=True)
    both = tmp_path / "both"
    fx.write_packs(both, {"train": [[fx.chat_segment("a", "q", "x")]], "val": [[fx.chat_segment("b", "q", "y")]]},
                   pack_size=96, align=4)
    assert recipe.packed_settings(both, fp8=True) == {"seq_length": 96, "micro_batch_size": 1, "has_val": True}


def test_recipe_refuses_context_parallel_for_qwen2_5_vl(tmp_path):
    import megatron_bridge_recipe as recipe

    fx.write_packs(tmp_path, {"train": [[fx.chat_segment("a", "q", "x")]]}, pack_size=128, align=4,
                   image_processor=fx.QWEN_PROCESSOR)
    assert recipe.packed_settings(tmp_path)["seq_length"] == 128
    with pytest.raises(ValueError, match="Qwen2.5-VL model does not split sequences across context-parallel"):
        recipe.packed_settings(tmp_path, context_parallel=2)


def test_recipe_schedule_from_samples_per_pack(tmp_path):
    """Global batch size in packs from the samples per pack the manifest records, a multiple of the data-parallel
    size; iterations cover the epochs."""
    import megatron_bridge_recipe as recipe

    fx.write_packs(tmp_path, {"train": [[fx.chat_segment(f"k{i}", "q", "x")] for i in range(40)]}, pack_size=64)
    path = tmp_path / ".nv-meta" / "packtool.json"
    manifest = json.loads(path.read_text())
    manifest["counts"] = {"train": {"samples": 170, "packed": 150, "truncated": 10, "dropped": 5, "error": 5}}
    path.write_text(json.dumps(manifest))
    got = recipe.schedule(tmp_path, samples_per_step=64, epochs=2, data_parallel=4)
    assert got == {"global_batch_size": 16, "train_iters": 5, "samples_per_pack": 4.0, "packs": 40}
    assert recipe.schedule(tmp_path, samples_per_step=1, data_parallel=4)["global_batch_size"] == 4
    assert recipe.schedule(tmp_path, samples_per_step=10_000)["global_batch_size"] == 40


# -- Qwen2.5-VL videos ------------------------------------------------------------------------------------------
def qwen_video_records(folder):
    """Two packs as the encoder writes them for the demo Qwen folder: [video, image + video] and [image]."""
    from transformers import AutoTokenizer

    import mediafixture as mf
    from packtool.families.qwen2_vl import Qwen2VLSettings
    from packtool.format import MediaRef, PackRecord, Segment, sha256
    from packtool.media import probe_video
    from packtool.media.folder import read_folder

    settings = Qwen2VLSettings.from_folder(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    start, end, video_pad = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>",
                                                                    "<|video_pad|>"))

    def segment(key, items):
        tokens, refs, media = tok.encode("<|im_start|>user\n", add_special_tokens=False), [], {}
        for kind, data in items:
            member = f"{key}-m{len(refs)}.{'mp4' if kind == 'video' else 'png'}"
            media[member] = data
            begin = len(tokens)
            if kind == "video":
                facts = probe_video(data, max_pixels=10**8)
                plan = settings.video(facts)
                tokens += [start] + [video_pad] * plan.tokens + [end]
                refs.append(MediaRef(member, "video", begin + 1, plan.tokens, list(plan.grid_thw), facts.width,
                                     facts.height, len(data), sha256(data), total_frames=facts.frames, fps=facts.fps,
                                     duration=facts.duration, frame_indices=list(plan.indices),
                                     second_per_grid_ts=plan.second_per_grid_ts, span=[begin, begin + plan.tokens + 2]))
            else:
                w, h = Image.open(io.BytesIO(data)).size
                n = settings.image.tokens(w, h)
                tokens += [start] + [tok.convert_tokens_to_ids("<|image_pad|>")] * n
                tokens += [end]
                refs.append(MediaRef(member, "image", begin + 1, n, list(settings.image.grid(w, h)), w, h, len(data),
                                     sha256(data), span=[begin, begin + n + 2]))
        tokens += tok.encode("What?<|im_end|>\n<|im_start|>assistant\nThis.<|im_end|>\n", add_special_tokens=False)
        return tokens, Segment(key, "train", "src/train-0.tar", False, refs), media

    clips = [mf.make_video("mp4", width=64, height=48, frames=6, fps=4),
             mf.make_video("webm", width=90, height=60, frames=9, fps=6)]
    image = mf.make_image(50, 70)
    packs = [[("v", [("video", clips[0])]), ("iv", [("image", image), ("video", clips[1])])],
             [("i", [("image", image)])]]
    records = []
    for number, pack in enumerate(packs):
        built = [segment(key, items) for key, items in pack]
        tokens = np.concatenate([np.asarray(t, np.int32) for t, _, _ in built])
        seqlens = np.array([len(t) for t, _, _ in built], np.int32)
        media = {k: v for _, _, m in built for k, v in m.items()}
        records.append(PackRecord(f"train-{number:09d}", tokens, np.ones(len(tokens), np.uint8), seqlens, 1024, 8,
                                  [s for _, s, _ in built], media, "0.1.0"))
    manifest = {"pad_token_id": 0, "image_token_id": tok.convert_tokens_to_ids("<|image_pad|>"),
                "video_token_id": video_pad, "image_processor": settings.image.manifest(),
                "video_processor": {**settings.manifest(), "config": read_folder(folder).video}}
    return records, manifest


def test_qwen_videos_reach_the_megatron_bridge_batch(demo_dir, torchvision):
    """`visual_inputs` carries the reader's video tensors the way Qwen2.5-VL's forward takes them
    (`pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts` through `normalized_for_model()`), alone or beside
    images, also for several packs collated into one row; a batch without videos leaves those fields None."""
    from packtool.runtime.read import pack_to_batch

    records, manifest = qwen_video_records(demo_dir / "tokenizer")
    batches = [pack_to_batch({**dict(r.to_members()), "__key__": r.key}, manifest) for r in records]
    video_pad, merge = manifest["video_token_id"], 4
    for batch, record in zip(batches, records):
        mb = megatron_bridge_batch(batch)
        kwargs = mb["visual_inputs"].normalized_for_model()
        videos = [m for m in record.media_refs if m.kind == "video"]
        if not videos:
            assert set(kwargs) == {"pixel_values", "image_grid_thw"}
            continue
        assert {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} <= set(kwargs)
        assert kwargs["pixel_values_videos"] is batch["pixel_values_videos"]
        grid = kwargs["video_grid_thw"]
        assert grid.dtype == torch.int64 and grid.tolist() == [m.grid_thw for m in videos]
        assert kwargs["pixel_values_videos"].shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
        assert kwargs["second_per_grid_ts"].tolist() == pytest.approx([m.second_per_grid_ts for m in videos])
        assert int((mb["tokens"] == video_pad).sum()) == int(grid.prod(-1).sum()) // merge
        assert ("pixel_values" in kwargs) == any(m.kind == "image" for m in record.media_refs)
    both = megatron_bridge_batch(collate_packs(batches, 0))
    kwargs = both["visual_inputs"].normalized_for_model()
    assert torch.equal(kwargs["pixel_values_videos"], torch.cat([b["pixel_values_videos"] for b in batches]))
    assert kwargs["video_grid_thw"].tolist() == [m.grid_thw for r in records for m in r.media_refs
                                                 if m.kind == "video"]
    assert kwargs["image_grid_thw"].shape == (2, 3) and kwargs["second_per_grid_ts"].shape == (2,)
    assert int((both["tokens"] == video_pad).sum()) == int(kwargs["video_grid_thw"].prod(-1).sum()) // merge
    assert megatron_bridge_batch(batches[1])["visual_inputs"].pixel_values_videos is None
