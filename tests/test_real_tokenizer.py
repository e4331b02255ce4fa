"""Integration with a real vocabulary: Qwen2's 151k-rank BPE (built offline from a PyPI wheel), not the demo's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """The Qwen2 vocabulary converted from the qwen-agent wheel that `make` fetches into the environment (next to
    the interpreter: ``.venv/wheels``); nothing is downloaded while tests run."""
    wheels = sorted((Path(sys.prefix) / "wheels").glob("qwen_agent-*.whl"))
    if not wheels:
        pytest.skip(f"no qwen-agent wheel in {Path(sys.prefix) / 'wheels'} (`make` fetches it at install time)")
    out = tmp_path_factory.mktemp("qwen") / "tokenizer"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "qwen_tokenizer.py"), str(out), str(wheels[-1])],
                   check=True, capture_output=True, timeout=600)
    return out


def test_pack_with_real_qwen2_vocabulary(qwen, demo_dir, tmp_path):
    from transformers import AutoTokenizer

    from packtool.packer.pipeline import pack
    from packtool.runtime.read import read_packs
    from packtool.settings import EncodeSettings, PackSettings
    from packtool.verify.packs import verify_output

    out = tmp_path / "out"
    result = pack(demo_dir / "dataset", out, PackSettings(EncodeSettings(tokenizer=str(qwen), pack_size=4096, align=8),
                                                          splits=("val",)), progress=False)
    assert result.counts["val"]["error"] == 0 and result.counts["val"]["packed"] > 0
    assert verify_output(out, source=demo_dir / "dataset") == []
    manifest = json.loads((out / ".nv-meta" / "packtool.json").read_text())
    assert manifest["image_token_id"] == 151655 and manifest["pad_token_id"] == 151643
    tok = AutoTokenizer.from_pretrained(qwen)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for batch in read_packs(out, "val", images=False):
        labels, tokens = batch["labels"][0].numpy(), batch["tokens"][0].numpy()
        assert (labels[np.asarray(batch["cu_seqlens_padded"][1:]) - 1] == -100).all()
        targets = labels[labels != -100]
        # Every reply ends with <|im_end|> and the targets decode to plain assistant text plus those markers.
        assert (targets == end).sum() >= len(batch["keys"]) - 1
        text = tok.decode(targets)
        assert "<|im_start|>" not in text and "assistant\n" not in text and "<|image_pad|>" not in text
        assert (tokens[batch["padding_mask"][0].numpy()] == 151643).all()
