"""Family detection never applies one family's rule to another model's folder: a folder that names a family with
any name the family does not know exactly (another version's processor, another model type) is refused in one
line naming ``--media-tokens processor``, for every family; the processor mode then takes it. Each case has its
control: the same folder with the family's own names is taken by that family."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from packtool import families
from packtool.errors import ConfigError
from packtool.families.nemotron_omni import NemotronOmni
from packtool.families.qwen2_vl import Qwen2VL
from packtool.families.qwen3_vl import Qwen3VL
from packtool.settings import EncodeSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import nemotron_omni_model
import qwen3_vl_model

REFUSED = r"no exact token rule for this folder; use --media-tokens processor"


def _edit(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _family(folder: Path, **settings) -> type:
    """The family class :func:`packtool.families.load`'s detection takes for ``folder`` (no tokenizer needed)."""
    st = EncodeSettings(tokenizer=str(folder), pack_size=2048, **settings)
    return next(c for c in families.FAMILIES if c.detect(folder, st))


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> Path:
    return nemotron_omni_model.write_model_folder(tmp_path_factory.mktemp("omni") / "model")


@pytest.fixture(scope="module")
def qwen3(demo_dir, tmp_path_factory) -> Path:
    return qwen3_vl_model.write_model_folder(tmp_path_factory.mktemp("q3") / "model", tokenizer=demo_dir / "tokenizer")


@pytest.mark.parametrize("where,key,name", [
    ("processor_config.json", "processor_class", "NemotronH_Omni_Reasoning_V4Processor"),
    ("tokenizer_config.json", "processor_class", "NemotronH_Nano_Omni_Reasoning_V3Processor"),
    ("config.json", "model_type", "nemotron_h_omni_v4"),
])
def test_nemotron_omni_refuses_a_folder_it_does_not_know_exactly(omni, tmp_path, where, key, name):
    assert _family(omni) is NemotronOmni  # control: its own names
    folder = shutil.copytree(omni, tmp_path / "m")
    if where == "config.json":
        (folder / where).write_text(json.dumps({"model_type": "nemotron_h_omni"}))
        assert _family(folder) is NemotronOmni  # its own model type is known too
    _edit(folder / where, **{key: name})
    with pytest.raises(ConfigError, match=REFUSED) as err:
        _family(folder)
    assert name in str(err.value) and "\n" not in str(err.value)
    assert _family(folder, media_tokens="processor") is not NemotronOmni  # the processor mode counts instead


def test_nemotron_omni_refuses_another_image_processor_under_its_processor(omni, tmp_path):
    folder = shutil.copytree(omni, tmp_path / "m")
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"]["image_processor_type"] = "NemotronH_Omni_Reasoning_V4ImageProcessor"
    (folder / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="image processor 'NemotronH_Omni_Reasoning_V4ImageProcessor'"):
        _family(folder)


@pytest.mark.parametrize("file,key,name", [
    ("video_preprocessor_config.json", "video_processor_type", "Qwen3OmniVideoProcessor"),
    ("preprocessor_config.json", "image_processor_type", "Qwen3OmniImageProcessor"),
    ("config.json", "model_type", "qwen3_omni_moe"),
])
def test_qwen3_vl_refuses_a_folder_it_does_not_know_exactly(qwen3, tmp_path, file, key, name):
    assert _family(qwen3) is Qwen3VL  # control
    folder = shutil.copytree(qwen3, tmp_path / "m")
    _edit(folder / file, **{key: name})
    with pytest.raises(ConfigError, match=REFUSED) as err:
        _family(folder)
    assert name in str(err.value) and "\n" not in str(err.value)
    assert _family(folder, media_tokens="processor") is not Qwen3VL


def test_qwen2_vl_refuses_another_models_folder(demo_dir, tmp_path):
    assert _family(demo_dir / "tokenizer") is Qwen2VL  # control
    folder = shutil.copytree(demo_dir / "tokenizer", tmp_path / "m")
    (folder / "config.json").write_text(json.dumps({"model_type": "llava_onevision"}))
    with pytest.raises(ConfigError, match=r"model type 'llava_onevision' is no Qwen2-VL.*--media-tokens processor"):
        _family(folder)
    assert _family(folder, media_tokens="processor") is not Qwen2VL
