"""The step weighs samples as the user chose: a ``loss_weight`` per sample in every source (and a factor per mixture
dataset), recorded per segment and in the ledger; reader batches carry ``loss_weights`` under a ``loss_mode``
(``token``, ``sample``, ``square``), and a global batch of packs trained with them has the gradient of the same
samples trained unpacked, one per row (a tiny random text model in float64; Megatron-Bridge's own loss in
``test_mbridge_loss.py``). Controls: the per-pack mean (what a trainer averaging per micro-batch computes) and the
other mode differ."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import lossgrad as lg
from mediafixture import write_source
from packtool.format import KEPT, Manifest, Segment
from packtool.lossweights import LOSS_MODES, sample_totals, token_scale
from packtool.packer.ledger import read_ledger
from packtool.packer.pipeline import pack
from packtool.packer.sources.files import resolve_source
from packtool.runtime.hf import check_model, concat_hf_batches, hf_batch, packed_lm_loss
from packtool.runtime.loader import collate_packs
from packtool.runtime.read import read_packs
from packtool.settings import EncodeSettings, PackSettings


def _settings(demo_dir: Path, pack_size: int = lg.PACK_SIZE) -> PackSettings:
    return PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=pack_size))


def _tree(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and ".packtool" not in p.parts}


@pytest.fixture(scope="module")
def weighted(demo_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("weighted")
    out = root / "out"
    pack(resolve_source(lg.write_conversations(root / "chats.jsonl")), out, _settings(demo_dir), workers=1,
         progress=False)
    return out


def _weight_of(key: str) -> float:
    return float(lg.WEIGHTS[int(key.split(":")[0])])


def test_weights_are_recorded_per_segment_and_in_the_ledger(weighted):
    ledger = read_ledger(weighted).to_pylist()
    assert [r["loss_weight"] for r in ledger] == [float(w) for w in lg.WEIGHTS]
    assert all(r["status"] in KEPT for r in ledger)  # weight 0 is allowed: packed, trains nothing
    sizes = []
    for batch in read_packs(weighted):
        sizes.append(len(batch["keys"]))
    assert len(sizes) >= 4 and min(sizes) <= 2 and max(sizes) >= 6  # packs of few and of many samples


def test_unweighted_output_keeps_its_bytes(demo_dir, tmp_path):
    """No weight given (or every weight 1): no loss_weight in the records and none in the ledger."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "ones").mkdir()
    plain = lg.write_conversations(tmp_path / "plain" / "chats.jsonl", weights=False)
    ones = tmp_path / "ones" / "chats.jsonl"
    ones.write_text("".join(json.dumps({**json.loads(line), "loss_weight": 1}) + "\n"
                            for line in plain.read_text().splitlines()))
    pack(resolve_source(plain), tmp_path / "a", _settings(demo_dir), workers=1, progress=False)
    pack(resolve_source(ones), tmp_path / "b", _settings(demo_dir), workers=1, progress=False)
    assert "loss_weight" not in read_ledger(tmp_path / "a").column_names
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    shards = [k for k in a if k.endswith(".tar")]
    assert shards and all(a[k] == b[k] for k in shards)
    batch = next(read_packs(tmp_path / "a"))
    assert torch.equal(batch["loss_weights"], batch["loss_mask"])  # token mode, no weights: the target mask


@pytest.mark.parametrize("value, reason", [(-1, "not a finite number >= 0"), ("2", "is not a number"),
                                           (True, "is not a number"), ([1], "is not a number")])
def test_a_bad_weight_is_that_samples_error(demo_dir, tmp_path, value, reason):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "loss_weight": value}) + "\n")
    pack(resolve_source(path), tmp_path / "out", _settings(demo_dir), workers=1, progress=False)
    rows = read_ledger(tmp_path / "out").to_pylist()
    assert rows[0]["status"] == "packed"
    assert rows[1]["status"] == "error" and reason in rows[1]["reason"] and "loss_weight" in rows[1]["reason"]


