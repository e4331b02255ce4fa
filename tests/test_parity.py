"""Packed training equals unpacked: tiny random models (fp32, CPU), packed row from the reader vs each segment alone.

The packed forward uses only what the reader gives (tokens, position_ids, cu_seqlens_padded, pixel_values,
image_grid_thw, pixel_values_videos, video_grid_thw, second_per_grid_ts) plus `mrope_position_ids`; the alone runs
use the raw segment tokens (for the video row, which `pack` encodes, each segment's tokens cut from the row) and the
model's own defaults.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import packfixture as fx
from packtool.families.qwen2_vl.reader import mrope_position_ids
from packtool.runtime.read import IGNORE_INDEX, read_packs

TOL = 1e-5


def block_causal_mask(cu_seqlens_padded: torch.Tensor, length: int) -> torch.Tensor:
    """Float additive mask [1, 1, L, L]: token i sees token j iff j <= i within the same padded segment."""
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens_padded) - 1), cu_seqlens_padded.diff().long())
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    return torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def alone_labels(tokens: list[int], targets: list[int]) -> torch.Tensor:
    return torch.tensor([tokens[i + 1] if targets[i + 1] else IGNORE_INDEX for i in range(len(tokens) - 1)]
                        + [IGNORE_INDEX])


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                           ignore_index=IGNORE_INDEX)


def compare(packed_logits, batch, segments, alone_logits_fn):
    """Max |packed - alone| over logits and per-token loss of every real token."""
    packed_loss = token_loss(packed_logits, batch["labels"])
    worst, starts = 0.0, batch["cu_seqlens_padded"][:-1].tolist()
    for i, (seg, start) in enumerate(zip(segments, starts)):
        n = len(seg["tokens"])
        logits = alone_logits_fn(i, seg)
        loss = token_loss(logits, alone_labels(seg["tokens"], seg["targets"]))
        assert loss.gt(0).sum() == sum(seg["targets"][1:])
        worst = max(worst, (packed_logits[0, start:start + n] - logits[0]).abs().max().item(),
                    (packed_loss[start:start + n] - loss).abs().max().item())
    print(f"max |packed - alone| = {worst:.2e}")
    return worst


def text_segments(rng, n):
    segs = []
    for i in range(n):
        q = "".join(rng.choice(list("abcdefgh xyz"), size=int(rng.integers(3, 30))))
        a = "".join(rng.choice(list("0123456789 ."), size=int(rng.integers(1, 20))))
        segs.append(fx.chat_segment(f"t{i}", q, a))
    return segs


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=fx.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=fx.IM_START_ID, eos_token_id=fx.IM_END_ID, pad_token_id=fx.PAD_ID,
                         attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("align,pad_to", [(1, "pack"), (8, "pack"), (8, "segments")])
def test_llama_packed_equals_alone(tmp_path, llama, align, pad_to):
    segments = text_segments(np.random.default_rng(align), 4)
    fx.write_packs(tmp_path, {"train": [segments]}, pack_size=512, align=align)
    batch = next(read_packs(tmp_path, pad_to=pad_to))
    length = batch["tokens"].shape[1]
    with torch.no_grad():
        packed = llama(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=block_causal_mask(batch["cu_seqlens_padded"], length)).logits

        def alone(_, seg):
            return llama(input_ids=torch.tensor([seg["tokens"]])).logits

        assert compare(packed, batch, segments, alone) <= TOL


def test_llama_packed_gradients_equal_alone(tmp_path, llama):
    """Training step: the summed target loss of the packed row has the gradients of the segments run alone."""
    segments = text_segments(np.random.default_rng(7), 3)
    fx.write_packs(tmp_path, {"train": [segments]}, pack_size=256, align=8)
    batch = next(read_packs(tmp_path))
    mask = block_causal_mask(batch["cu_seqlens_padded"], batch["tokens"].shape[1])
    logits = llama(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=mask).logits
    token_loss(logits, batch["labels"]).sum().backward()
    packed = [p.grad.clone() for p in llama.parameters()]
    llama.zero_grad()
    for seg in segments:
        logits = llama(input_ids=torch.tensor([seg["tokens"]])).logits
        token_loss(logits, alone_labels(seg["tokens"], seg["targets"])).sum().backward()
    worst = max((a - p.grad).abs().max().item() for a, p in zip(packed, llama.parameters()))
    llama.zero_grad()
    assert worst <= TOL


def tiny_qwen(vocab_size: int, image_token_id: int, video_token_id: int, vision_start_token_id: int,
              vision_end_token_id: int):
    """A tiny random Qwen2.5-VL (fp32, eager attention, seed 0) over the given vocabulary and media tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=fx.IM_START_ID, eos_token_id=fx.IM_END_ID,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=image_token_id, video_token_id=video_token_id,
        vision_start_token_id=vision_start_token_id, vision_end_token_id=vision_end_token_id)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen(fx.VOCAB_SIZE, fx.IMAGE_PAD_ID, fx.VOCAB_SIZE - 20, fx.VISION_START_ID, fx.VISION_END_ID)


