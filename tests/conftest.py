"""Shared fixtures: the demo tokenizers and datasets are built once per session, and one packed output of them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo")
    demo.build_tokenizer(d / "tokenizer")
    demo.build_tokenizer(d / "tokenizer-gen", generation_tags=True)
    demo.build_dataset(d / "dataset", n_train=240, n_val=40, samples_per_shard=40, long_fraction=0.04)
    return d


@pytest.fixture(scope="session")
def packed(demo_dir, tmp_path_factory) -> Path:
    """The demo dataset packed at 2048 tokens with the plain (no generation tags) template."""
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    out = tmp_path_factory.mktemp("packed") / "out"
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048),
                            PlanSettings(shard_size="8"))
    pack(demo_dir / "dataset", out, settings, workers=1, progress=False)
    return out


@pytest.fixture(scope="session")
def torchvision():
    """transformers' video processors and Nemotron Omni's image processor import torchvision."""
    try:
        import torchvision
    except Exception as exc:  # the PyPI wheel raises RuntimeError beside a CPU-only torch
        pytest.skip(f"transformers' video and Nemotron Omni processors need torchvision: {type(exc).__name__}: {exc}")
    return torchvision