def test_nan_weight_in_a_parquet_column_and_weights_in_energon_json(demo_dir, tmp_path):
    msgs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a " * (i + 1)}] for i in range(3)]
    pq.write_table(pa.table({"messages": msgs, "loss_weight": [2.0, float("nan"), None]}), tmp_path / "t.parquet")
    pack(resolve_source(tmp_path / "t.parquet"), tmp_path / "pq", _settings(demo_dir), workers=1, progress=False)
    rows = read_ledger(tmp_path / "pq").to_pylist()
    assert [r["status"] for r in rows] == ["packed", "error", "packed"]
    assert rows[0]["loss_weight"] == 2.0 and rows[2]["loss_weight"] == 1.0 and "nan" in rows[1]["reason"]
    samples = {f"s{i}": {"json": json.dumps({"conversations": [{"from": "human", "value": f"q{i}"},
                                                                {"from": "gpt", "value": "yes " * (i + 1)}],
                                             "loss_weight": 0.5 * i}).encode()} for i in range(3)}
    source = write_source(tmp_path / "energon", samples)
    pack(source, tmp_path / "en", _settings(demo_dir), workers=1, progress=False)
    assert [r["loss_weight"] for r in read_ledger(tmp_path / "en").to_pylist()] == [0.0, 0.5, 1.0]


def test_a_mixture_dataset_factor_multiplies_its_samples_weights(demo_dir, tmp_path):
    samples = {f"s{i}": {"json": json.dumps({"conversations": [{"from": "human", "value": f"q{i}"},
                                                                {"from": "gpt", "value": "yes " * (i + 1)}],
                                             "loss_weight": 1.0 + i}).encode()} for i in range(2)}
    write_source(tmp_path / "a", samples)
    write_source(tmp_path / "b", {f"t{k}": v for k, v in samples.items()})
    mix = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": {"blend_epochized": [
        {"path": "a"}, {"path": "b", "packtool": {"loss_weight": 3}}]}}}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(mix))
    pack(tmp_path / "mix.yaml", tmp_path / "out", _settings(demo_dir), workers=1, progress=False)
    rows = read_ledger(tmp_path / "out").to_pylist()
    assert {(r["dataset"], r["key"]): r["loss_weight"] for r in rows} == {
        ("a", "s0"): 1.0, ("a", "s1"): 2.0, ("b", "ts0"): 3.0, ("b", "ts1"): 6.0}
    assert Manifest.read(tmp_path / "out").mixture["splits"]["train"][1]["loss_weight"] == 3.0
    mix["splits"]["train"]["blend_epochized"][1]["packtool"] = {"loss_weight": -1}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(mix))
    with pytest.raises(Exception, match="loss_weight must be a finite number >= 0"):
        pack(tmp_path / "bad.yaml", tmp_path / "bad", _settings(demo_dir), workers=1, progress=False)
    mix["splits"]["train"]["blend_epochized"][1]["packtool"] = {"loss_weight": 2, "lr": 1}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(mix))
    with pytest.raises(Exception, match="unknown packtool option 'lr'"):
        pack(tmp_path / "bad.yaml", tmp_path / "bad", _settings(demo_dir), workers=1, progress=False)