def image_segments():
    img = [(fx.image_bytes(w, h, seed, fmt), ext) for w, h, seed, fmt, ext in
           [(60, 90, 1, "JPEG", "jpg"), (112, 56, 2, "PNG", "png"), (70, 70, 3, "JPEG", "jpg")]]
    return [fx.chat_segment("v0", "what is it?", "a cat.", [img[0]]),
            fx.chat_segment("t1", "hello", "hi there"),
            fx.chat_segment("v2", "compare", "same", [img[1], img[2]])]


def qwen_inputs(batch):
    return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"], "use_cache": False}


@pytest.mark.parametrize("align", [1, 8])
def test_qwen25vl_packed_equals_alone(tmp_path, qwen, align):
    segments = image_segments()
    fx.write_packs(tmp_path, {"train": [segments]}, pack_size=256, align=align, image_processor=fx.QWEN_PROCESSOR)
    batch = next(read_packs(tmp_path))
    rope = mrope_position_ids(batch["tokens"], batch["cu_seqlens_padded"], batch["image_grid_thw"],
                              image_token_id=fx.IMAGE_PAD_ID, spatial_merge_size=2)
    patches = batch["image_grid_thw"].prod(-1).tolist()
    first_image = np.cumsum([0] + [len(s["media"]) for s in segments]).tolist()

    def segment_inputs(i, seg):
        ids = torch.tensor([seg["tokens"]])
        lo, hi = first_image[i], first_image[i + 1]
        if lo == hi:
            return {"input_ids": ids}
        pv = batch["pixel_values"][sum(patches[:lo]):sum(patches[:hi])]
        return {"input_ids": ids, "pixel_values": pv, "image_grid_thw": batch["image_grid_thw"][lo:hi],
                "mm_token_type_ids": (ids == fx.IMAGE_PAD_ID).int()}

    # The helper's positions equal the model's own 3-D positions of each segment alone.
    for i, (seg, start) in enumerate(zip(segments, batch["cu_seqlens_padded"][:-1].tolist())):
        inputs = segment_inputs(i, seg)
        if "image_grid_thw" in inputs:
            own, _ = qwen.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               image_grid_thw=inputs["image_grid_thw"])
        else:
            own = torch.arange(len(seg["tokens"])).expand(3, 1, -1)
        assert torch.equal(rope[:, :, start:start + len(seg["tokens"])], own)

    with torch.no_grad():
        def alone(i, seg):
            return qwen(**segment_inputs(i, seg), use_cache=False).logits

        # (a) [4, 1, L] positions, no mask: the model builds the packed mask from row 0.
        packed = qwen(input_ids=batch["tokens"], position_ids=torch.cat([batch["position_ids"][None], rope]),
                      attention_mask=None, **qwen_inputs(batch)).logits
        assert compare(packed, batch, segments, alone) <= TOL
        # (b) [3, 1, L] positions with an explicit float block-diagonal mask.
        mask = block_causal_mask(batch["cu_seqlens_padded"], batch["tokens"].shape[1])
        packed = qwen(input_ids=batch["tokens"], position_ids=rope, attention_mask=mask, **qwen_inputs(batch)).logits
        assert compare(packed, batch, segments, alone) <= TOL


def test_qwen25vl_without_packed_positions_leaks(tmp_path, qwen):
    """Control: the same row with plain 3-D positions and no mask is NOT equal (segments attend across)."""
    segments = image_segments()
    fx.write_packs(tmp_path, {"train": [segments]}, pack_size=256, image_processor=fx.QWEN_PROCESSOR)
    batch = next(read_packs(tmp_path))
    rope = mrope_position_ids(batch["tokens"], batch["cu_seqlens_padded"], batch["image_grid_thw"],
                              image_token_id=fx.IMAGE_PAD_ID)
    with torch.no_grad():
        leaky = qwen(input_ids=batch["tokens"], position_ids=rope, **qwen_inputs(batch)).logits
        clean = qwen(input_ids=batch["tokens"], position_ids=torch.cat([batch["position_ids"][None], rope]),
                     **qwen_inputs(batch)).logits
    second = slice(int(batch["cu_seqlens_unpadded"][1]) + 1, int(batch["cu_seqlens_unpadded"][2]))
    assert (leaky[0, second] - clean[0, second]).abs().max() > 1e-3


