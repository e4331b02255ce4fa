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


def qwen_segments_alone(row: dict, image_id: int, video_id: int) -> list[tuple[dict, torch.Tensor]]:
    """Each segment of a Qwen2-VL ``hf_batch`` row alone: its own inputs (tokens, token types, its media's pixels
    and grids; the model computes its positions) and its unshifted labels, in row order."""
    ids, cu = row["input_ids"], row["cu_seq_lens_q"].tolist()
    grids = {kind: row.get(f"{kind}_grid_thw", torch.zeros((0, 3), dtype=torch.long)) for kind in ("image", "video")}
    ip = [0] + grids["image"].prod(-1).cumsum(0).tolist()
    vp = [0] + grids["video"].prod(-1).cumsum(0).tolist()
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
    assert images == len(grids["image"]) and videos == len(grids["video"])
    return alone


def test_qwen25vl_images_and_videos_packed_equals_alone(video_pack):  # noqa: F811
    manifest, batch, vocab = video_pack
    image_id, video_id = manifest.image_token_id, manifest.video_token_id
    model = tiny_qwen(vocab, image_id, video_id, manifest.vision_start_token_id, manifest.vision_end_token_id)
    assert model.config.text_config.use_cache is True  # transformers' default, turned off by check_model
    assert check_model(model).name == "qwen2_vl" and model.config.text_config.use_cache is False
    tps = model.config.vision_config.tokens_per_second
    row = hf_batch(batch, manifest, tokens_per_second=tps)
    assert row["position_ids"].shape == (4, 1, row["input_ids"].shape[1])
    # The reader batch alone is enough: it carries its family and the token ids its layout needs.
    alone_row = hf_batch(batch, tokens_per_second=tps)
    assert set(alone_row) == set(row) and all(torch.equal(alone_row[k], row[k]) for k in row
                                              if isinstance(row[k], torch.Tensor))
    stripped = {k: v for k, v in batch.items() if k != "layout_context"}  # control: an older reader's batch
    with pytest.raises(ValueError, match="carries no layout context"):
        hf_batch(stripped, tokens_per_second=tps)
    assert {"pixel_values", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} <= set(row)
    alone = qwen_segments_alone(row, image_id, video_id)
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


@pytest.mark.parametrize("loss_mode", [None, "sample"])
def test_trl_sft_example_steps(tmp_path, loss_mode):
    """examples/trl_sft.py's trainer (TRL's SFTTrainer, its preparation and packing off) takes two steps; with a
    loss mode, as SFTTrainer with PackedLossTrainer (its step's gradient: tests/test_loss_weights.py)."""
    pytest.importorskip("trl")
    from transformers import PreTrainedTokenizerFast

    import trl_sft

    text_packs(tmp_path / "packs", n_packs=3)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=fx.tokenizer(), pad_token="<|endoftext|>")
    model = tiny_text_model("sdpa")
    model.config.use_cache = True
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trl_sft.build_trainer(tmp_path / "packs", model, tokenizer, tmp_path / "run", max_steps=2,
                                    packs_per_step=2, learning_rate=1e-2, use_cpu=True, loss_mode=loss_mode)
    from packtool.runtime.hf import PackedLossTrainer

    assert isinstance(trainer, PackedLossTrainer) == (loss_mode is not None)
    assert model.config.use_cache is False
    assert len(trainer.train_dataset) == 3 and trainer.train_dataset[0] == {"pack": 0}  # not re-prepared by TRL
    result = trainer.train()
    assert result.global_step == 2 and np.isfinite(result.training_loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_packs_and_model_that_do_not_belong_together_are_refused(tmp_path):
    """Text packs against a Qwen2.5-VL or Qwen3-VL model folder, through ``HFPackDataset(model_folder=...)`` and
    ``check_model(model, packs)``: one line naming both; a batch given another family's manifest is refused too.
    Controls: a text model, and the batch with its own manifest, pass."""
    import json

    from packtool.format import load_manifest

    text_packs(tmp_path / "packs")
    for model_type in ("qwen2_5_vl", "qwen3_vl"):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type, "vision_config": {}}))
        with pytest.raises(ValueError, match=rf"packtool: error: the packs at .*packs were made for a text-only "
                                             rf"model, the model at .*{model_type} is '{model_type}'"):
            HFPackDataset(tmp_path / "packs", model_folder=folder)
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    dataset = HFPackDataset(tmp_path / "packs", model_folder=text)
    model = tiny_text_model("sdpa")
    assert check_model(model, dataset).name == "none"
    vl = type("M", (), {"config": type("C", (), {"model_type": "qwen2_5_vl", "vision_config": {}})()})()
    with pytest.raises(ValueError, match="made for a text-only model, the model is 'qwen2_5_vl'"):
        check_model(vl, dataset)
    batch = next(iter(read_packs(tmp_path / "packs")))
    manifest = load_manifest(tmp_path / "packs")
    assert hf_batch(batch, manifest)["input_ids"].shape[0] == 1
    other = {**dict(manifest), "image_processor": {"type": "qwen2_vl"}, "image_token_id": 7}
    with pytest.raises(ValueError, match="the batch is of family none, the manifest given was written for qwen2_vl"):
        hf_batch(batch, other)


def test_trl_example_runs_on_cpu_from_the_demo(packed, demo_dir, tmp_path, capsys):
    """The README's command: the demo's packs (images and videos) and the tiny random Qwen2.5-VL that
    ``examples/tiny_model.py`` writes from the demo's tokenizer folder; TRL's SFTTrainer takes a step on CPU and
    the model's weights move. The tiny model's media token ids are the packs' (the pairing check passes)."""
    pytest.importorskip("trl")
    import tiny_model
    import trl_sft

    model = tiny_model.build(demo_dir / "tokenizer", tmp_path / "model")
    from safetensors.torch import load_file

    before = load_file(model / "model.safetensors")
    trainer = trl_sft.main([str(packed), str(model), str(tmp_path / "run"), "--max-steps", "1", "--cpu"])
    assert "1 steps, training loss" in capsys.readouterr().out
    after = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
    moved = [k for k, v in before.items() if k in after and not torch.equal(v, after[k])]
    assert moved