def test_segment_json_refuses_a_bad_weight():
    base = {"key": "k", "split": "train", "shard": "s", "truncated": False, "media": []}
    assert Segment.from_json({**base, "loss_weight": 2}).loss_weight == 2.0
    assert "loss_weight" not in Segment.from_json(base).to_json()
    for bad in (-1, "x", float("nan"), float("inf")):
        with pytest.raises(Exception, match="loss_weight"):
            Segment.from_json({**base, "loss_weight": bad})


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_each_samples_weights_sum_as_its_mode_says(weighted, mode):
    for batch in read_packs(weighted, loss_mode=mode):
        weights = batch["loss_weights"][0].double()
        assert torch.all(weights[batch["labels"][0] == -100] == 0)
        cu = batch["cu_seqlens_padded"].tolist()
        w = np.array([_weight_of(k) for k in batch["keys"]])
        n = np.array([int((batch["labels"][0, lo:hi] != -100).sum()) for lo, hi in zip(cu[:-1], cu[1:])])
        sums = np.array([float(weights[lo:hi].sum()) for lo, hi in zip(cu[:-1], cu[1:])])
        np.testing.assert_allclose(sums, sample_totals(w, n, mode), rtol=1e-6)
        assert batch["loss_weight_sum"].item() == pytest.approx(float(sample_totals(w, n, mode).sum()), rel=1e-12)
        assert batch["num_samples"].item() == len(w) and batch["loss_mode"] == mode
    assert token_scale(np.array([2.0]), np.array([0]), "sample").tolist() == [0.0]


def test_collate_keeps_the_weights_and_refuses_mixed_modes(weighted):
    a, b = list(read_packs(weighted, loss_mode="sample"))[:2]
    both = collate_packs([a, b], 0)
    assert both["loss_weights"].shape == both["tokens"].shape
    assert torch.equal(both["loss_weight_sum"], torch.cat([a["loss_weight_sum"], b["loss_weight_sum"]]))
    c = next(read_packs(weighted, loss_mode="token"))
    with pytest.raises(ValueError, match="different loss modes"):
        collate_packs([a, c], 0)
    with pytest.raises(ValueError, match="loss_mode must be one of"):
        next(read_packs(weighted, loss_mode="mean"))


def _global_batch(weighted, mode: str) -> list[list[list[dict]]]:
    """The packs as 2 data-parallel ranks x 2 or more micro-batches of one pack."""
    packs = list(read_packs(weighted, loss_mode=mode))
    assert len(packs) >= 4
    return [[[p] for p in packs[0::2]], [[p] for p in packs[1::2]]]


def _packed_hf_gradient(model, ranks, mode: str) -> torch.Tensor:
    """Each rank sums ``packed_lm_loss`` over its micro-batches; the step divides by the weights summed over every
    micro-batch of every rank (what the trainer all-reduces); ranks' gradients are summed."""
    rows = {id(b): hf_batch(b, loss_mode=mode) for rank in ranks for micro in rank for b in micro}
    total = sum(float(rows[id(b)]["loss_weight_sum"]) for rank in ranks for micro in rank for b in micro)
    grads = []
    for rank in ranks:
        loss = torch.zeros((), dtype=torch.float64)
        for micro in rank:
            row = concat_hf_batches([rows[id(b)] for b in micro])
            positions = row["position_ids"]  # a Qwen-VL output's [text; t; h; w] rows: a text model takes the first
            positions = positions[0] if positions.dim() == 3 else positions
            logits = model(input_ids=row["input_ids"], position_ids=positions).logits
            loss = loss + packed_lm_loss(logits, row["labels"], row["loss_weights"]) / total
        grads.append(lg.gradient(model, loss))
    return torch.stack(grads).sum(0)


def _per_pack_mean_gradient(model, ranks) -> torch.Tensor:
    """The control: each micro-batch's own per-token mean, averaged (a trainer normalizing per micro-batch)."""
    micros = [m for rank in ranks for m in rank]
    loss = torch.zeros((), dtype=torch.float64)
    for micro in micros:
        b = micro[0]
        losses = lg.shifted_token_losses(model, b["tokens"], b["position_ids"], b["labels"])
        loss = loss + (losses * b["loss_mask"]).sum() / b["loss_mask"].sum() / len(micros)
    return lg.gradient(model, loss)