def test_mrope_positions_of_videos_equal_get_rope_index(qwen):
    """Two segments with videos (and an image) in one row: the positions restart per segment and equal the model's
    own get_rope_index on each segment alone."""
    from packtool.families.qwen2_vl.reader import mrope_position_ids

    video = qwen.config.video_token_id

    def segment(media):  # media: list of (token, grid)
        ids, types = [5, 6, 7], [0, 0, 0]
        for token, (t, h, w) in media:
            n = t * h * w // 4
            ids += [fx.VISION_START_ID] + [token] * n + [fx.VISION_END_ID] + [8, 9]
            types += [0] + [2 if token == video else 1] * n + [0, 0, 0]
        return ids, types

    segs = [([(video, (3, 4, 6)), (fx.IMAGE_PAD_ID, (1, 6, 4))], [0.7]),
            ([(video, (5, 8, 4))], [1.3])]
    rows, expected, images, videos, seconds = [], [], [], [], []
    for media, spgt in segs:
        ids, types = segment(media)
        img = [g for tok, g in media if tok != video]
        vid = [g for tok, g in media if tok == video]
        pos, _ = qwen.model.get_rope_index(
            torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
            image_grid_thw=torch.tensor(img) if img else None, video_grid_thw=torch.tensor(vid),
            second_per_grid_ts=torch.tensor(spgt))
        rows += ids
        expected.append(pos[:, 0])
        images += img
        videos += vid
        seconds += spgt
    cu = torch.tensor([0, len(segment(segs[0][0])[0]), len(rows)])
    got = mrope_position_ids(torch.tensor([rows]), cu, torch.tensor(images), image_token_id=fx.IMAGE_PAD_ID,
                             video_grid_thw=torch.tensor(videos), second_per_grid_ts=torch.tensor(seconds),
                             video_token_id=video, tokens_per_second=qwen.config.vision_config.tokens_per_second)
    assert torch.equal(got[:, 0], torch.cat(expected, dim=1))



# -- Qwen2.5-VL with videos: a row packed by the pipeline from real encoded videos --------------------------------
#: key -> (user turn, videos as (ext, width, height, frames, fps), images as (width, height)); one pack of four.
VIDEO_SAMPLES = {
    "v0": ("<video>What happens?", [("mp4", 64, 48, 6, 4)], []),
    "t1": ("Just text here.", [], []),
    "vi2": ("<image><video>Same?", [("mov", 72, 40, 10, 5)], [(50, 70)]),
    "vv3": ("<video> then <video>?", [("mkv", 57, 41, 9, 8), ("avi", 60, 60, 4, 2)], []),
}


@pytest.fixture(scope="module")
def video_pack(tmp_path_factory, torchvision):
    """One pack of VIDEO_SAMPLES written by ``pack`` (demo model folder, real encoded videos), read back with
    pixel_values_videos; with the manifest and the tokenizer's vocabulary size."""
    pytest.importorskip("av", reason="video decoding needs PyAV")
    from tokenizers import Tokenizer

    import demo
    from packtool.format import load_manifest
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings
    from test_media_pack import chat, qwen_sample, write_source

    root = tmp_path_factory.mktemp("video-parity")
    folder = demo.build_tokenizer(root / "model")
    samples = {}
    for key, (user, videos, images) in VIDEO_SAMPLES.items():
        samples[key] = qwen_sample(user, videos, images, [])
        samples[key]["json"] = chat(user, reply=f"The answer to {key} is short.")
    write_source(root / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=1024), PlanSettings(shard_size="4"))
    pack(root / "src", root / "out", settings, workers=1, progress=False)
    batches = list(read_packs(root / "out"))
    assert len(batches) == 1 and sorted(batches[0]["keys"]) == sorted(VIDEO_SAMPLES), [b["keys"] for b in batches]
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    return load_manifest(root / "out"), batches[0], vocab


def media_of_segments(tokens: torch.Tensor, cu: list[int], media_ids: list[int]) -> list[list[int]]:
    """Per segment, the placeholder token of each of its media spans, in order."""
    out = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        seg = tokens[lo:hi].tolist()
        out.append([t for i, t in enumerate(seg) if t in media_ids and (i == 0 or seg[i - 1] != t)])
    return out


