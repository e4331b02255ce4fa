"""Hugging Face models train on packs: `hf_batch` rows give every target token the logits and loss of its segment
run alone (text model under sdpa; Qwen2.5-VL with images and videos), Trainer and TRL's SFTTrainer take a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import packfixture as fx
from packtool.runtime.hf import (
    HFPackCollator,
    HFPackDataset,
    check_model,
    concat_hf_batches,
    family_of_batch,
    hf_batch,
)
from packtool.runtime.read import IGNORE_INDEX, read_packs
from test_parity import text_segments, tiny_qwen, video_pack  # noqa: F401  (video_pack: a fixture)

LOGIT_TOL = 1e-4
LOSS_RTOL = 1e-5


def unshifted(tokens: list[int], targets: list[int]) -> torch.Tensor:
    return torch.tensor([[t if g else IGNORE_INDEX for t, g in zip(tokens, targets)]])


def tiny_text_model(attn: str = "sdpa"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=fx.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=fx.IM_START_ID, eos_token_id=fx.IM_END_ID, pad_token_id=fx.PAD_ID,
                         attn_implementation=attn)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def check_packed_equals_alone(model, row: dict, alone: list[tuple[dict, torch.Tensor]]):
    """`row`: the packed hf batch; `alone`: per segment, its own inputs and unshifted labels (in row order)."""
    cu = row["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        packed = model(**row)
        worst, total, count = 0.0, 0.0, 0
        for (inputs, labels), lo, hi in zip(alone, cu[:-1], cu[1:]):
            assert torch.equal(row["input_ids"][0, lo:hi], inputs["input_ids"][0])
            assert torch.equal(row["labels"][0, lo:hi], labels[0])
            out = model(**inputs, labels=labels, use_cache=False)
            targets = labels[0, 1:].ne(IGNORE_INDEX)
            worst = max(worst, (packed.logits[0, lo:hi - 1][targets] - out.logits[0, :-1][targets]).abs().max().item())
            n = int(targets.sum())
            total, count = total + out.loss.item() * n, count + n
    expected = total / count
    print(f"max |logit diff| {worst:.2e}; packed loss {packed.loss.item():.6f}, alone {expected:.6f}")
    assert worst <= LOGIT_TOL
    assert abs(packed.loss.item() - expected) <= LOSS_RTOL * expected
    return packed.loss.item()


def text_packs(tmp_path, n_packs=2):
    rng = np.random.default_rng(3)
    packs = [text_segments(rng, 3) for _ in range(n_packs)]
    fx.write_packs(tmp_path, {"train": packs}, pack_size=512, align=8)
    return packs


def test_text_model_packed_equals_alone(tmp_path):
    packs = text_packs(tmp_path)
    model = tiny_text_model("sdpa").eval()
    assert check_model(model).name == "none" and model.config.use_cache is False
    batches = list(read_packs(tmp_path))
    row = concat_hf_batches([hf_batch(b) for b in batches])
    assert row["position_ids"].shape == row["input_ids"].shape
    alone = [({"input_ids": torch.tensor([s["tokens"]])}, unshifted(s["tokens"], s["targets"]))
             for segs in packs for s in segs]
    check_packed_equals_alone(model, row, alone)
    # Control: Megatron-style (already shifted) labels fed as they are give another loss.
    first = batches[0]
    with torch.no_grad():
        good = model(**hf_batch(first)).loss
        bad = model(input_ids=first["tokens"], labels=first["labels"], position_ids=first["position_ids"]).loss
    assert abs(good.item() - bad.item()) > 1e-2


def test_check_model_refuses_and_turns_cache_off():
    model = tiny_text_model("sdpa")
    model.config.use_cache = True
    check_model(model)
    assert model.config.use_cache is False
    model.config._attn_implementation = "paged|sdpa"
    with pytest.raises(ValueError, match="packtool: error: attention implementation"):
        check_model(model)
    from transformers import LlavaConfig, WhisperConfig

    for kind in ("nemotron_omni", "processor", "fixed"):
        with pytest.raises(ValueError, match=f"packtool: error: packs made for image processor '{kind}'"):
            family_of_batch({}, {"image_processor": {"family": kind}})
    assert family_of_batch({}, {"image_processor": {"family": "qwen3_vl"}}).name == "qwen3_vl"  # it has a hook now
    for config in (LlavaConfig(), WhisperConfig()):
        with pytest.raises(ValueError, match=f"packtool: error: model type '{config.model_type}'"):
            check_model(type("M", (), {"config": config})())


def test_qwen25vl_images_and_videos_packed_equals_alone(video_pack):  # noqa: F811
    manifest, batch, vocab = video_pack
    image_id, video_id = manifest.image_token_id, manifest.video_token_id
    model = tiny_qwen(vocab, image_id, video_id, manifest.vision_start_token_id, manifest.vision_end_token_id)
    assert model.config.text_config.use_cache is True  # transformers' default, turned off by check_model
    assert check_model(model).name == "qwen2_vl" and model.config.text_config.use_cache is False
    tps = model.config.vision_config.tokens_per_second
    row = hf_batch(batch, manifest, tokens_per_second=tps)
    assert row["position_ids"].shape == (4, 1, row["input_ids"].shape[1])
    assert {"pixel_values", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} <= set(row)
    ids, cu = row["input_ids"], row["cu_seq_lens_q"].tolist()
    ip = [0] + row["image_grid_thw"].prod(-1).cumsum(0).tolist()
    vp = [0] + row["video_grid_thw"].prod(-1).cumsum(0).tolist()
    images = videos = 0
    alone = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        seg = ids[:, lo:hi]
        inputs = {"input_ids": seg, "mm_token_type_ids": row["mm_token_type_ids"][:, lo:hi]}
        spans = [t for i, t in enumerate(seg[0].tolist()) if t in (image_id, video_id)
                 and (i == 0 or seg[0, i - 1] != t)]
        ni, nv = spans.count(image_id), spans.count(video_id)
        if ni:
            inputs.update(pixel_values=row["pixel_values"][ip[images]:ip[images + ni]],
                          image_grid_thw=row["image_grid_thw"][images:images + ni])
        if nv:
            inputs.update(pixel_values_videos=row["pixel_values_videos"][vp[videos]:vp[videos + nv]],
                          video_grid_thw=row["video_grid_thw"][videos:videos + nv],
                          second_per_grid_ts=row["second_per_grid_ts"][videos:videos + nv])
        images, videos = images + ni, videos + nv
        alone.append((inputs, row["labels"][:, lo:hi].clone()))
    assert images == len(row["image_grid_thw"]) and videos == len(row["video_grid_thw"])
    assert sum(1 for a, _ in alone if "video_grid_thw" in a) >= 2
    loss = check_packed_equals_alone(model, row, alone)
    # Control: the reader's shifted labels fed as they are.
    with torch.no_grad():
        bad = model(**{**row, "labels": batch["labels"][:, ~batch["padding_mask"][0]]}).loss
    assert abs(bad.item() - loss) > 1e-2
    # Videos without tokens_per_second are refused in one line.
    with pytest.raises(ValueError, match="packtool: error: .*tokens_per_second"):
        hf_batch(batch, manifest)


def test_trainer_step_with_collator(tmp_path):
    from transformers import Trainer, TrainingArguments

    text_packs(tmp_path / "packs", n_packs=3)
    dataset = HFPackDataset(tmp_path / "packs")
    assert len(dataset) == 3
    model = tiny_text_model("sdpa")
    check_model(model)
    before = [p.detach().clone() for p in model.parameters()]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2,
                             remove_unused_columns=False, report_to=[], use_cpu=True, save_strategy="no",
                             learning_rate=1e-2, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=HFPackCollator())
    result = trainer.train()
    assert np.isfinite(result.training_loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_collator_loss_counts_target_tokens(tmp_path):
    """num_items_in_batch (targets of the global batch) normalises the summed loss per target token."""
    text_packs(tmp_path)
    dataset = HFPackDataset(tmp_path)
    row = HFPackCollator()([dataset[0], dataset[1]])
    model = tiny_text_model().eval()
    check_model(model)
    n = int(row["labels"].ne(IGNORE_INDEX).sum())
    with torch.no_grad():
        out = model(**row, num_items_in_batch=torch.tensor(2 * n))
        logits = out.logits[0, :-1]
        summed = F.cross_entropy(logits, row["labels"][0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")
    assert abs(out.loss.item() - summed.item() / (2 * n)) <= 1e-5 * out.loss.item()


def test_trl_sft_example_steps(tmp_path):
    """examples/trl_sft.py's trainer (TRL's SFTTrainer, its preparation and packing off) takes two steps."""
    pytest.importorskip("trl")
    from transformers import PreTrainedTokenizerFast

    import trl_sft

    text_packs(tmp_path / "packs", n_packs=3)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=fx.tokenizer(), pad_token="<|endoftext|>")
    model = tiny_text_model("sdpa")
    model.config.use_cache = True
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trl_sft.build_trainer(tmp_path / "packs", model, tokenizer, tmp_path / "run", max_steps=2,
                                    packs_per_step=2, learning_rate=1e-2, use_cpu=True)
    assert model.config.use_cache is False
    assert len(trainer.train_dataset) == 3 and trainer.train_dataset[0] == {"pack": 0}  # not re-prepared by TRL
    result = trainer.train()
    assert result.global_step == 2 and np.isfinite(result.training_loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