def test_packed_gradient_equals_unpacked_under_every_mode(weighted, demo_dir):
    from transformers import AutoTokenizer

    model = lg.tiny_model(len(AutoTokenizer.from_pretrained(str(demo_dir / "tokenizer"))))
    found = {}
    for mode in LOSS_MODES:
        ranks = _global_batch(weighted, mode)
        packs = [b for rank in ranks for micro in rank for b in micro]
        weights = [_weight_of(k) for b in packs for k in b["keys"]]
        want = lg.gradient(model, lg.unpacked_loss(model, packs, weights, mode))
        got = _packed_hf_gradient(model, ranks, mode)
        found[mode] = (want, got)
        assert lg.relative(got, want) <= 1e-5, mode
    # Controls that must differ: the per-pack mean (against both), and token against sample.
    control = _per_pack_mean_gradient(model, _global_batch(weighted, "token"))
    assert lg.relative(control, found["sample"][0]) > 1e-2
    assert lg.relative(control, found["token"][0]) > 1e-2
    assert lg.relative(found["token"][0], found["sample"][0]) > 1e-2
    assert lg.relative(found["square"][0], found["sample"][0]) > 1e-3


def test_stats_shows_the_step_weights(weighted, demo_dir, tmp_path):
    """``stats`` gives the per-pack mean's spread against the per-sample weight (wide on packs of 1 to 8 samples
    of very different lengths), and per mixture dataset the shares of samples, targets and gradient weight."""
    from packtool.verify.stats import compute, format_report

    report = compute(weighted)
    sw = report["splits"]["train"]["step_weights"]
    assert sw["weighted"] and sw["datasets"] == []
    spread = sw["per_pack_mean"]
    assert spread["min"] < 0.5 < 2.0 < spread["max"]  # a control: equal per-pack weights would give 1, 1, 1
    assert "a per-pack mean weighs a sample" in format_report(report)
    # The spread recomputed from the reader's own batches: each pack weighs 1/packs, each of its targets its weight
    # over the pack's weight sum (a per-micro-batch mean with loss_mode token's weights as the mask).
    packs = list(read_packs(weighted, loss_mode="token"))
    w = np.array([_weight_of(k) for b in packs for k in b["keys"]])
    mean = np.concatenate([sample_totals(np.array([_weight_of(k) for k in b["keys"]]), _targets(b), "token")
                           / max(float(b["loss_weight_sum"].sum()), 1e-300) / len(packs) for b in packs])
    ratio = mean[w > 0] / (w[w > 0] / w.sum())
    assert spread["min"] == pytest.approx(ratio.min()) and spread["max"] == pytest.approx(ratio.max())
    assert spread["median"] == pytest.approx(np.median(ratio))

    # A mixture: per dataset shares that sum to 1; the dataset of factor 3 takes 3x its share of samples.
    def chats(prefix: str, words: int) -> dict:
        return {f"{prefix}{i}": {"json": json.dumps({"conversations": [
            {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "yes " * (words + i)}]}).encode()}
            for i in range(6)}

    write_source(tmp_path / "a", chats("a", 2))
    write_source(tmp_path / "b", chats("b", 40))
    mix = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": {"blend_epochized": [
        {"path": "a"}, {"path": "b", "packtool": {"loss_weight": 3}}]}}}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(mix))
    pack(tmp_path / "mix.yaml", tmp_path / "out", _settings(demo_dir), workers=1, progress=False)
    report = compute(tmp_path / "out")
    rows = {d["dataset"]: d for d in report["splits"]["train"]["step_weights"]["datasets"]}
    assert set(rows) == {"a", "b"}
    for key in ("samples", "targets", "token", "sample"):
        assert rows["a"][key] + rows["b"][key] == pytest.approx(1.0)
    assert rows["a"]["samples"] == pytest.approx(0.5) and rows["b"]["sample"] == pytest.approx(0.75)
    assert rows["b"]["targets"] > 0.8 and rows["b"]["token"] > rows["b"]["targets"]  # long replies, then x3
    assert "gradient share: token" in format_report(report)


