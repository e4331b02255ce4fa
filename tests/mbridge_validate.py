"""Run by Megatron-Bridge's pins environment (``.venv-mbridge``): build a Megatron-Bridge VLM SFT recipe, point it at
a packtool OUTPUT with ``examples/megatron_bridge_recipe.py``'s ``configure``, and run Megatron-Bridge's own
``runtime_config_update`` (mixed precision, data-parallel size, then ``ConfigContainer.validate()``), the step
``finetune`` → ``pretrain`` takes before training. Prints one JSON object.

Real code: Megatron-Bridge's wheel and megatron-core (both pure Python, installed ``--no-deps`` by `make` into
``.venv-mbridge/mbridge`` and ``.venv-mbridge/mcore``). Stand-ins only for packages that are CUDA builds or have
nothing to do with configuration (Transformer Engine, Apex, flash-attention, NVIDIA's resiliency and logging
extensions, diffusers, TensorBoard): any name taken from them is an empty class, and the validation path calls none
of them (megatron-core only checks that they import).

usage: python mbridge_validate.py OUTPUT MODEL_DIR RECIPE_DIR [--declare recipe|in-batch|none] [--pp N]
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
import warnings

#: Packages replaced by empty stand-ins (CUDA builds, or unrelated to configuration), by top-level or full name.
STUBBED = ("transformer_engine", "apex", "flash_attn", "nvidia_resiliency_ext", "modelopt", "mamba_ssm",
           "causal_conv1d", "nv_one_logger", "nvtx", "wandb", "mlflow", "comet_ml", "tensorboard",
           "torch.utils.tensorboard", "diffusers")


class _Empty(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Empty(name, (object,), {})

    def __call__(cls, *args, **kwargs):
        return _Empty("instance", (object,), {})


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Empty(name, (object,), {})


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "99.0.0"  # megatron-core asks for a minimum version of some of them
        return module

    def exec_module(self, module):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("model")
    parser.add_argument("recipe_dir")
    parser.add_argument("--declare", choices=("recipe", "in-batch", "none"), default="recipe")
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    sys.meta_path.insert(0, _StandIns())
    warnings.simplefilter("ignore")
    os.environ["WORLD_SIZE"] = str(args.pp)
    sys.path.insert(0, args.recipe_dir)
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.recipes.qwen_vl.h100 import qwen25_vl
    from megatron.bridge.training import gpt_step, nemotron_omni_step
    from megatron.bridge.training.config import runtime_config_update

    import megatron_bridge_recipe as recipe

    cfg = qwen25_vl._sft_common_vlm()  # the stock Qwen2.5-VL SFT recipe's common part; the model from MODEL_DIR
    cfg.model = AutoBridge.from_hf_pretrained(args.model).to_megatron_provider(load_weights=False)
    cfg.model.pipeline_model_parallel_size = args.pp
    if args.pp > 1:
        cfg.model.pipeline_dtype = __import__("torch").bfloat16
    cfg = recipe.configure(cfg, args.output)
    if args.declare == "in-batch":  # the control: the declaration the recipe used to make
        cfg.dataset.enable_offline_packing, cfg.dataset.offline_packing_specs = False, None
        cfg.dataset.enable_in_batch_packing = True
    elif args.declare == "none":  # the control: no declaration at all
        cfg.dataset.enable_offline_packing, cfg.dataset.offline_packing_specs = False, None
    result: dict = {"dataset": type(cfg.dataset).__name__, "micro_batch_size": cfg.train.micro_batch_size,
                    "seq_length": cfg.model.seq_length}
    try:
        runtime_config_update(cfg)
        result["validated"] = True
        result["per_token_loss"] = [bool(cfg.model.calculate_per_token_loss), bool(cfg.ddp.average_in_collective)]
    except (ValueError, AssertionError) as exc:
        result["validated"], result["error"] = False, str(exc).splitlines()[0]
    result["middle_stages_get_boundaries"] = {
        "gpt_step": bool(gpt_step._middle_pp_stage_needs_batch(cfg)),
        "nemotron_omni_step": bool(nemotron_omni_step._uses_packed_sequence_metadata(cfg)),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
