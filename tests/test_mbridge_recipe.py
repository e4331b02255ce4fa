"""The Megatron-Bridge recipe (``examples/megatron_bridge_recipe.py``) passes Megatron-Bridge's own configuration
validation: its stock Qwen2.5-VL SFT recipe pointed at a packtool OUTPUT goes through ``runtime_config_update``
(``ConfigContainer.validate()``), the step its ``finetune`` → ``pretrain`` path takes, in Megatron-Bridge's pins
environment with its wheel and megatron-core (see ``tests/mbridge_validate.py`` for what is real and what stands
in). With pipeline parallel 3 its steps give the middle stages the THD boundaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import packfixture as fx

ROOT = Path(__file__).resolve().parents[1]
PINS = Path(sys.prefix).parent / ".venv-mbridge"
WHEEL, MCORE = PINS / "mbridge", PINS / "mcore"


def _validate(output: Path, model: Path, *args: str) -> dict:
    if not (PINS / "bin" / "python").exists() or not (WHEEL / "megatron" / "bridge").is_dir() \
            or not (MCORE / "megatron" / "core").is_dir():
        pytest.skip(f"Megatron-Bridge's pins environment with its wheel and megatron-core is not in {PINS} "
                    f"(`make test` builds it; alone: `make {PINS.name}/mcore/megatron/core/__init__.py`)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WHEEL), str(MCORE), str(ROOT)]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([str(PINS / "bin" / "python"), str(ROOT / "tests" / "mbridge_validate.py"), str(output),
                           str(model), str(ROOT / "examples"), *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def packed_and_model(tmp_path_factory) -> tuple[Path, Path]:
    from transformers import Qwen2_5_VLConfig

    root = tmp_path_factory.mktemp("mbridge-recipe")
    fx.write_packs(root / "packs", {"train": [[fx.chat_segment("a", "q", "x")]],
                                    "val": [[fx.chat_segment("b", "q", "y")]]},
                   pack_size=128, align=4, image_processor=fx.QWEN_PROCESSOR)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 1000,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "fullatt_block_indexes": [0]})
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.save_pretrained(root / "model")
    return root / "packs", root / "model"


def test_the_recipe_passes_megatron_bridges_validation(packed_and_model):
    """The recipe's dataset declares offline packing (micro batch 1, one pack per row): validation passes and the
    middle pipeline stages of ``gpt_step`` and ``nemotron_omni_step`` get the THD boundaries at PP 3. The
    controls: the declaration the recipe used to make (``enable_in_batch_packing``) is refused by the same
    validation, and no declaration leaves the middle stages without boundaries."""
    output, model = packed_and_model
    for pp in ("3",):
        got = _validate(output, model, "--pp", pp)
        assert got["validated"], got
        assert got["micro_batch_size"] == 1 and got["seq_length"] == 128, got
        assert got["per_token_loss"] == [True, False], got  # at CP 1 too: packs weigh as the loss mode says
        assert got["middle_stages_get_boundaries"] == {"gpt_step": True, "nemotron_omni_step": True}, got
    in_batch = _validate(output, model, "--declare", "in-batch")
    assert not in_batch["validated"] and "micro_batch_size should be greater than 1" in in_batch["error"], in_batch
    none = _validate(output, model, "--declare", "none")
    assert none["middle_stages_get_boundaries"] == {"gpt_step": False, "nemotron_omni_step": False}, none