def _targets(batch: dict) -> np.ndarray:
    cu = batch["cu_seqlens_padded"].tolist()
    return np.array([int((batch["labels"][0, lo:hi] != -100).sum()) for lo, hi in zip(cu[:-1], cu[1:])])


def _reference(weighted, demo_dir, mode: str) -> torch.Tensor:
    """The unpacked step on the samples of the output's first packs (one sample a row)."""
    from transformers import AutoTokenizer

    from hf_step import STEP_PACKS

    model = lg.tiny_model(len(AutoTokenizer.from_pretrained(str(demo_dir / "tokenizer"))))
    packs = list(read_packs(weighted, loss_mode=mode))[:STEP_PACKS]
    weights = [_weight_of(k) for b in packs for k in b["keys"]]
    return lg.gradient(model, lg.unpacked_loss(model, packs, weights, mode))


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_trainer_step_equals_unpacked(weighted, demo_dir, tmp_path, mode):
    """transformers' Trainer with PackedLossTrainer, 2 micro-batches of 2 packs accumulated: its applied gradient is
    the unpacked one. Control: the unpacked token step differs from the sample one."""
    from hf_step import step_gradient

    want = _reference(weighted, demo_dir, mode)
    got = step_gradient(weighted, demo_dir / "tokenizer", mode, accumulation=2, per_device=2, run_dir=tmp_path)
    assert lg.relative(got, want) <= 1e-5
    if mode == "sample":
        assert lg.relative(_reference(weighted, demo_dir, "token"), want) > 1e-2


def test_sft_trainer_step_equals_unpacked_and_refuses_rows_without_weights(weighted, demo_dir, tmp_path):
    """TRL's SFTTrainer with the mixin, the example's settings, 1 pack a micro-batch x 4 accumulated."""
    pytest.importorskip("trl")
    from hf_step import step_gradient

    got = step_gradient(weighted, demo_dir / "tokenizer", "sample", accumulation=4, per_device=1,
                        run_dir=tmp_path, sft=True)
    assert lg.relative(got, _reference(weighted, demo_dir, "sample")) <= 1e-5
    from packtool.runtime.hf import PackedLossTrainer

    class Bare(PackedLossTrainer):
        pass

    with pytest.raises(ValueError, match="carries no loss_weights"):
        Bare.compute_loss(Bare.__new__(Bare), None, hf_batch(next(read_packs(weighted)), None))


def test_two_processes_step_equals_unpacked(weighted, demo_dir, tmp_path):
    """2 processes (torch.distributed on CPU, gloo) x 2 accumulated micro-batches of one pack: the weight sum is
    gathered across processes and DDP's average undone, so each process applies the unpacked gradient."""
    import os
    import socket
    import subprocess
    import sys

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    script = Path(__file__).with_name("hf_step.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode in ("sample", "token"):
        out = tmp_path / mode
        out.mkdir()
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script),
                              str(weighted), str(demo_dir / "tokenizer"), mode, "2", str(out)],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        grads = [torch.load(out / f"grad{r}.pt") for r in (0, 1)]
        want = _reference(weighted, demo_dir, mode)
        assert torch.equal(grads[0], grads[1])
        assert lg.relative(grads[0], want) <= 1e-5, mode


@pytest.fixture(scope="module")
def weighted_images(tmp_path_factory):
    """Conversations with 0 to 2 images, replies of very different lengths and loss weights, packed for the demo
    Qwen2.5-VL folder into several packs: (output, weights by key, manifest, vocabulary size)."""
    from tokenizers import Tokenizer

    import demo
    import mediafixture as mf
    from packtool.format import load_manifest
    from test_media_pack import chat

    root = tmp_path_factory.mktemp("weighted-images")
    folder = demo.build_tokenizer(root / "model")
    samples, weights = {}, {}
    for i, (n_images, words, w) in enumerate([(1, 3, 1.0), (2, 60, 2.5), (0, 1, 0.5), (1, 25, 3.0), (0, 40, 1.0),
                                              (2, 2, 0.0), (1, 12, 1.5), (0, 80, 1.0), (1, 5, 4.0)]):
        key = f"s{i}"
        user = "<image>\n" * n_images + f"question {i}"
        samples[key] = {"json": chat(user, reply=" ".join(["yes"] * words), loss_weight=w)}
        samples[key].update({f"{j}.png": mf.make_image(56 + 28 * j, 56, seed=i * 3 + j) for j in range(n_images)})
        weights[key] = w
    write_source(root / "src", samples)
    pack(root / "src", root / "out", PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=256)), workers=1,
         progress=False)
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    return root / "out", weights, load_manifest(root / "out"), vocab


