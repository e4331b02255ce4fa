"""NeMo-RL's SFT step on weighted packs: the encoder's ``token_mask`` carries the loss mode's weights, and NeMo-RL's
token-level ``NLLLoss`` (``-Σ logprob · token_mask · sample_mask / global_valid_toks``, with ``global_valid_toks`` the
sum of ``token_mask[:, 1:] · sample_mask`` over the global batch, all-reduced over data-parallel ranks, as its policy
workers compute it) then gives the gradient of the same samples trained unpacked under every mode.

NeMo-RL does not install from the package registry: CI runs a stand-in of that loss (:func:`stand_in_nll_loss`,
its formula). With ``PACKTOOL_NEMO_RL_SRC`` naming a folder that holds NeMo-RL's ``nemo_rl`` package, the test runs
NeMo-RL's own ``NLLLossFn`` (``nemo_rl/algorithms/loss/loss_functions.py``; ``NLLLoss`` of
``nemo_rl/algorithms/loss_functions.py`` in earlier versions) and ``masked_mean`` (``nemo_rl/algorithms/utils.py``):
their code, taken out of their modules (whose other imports need a GPU stack) and run as written."""

from __future__ import annotations

import ast
import enum
import os
import typing
from pathlib import Path

import pytest
import torch

import lossgrad as lg
from packtool.lossweights import LOSS_MODES
from packtool.packer.pipeline import pack
from packtool.packer.sources.files import resolve_source
from packtool.runtime.read import read_packs
from packtool.settings import EncodeSettings, PackSettings
from test_nemo_rl import nemo_rl_loader


@pytest.fixture(scope="module")
def weighted(demo_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nemo_rl_weighted")
    out = root / "out"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=lg.PACK_SIZE, align=8))
    pack(resolve_source(lg.write_conversations(root / "chats.jsonl")), out, settings, workers=1, progress=False)
    return out


def stand_in_nll_loss(logprobs: torch.Tensor, data: dict, global_valid_toks: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's token-level NLL loss of one micro-batch: the next tokens' log-probabilities ``[B, L - 1]``, times
    ``token_mask[:, 1:] · sample_mask``, summed and divided by the global batch's count."""
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    return -(logprobs * mask).sum() / (global_valid_toks + 1e-8)


def nemo_rls_own_loss():
    """NeMo-RL's own NLL loss and ``masked_mean`` from ``PACKTOOL_NEMO_RL_SRC``, as a function of (logprobs, data,
    global_valid_toks); None without the variable."""
    src = os.environ.get("PACKTOOL_NEMO_RL_SRC")
    if not src:
        return None
    root = Path(src)
    namespace: dict = {"torch": torch, "Tensor": torch.Tensor, "Any": typing.Any, "Optional": typing.Optional,
                       "BatchedDataDict": dict, "__name__": "nemo_rl_loss_code"}

    class LossType(enum.Enum):
        TOKEN_LEVEL = "token_level"
        SEQUENCE_LEVEL = "sequence_level"

    class LossInputType(enum.Enum):
        LOGIT = "logit"
        LOGPROB = "logprob"

    class MetricNormalizer(enum.Enum):
        TOKENS = "tokens"
        SEQUENCES = "sequences"
        NONE = "none"

    namespace.update(LossFunction=object, LossType=LossType, LossInputType=LossInputType,
                     MetricNormalizer=MetricNormalizer)
    _exec_definitions(root / "nemo_rl/algorithms/utils.py", ["masked_mean"], namespace)
    new = root / "nemo_rl/algorithms/loss/loss_functions.py"
    if new.is_file():
        _exec_definitions(new, ["NLLLossFn"], namespace)
        loss_fn = namespace["NLLLossFn"]()
        assert loss_fn.loss_type.name == "TOKEN_LEVEL"

        def own(logprobs, data, global_valid_toks):
            return loss_fn(logprobs, data, global_valid_seqs=None, global_valid_toks=global_valid_toks)[0]
        return own
    _exec_definitions(root / "nemo_rl/algorithms/loss_functions.py", ["NLLLoss"], namespace)
    raise pytest.skip.Exception("this NeMo-RL's NLLLoss takes logits on CUDA; give a NeMo-RL with NLLLossFn")


def _exec_definitions(path: Path, names: list[str], namespace: dict) -> None:
    """The named top-level functions and classes of a Python file, executed as written into ``namespace``."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert sorted(n.name for n in nodes) == sorted(names), f"{path} lacks one of {names}"
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)


def _row_logprobs(model, batch: dict) -> torch.Tensor:
    """Each row's next-token log-probabilities ``[B, L - 1]``, the positions restarting per (padded) sample, as
    NeMo-RL's packed forward gives them."""
    out = []
    for b in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][b:b + 1]
        cu = batch["cu_seqlens_padded"][b].long()
        lengths = torch.diff(cu)
        lengths[-1] += ids.shape[1] - int(cu[-1])  # the batch's row padding joins the last sample
        starts = torch.repeat_interleave(torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)[:-1]]),
                                         lengths)
        positions = (torch.arange(ids.shape[1]) - starts)[None]
        logits = model(input_ids=ids, position_ids=positions).logits
        lp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        out.append(lp)
    return torch.cat(out)


