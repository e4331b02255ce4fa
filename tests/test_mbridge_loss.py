"""Megatron-Bridge's step on weighted packs: its own ``masked_next_token_loss`` on the ``loss_mask`` of packtool's
batch, with Megatron-Core's per-token normalization (``calculate_per_token_loss = True``, what the recipe sets at
every context-parallel size), gives the gradient of the same samples trained unpacked under each loss mode (run in
Megatron-Bridge's pins environment by ``tests/mbridge_loss.py``). Control: without per-token loss, Megatron-Core's
per-micro-batch mean weighs each pack the same and differs."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import lossgrad as lg
from packtool.packer.pipeline import pack
from packtool.packer.sources.files import resolve_source
from packtool.settings import EncodeSettings, PackSettings
from test_mbridge_recipe import MCORE, PINS, ROOT, WHEEL


def test_megatron_bridge_loss_equals_unpacked(demo_dir, tmp_path):
    if not (PINS / "bin" / "python").exists() or not (WHEEL / "megatron" / "bridge").is_dir() \
            or not (MCORE / "megatron" / "core").is_dir():
        pytest.skip(f"Megatron-Bridge's pins environment with its wheel and megatron-core is not in {PINS}")
    out = tmp_path / "out"
    pack(resolve_source(lg.write_conversations(tmp_path / "chats.jsonl")), out,
         PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=lg.PACK_SIZE)), workers=1,
         progress=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WHEEL), str(MCORE), str(ROOT)]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([str(PINS / "bin" / "python"), str(ROOT / "tests" / "mbridge_loss.py"), str(out),
                           str(demo_dir / "tokenizer")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    print(found)
    assert found["token"] <= 1e-5 and found["sample"] <= 1e-5 and found["square"] <= 1e-5
    assert found["sample_count"] > found["token_count"] > 0  # the scaled count, in int32
    # Controls: the per-pack mean differs from both, and so do the modes.
    assert found["per_pack_mean_vs_token"] > 1e-2 and found["per_pack_mean_vs_sample"] > 1e-2
    assert found["sample_vs_token"] > 1e-2