def test_qwen25vl_gradient_equals_unpacked_under_every_mode(weighted_images):
    """A tiny random Qwen2.5-VL in float64 (vision tower included): the packed step over every pack of the output
    (each pack a micro-batch, ``packed_lm_loss`` over the weights' global sum) has the gradient of the same samples
    run alone with their own images under each loss mode. Control: the per-pack mean differs."""
    from packtool.runtime.hf import WEIGHT_KEYS
    from test_hf import qwen_segments_alone
    from test_parity import tiny_qwen

    out, weights, manifest, vocab = weighted_images
    model = tiny_qwen(vocab, manifest.image_token_id, manifest.video_token_id, manifest.vision_start_token_id,
                      manifest.vision_end_token_id).double()
    check_model(model)  # the cache off: with it, packed segments attend across each other
    found = {}
    for mode in LOSS_MODES:
        rows = [hf_batch(b, loss_mode=mode) for b in read_packs(out, loss_mode=mode)]
        assert len(rows) >= 3 and any("pixel_values" in r for r in rows)
        total = sum(float(r["loss_weight_sum"].sum()) for r in rows)
        packed = torch.zeros((), dtype=torch.float64)
        num, den, seen = torch.zeros((), dtype=torch.float64), 0.0, []
        per_pack = torch.zeros((), dtype=torch.float64)
        for b, r in zip(read_packs(out, loss_mode=mode), rows):
            inputs = {k: (v.double() if k.startswith("pixel_values") else v) for k, v in r.items()
                      if k not in ("labels", "keys", "pack_key", *WEIGHT_KEYS) and isinstance(v, torch.Tensor)}
            logits = model(**inputs).logits
            packed = packed + packed_lm_loss(logits, r["labels"], r["loss_weights"]) / total
            per_pack = per_pack + packed_lm_loss(logits, r["labels"], (r["labels"] != -100).double()) \
                / (r["labels"][:, 1:] != -100).sum() / len(rows)
            alone = qwen_segments_alone(r, manifest.image_token_id, manifest.video_token_id)
            assert len(alone) == len(b["keys"])
            for (seg, labels), key in zip(alone, b["keys"]):
                seen.append(key)
                seg = {k: (v.double() if k.startswith("pixel_values") else v) for k, v in seg.items()}
                seg_logits = model(**seg).logits[0, :-1]
                target = labels[0, 1:]
                n = int((target != -100).sum())
                if n == 0:
                    continue
                losses = torch.nn.functional.cross_entropy(seg_logits, target, ignore_index=-100, reduction="sum")
                w = weights[key]
                scale = {"token": w, "sample": w / n, "square": w / np.sqrt(n)}[mode]
                num, den = num + scale * losses, den + scale * n
        assert sorted(seen) == sorted(weights)
        want = lg.gradient(model, num / den, retain=True)
        got = lg.gradient(model, packed, retain=mode == "token")
        print(mode, lg.relative(got, want))
        assert lg.relative(got, want) <= 1e-5, mode
        found[mode] = want
        if mode == "token":
            control = lg.relative(lg.gradient(model, per_pack), found["token"])
            print("control: per-pack mean against token", control)
            assert control > 1e-2
    assert lg.relative(found["token"], found["sample"]) > 1e-2
