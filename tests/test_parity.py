"""Packed training equals unpacked: tiny random models (fp32, CPU), packed row from the reader vs each segment alone.

The packed forward uses only what the reader gives (tokens, position_ids, cu_seqlens_padded, pixel_values,
image_grid_thw) plus `mrope_position_ids`; the alone runs use the raw segment tokens and the model's own defaults.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import packfixture as fx
from packtool.read import IGNORE_INDEX, mrope_position_ids, read_packs

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


@pytest.fixture(scope="module")
def qwen():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=fx.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=fx.IM_START_ID, eos_token_id=fx.IM_END_ID,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=fx.IMAGE_PAD_ID, video_token_id=fx.VOCAB_SIZE - 20,
        vision_start_token_id=fx.VISION_START_ID, vision_end_token_id=fx.VISION_END_ID)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


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
    from packtool.read import mrope_position_ids

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