def _global_batch(weighted: Path, mode: str) -> list[dict]:
    """The split's packs as NeMo-RL batches of 2 packs (Energon's loader, packtool's encoder): each a micro-batch,
    half of them one data-parallel rank's, half the other's."""
    return [dict(b) for b in nemo_rl_loader(weighted, 2, split="train", loss_mode=mode)]


def _nemo_rl_gradient(model, micro_batches: list[dict], loss) -> torch.Tensor:
    """NeMo-RL's step: ``global_valid_toks`` over every micro-batch of both ranks (its workers' all-reduce, float32
    as theirs), each micro-batch's loss divided by it, gradients summed (its workers undo the data-parallel average)."""
    local = [torch.sum(b["token_mask"][:, 1:] * b["sample_mask"].unsqueeze(-1)) for b in micro_batches]
    global_valid_toks = torch.tensor([float(sum(local))])[0]
    total = torch.zeros((), dtype=torch.float64)
    for b in micro_batches:
        total = total + loss(_row_logprobs(model, b), b, global_valid_toks)
    return lg.gradient(model, total)


def test_nemo_rl_nll_step_equals_unpacked_under_every_mode(weighted, demo_dir):
    from transformers import AutoTokenizer

    model = lg.tiny_model(len(AutoTokenizer.from_pretrained(str(demo_dir / "tokenizer"))))
    own = nemo_rls_own_loss()
    packs = list(read_packs(weighted, loss_mode="token"))
    weights = [float(lg.WEIGHTS[int(k.split(":")[0])]) for b in packs for k in b["keys"]]
    found = {}
    for mode in LOSS_MODES:
        micro = _global_batch(weighted, mode)
        assert len(micro) >= 3 and sorted(k for b in micro for row in b["source_ids"] for k in row) == \
            sorted(k for b in packs for k in b["keys"])
        want = lg.gradient(model, lg.unpacked_loss(model, packs, weights, mode))
        got = _nemo_rl_gradient(model, micro, stand_in_nll_loss)
        print(mode, "stand-in", lg.relative(got, want))
        assert lg.relative(got, want) <= 1e-5, mode
        if own is not None:
            theirs = _nemo_rl_gradient(model, micro, own)
            print(mode, "NeMo-RL's NLL loss", lg.relative(theirs, want))
            assert lg.relative(theirs, want) <= 1e-5, mode
        found[mode] = want
    # Controls that must differ: the target mask alone (the encoder before loss modes: every target token 1) under
    # sample weights, and the token step against the sample one.
    plain = _global_batch(weighted, "token")
    for b in plain:
        b["token_mask"] = (b["token_mask"] > 0).float()
    control = lg.relative(_nemo_rl_gradient(model, plain, stand_in_nll_loss), found["sample"])
    print("control: the target mask against sample", control)
    assert control > 1e-2 and lg.relative(found["token"], found["sample"]) > 1e-2


def test_token_mode_without_weights_keeps_the_target_mask(demo_dir, tmp_path):
    """No weight given: ``token_mask`` is the 0/1 target mask it always was, under the default mode."""
    out = tmp_path / "out"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=lg.PACK_SIZE, align=8))
    pack(resolve_source(lg.write_conversations(tmp_path / "chats.jsonl", weights=False)), out, settings, workers=1,
         progress=False)
    batches = [dict(b) for b in nemo_rl_loader(out, 2, split="train")]
    masks = torch.cat([b["token_mask"].reshape(-1) for b in batches])
    assert set(masks.unique().tolist()) == {0.0, 1.0}
    sample = torch.cat([b["token_mask"].reshape(-1) for b in nemo_rl_loader(out, 2, split="train",
                                                                             loss_mode="sample")])
    assert not torch.equal(masks, sample) and torch.equal(masks > 0, sample > 0)