def test_qwen25vl_video_packed_equals_alone(video_pack):
    """Videos (in three segments: one alone, one with an image, two in one) and a text segment in one packed row: the
    packed forward with the reader's tensors and `mrope_position_ids` gives every real token the logits and loss of
    its segment run alone. Controls: the same row with positions that let segments see each other, or with the
    videos' time offsets dropped, is not equal."""
    manifest, batch, vocab = video_pack
    image_id, video_id = manifest.image_token_id, manifest.video_token_id
    model = tiny_qwen(vocab, image_id, video_id, manifest.vision_start_token_id, manifest.vision_end_token_id)
    tps = model.config.vision_config.tokens_per_second
    tokens, cu = batch["tokens"], batch["cu_seqlens_unpadded"].tolist()
    kinds = media_of_segments(tokens[0], cu, [image_id, video_id])
    assert sum(video_id in k for k in kinds) >= 2 and sum(image_id in k for k in kinds) >= 1, kinds
    assert batch["video_grid_thw"][:, 0].gt(1).all()  # several temporal patches: time offsets matter

    def rope(tokens_per_second=tps):
        return mrope_position_ids(tokens, batch["cu_seqlens_padded"], batch["image_grid_thw"],
                                  image_token_id=image_id, video_grid_thw=batch["video_grid_thw"],
                                  second_per_grid_ts=batch["second_per_grid_ts"], video_token_id=video_id,
                                  tokens_per_second=tokens_per_second)

    # Each segment alone: its tokens, its slice of the images' and videos' patches, grids and seconds.
    image_patches = [0] + batch["image_grid_thw"].prod(-1).cumsum(0).tolist()
    video_patches = [0] + batch["video_grid_thw"].prod(-1).cumsum(0).tolist()
    first_image = np.cumsum([0] + [k.count(image_id) for k in kinds]).tolist()
    first_video = np.cumsum([0] + [k.count(video_id) for k in kinds]).tolist()
    segments = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        labels = batch["labels"][0, lo:hi - 1]
        targets = [0] + labels.ne(IGNORE_INDEX).int().tolist()
        segments.append({"tokens": tokens[0, lo:hi].tolist(), "targets": targets})
        assert sum(segments[-1]["targets"]) > 0

    def segment_inputs(i, seg):
        ids = torch.tensor([seg["tokens"]])
        inputs = {"input_ids": ids, "mm_token_type_ids": (ids == image_id).int() + 2 * (ids == video_id).int()}
        a, b = first_image[i], first_image[i + 1]
        if a < b:
            inputs.update(pixel_values=batch["pixel_values"][image_patches[a]:image_patches[b]],
                          image_grid_thw=batch["image_grid_thw"][a:b])
        a, b = first_video[i], first_video[i + 1]
        if a < b:
            inputs.update(pixel_values_videos=batch["pixel_values_videos"][video_patches[a]:video_patches[b]],
                          video_grid_thw=batch["video_grid_thw"][a:b],
                          second_per_grid_ts=batch["second_per_grid_ts"][a:b])
        return inputs

    # The helper's positions equal the model's own 3-D positions of each segment alone.
    positions = rope()
    for i, (seg, start) in enumerate(zip(segments, batch["cu_seqlens_padded"][:-1].tolist())):
        inputs = segment_inputs(i, seg)
        own, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                            image_grid_thw=inputs.get("image_grid_thw"),
                                            video_grid_thw=inputs.get("video_grid_thw"),
                                            second_per_grid_ts=inputs.get("second_per_grid_ts"))
        assert torch.equal(positions[:, :, start:start + len(seg["tokens"])], own), i

    media = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                   "second_per_grid_ts")}
    with torch.no_grad():
        alone = {i: model(**segment_inputs(i, seg), use_cache=False).logits for i, seg in enumerate(segments)}

        def packed_diff(position_ids, mask=None):
            logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=mask, use_cache=False,
                           **media).logits
            return compare(logits, batch, segments, lambda i, _: alone[i])

        text_positions = batch["position_ids"][None]
        # (a) [4, 1, L] positions, no mask: the model builds the packed mask from row 0.
        assert packed_diff(torch.cat([text_positions, positions])) <= TOL
        # (b) [3, 1, L] positions with an explicit float block-diagonal mask.
        assert packed_diff(positions, block_causal_mask(batch["cu_seqlens_padded"], tokens.shape[1])) <= TOL
        # Controls: no segment boundaries (segments attend across); videos without time offsets (as images have).
        assert packed_diff(positions) > 1e-3
        assert packed_diff(torch.cat([text_positions, rope(tokens_per_second=0)])) > 1e-3
