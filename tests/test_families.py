"""The model-family interface: the registry, a family written as one module (the fixed count), one reader of a
model folder's settings whatever its layout, and a runtime side that imports nothing from the build side."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from packtool import families
from packtool.families.fixed import FixedCount
from packtool.families.qwen2_vl import Qwen2VL
from packtool.families.qwen3_vl import Qwen3VL
from packtool.packer.encoder import Encoder
from packtool.packer.pipeline import pack
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from test_encode import png, raw


def test_fixed_count_is_one_module_and_one_registry_line(demo_dir):
    """``image_tokens`` selects the fixed-count family from the registry; every image costs that many tokens
    whatever its size, its manifest entries read back to the same family, and verify re-derives the same plan."""
    assert FixedCount in families.FAMILIES
    enc = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, image_tokens=7))
    assert isinstance(enc.family, FixedCount)
    sample = raw({"json": {"conversations": [{"from": "human", "value": "<image> and <image>?"},
                                             {"from": "gpt", "value": "two"}]},
                  "img0.png": png(640, 480), "img1.png": png(20, 30)})
    e = enc.encode_many([sample])[0]
    assert e.status == "packed", e.reason
    assert [(m.tokens, m.grid_thw) for m in e.media] == [(7, (1, 1, 1)), (7, (1, 1, 1))]
    pad = enc.family.tokens.image_token_id
    assert int((e.tokens == pad).sum()) == 14
    entries = enc.family.manifest_entries()
    assert entries["image_processor"]["type"] == "fixed" and entries["image_processor"]["fixed_tokens"] == 7
    back = families.from_manifest({**entries, "pad_token_id": 0})
    assert isinstance(back, FixedCount) and back.count == 7
    assert back.check_image(640, 480, 2) == ([1, 1, 1], 7)
    assert back.placeholder_ids()["image"] == pad
    # Without image_tokens the same folder is Qwen2-VL's, whose counts depend on the size: the control.
    qwen = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    assert isinstance(qwen.family, Qwen2VL)
    assert [m.tokens for m in qwen.encode_many([sample])[0].media] != [7, 7]


def test_a_convention_is_a_value_the_family_takes(demo_dir):
    """``--preset`` names a convention; the preset's settings are the convention's, and the family holds it."""
    from packtool.families.conventions import CONVENTIONS
    from packtool.settings import PRESETS

    assert PRESETS["megatron-bridge-qwen-vl"] == CONVENTIONS["megatron-bridge-qwen-vl"].settings()
    enc = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048,
                                 preset="megatron-bridge-qwen-vl"))
    assert enc.family.convention.name == "megatron-bridge-qwen-vl" and enc.family.convention.media_first
    plain = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    assert plain.family.convention == families.TRANSFORMERS


def test_each_presets_overlong_rule_is_its_trainers(demo_dir):
    """A sample longer than a pack: Megatron-Bridge's Qwen-VL encoder raises and Energon skips it, NeMo-RL's Qwen
    path trains nothing of it (a loss-0 stub): their presets drop it; the Nemotron presets keep truncating (their
    trainers cut it). A conflicting explicit --overlong is refused in one line; the default truncates (control)."""
    import pytest

    from packtool import config as cfg
    from packtool.errors import ConfigError
    from packtool.settings import PRESETS

    long = raw({"json": {"conversations": [{"from": "human", "value": "Why?"},
                                           {"from": "gpt", "value": "word " * 3000}]}})
    tok = str(demo_dir / "tokenizer")
    for preset in ("megatron-bridge-qwen-vl", "nemo-rl-qwen-vl"):
        settings = EncodeSettings(tokenizer=tok, pack_size=2048, preset=preset)
        assert settings.overlong == "drop"
        assert Encoder(settings).encode_many([long])[0].status == "dropped"
        values, given = cfg.merge(None, {"source": "s", "output": "o", "tokenizer": tok, "pack_size": 2048,
                                         "preset": preset, "overlong": "truncate"})
        with pytest.raises(ConfigError, match="sets overlong to 'drop'"):
            cfg.build(values, given)
    for preset in ("megatron-bridge-nemotron-omni", "nemo-rl-nemotron-omni"):
        assert "overlong" not in PRESETS[preset]
    assert Encoder(EncodeSettings(tokenizer=tok, pack_size=2048)).encode_many([long])[0].status == "truncated"


def test_a_folder_written_by_save_pretrained_packs_like_the_hub_layout(demo_dir, tmp_path):
    """The installed transformers' ``save_pretrained`` nests the image settings in ``processor_config.json`` (no
    ``preprocessor_config.json``): that folder packs the demo's val split byte for byte like the hub layout it
    was made from (every image sample kept)."""
    from transformers import AutoProcessor

    hub = tmp_path / "hub"
    shutil.copytree(demo_dir / "tokenizer", hub)
    (hub / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    saved = tmp_path / "saved"
    AutoProcessor.from_pretrained(str(hub), local_files_only=True).save_pretrained(str(saved))
    assert not (saved / "preprocessor_config.json").exists()
    assert "image_processor" in json.loads((saved / "processor_config.json").read_text())
    outs = {}
    for name, folder in (("hub", hub), ("saved", saved)):
        settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=2048), PlanSettings(),
                                splits=("val",))
        pack(demo_dir / "dataset", tmp_path / f"out-{name}", settings, workers=1, progress=False)
        outs[name] = tmp_path / f"out-{name}"
    files = sorted(p.relative_to(outs["hub"]) for p in outs["hub"].rglob("*")
                   if p.suffix in (".tar", ".parquet") and ".packtool" not in p.parts)
    assert any(f.suffix == ".tar" for f in files)
    for f in files:
        assert (outs["hub"] / f).read_bytes() == (outs["saved"] / f).read_bytes(), f
    import pyarrow.parquet as pq

    rows = pq.read_table(outs["saved"] / "ledger.parquet").to_pylist()
    assert all(r["status"] != "error" for r in rows) and sum(r["images"] for r in rows) > 0


def test_the_runtime_side_imports_nothing_from_the_build_side():
    """``packtool.runtime`` and its entry points, and ``packtool.settings``, load without one module of
    ``packtool.packer`` (the runtime can be installed into a training container alone); the conventions' text
    layout runs without it too (the media tags are the format's)."""
    code = ("import sys, packtool.settings, packtool.runtime.read, packtool.runtime.loader, "
            "packtool.runtime.megatron_batch, packtool.runtime.nemo_rl, packtool.runtime.hf, "
            "packtool.families.nemotron_omni.reader, packtool.families.nemotron_omni.mbridge_reader, "
            "packtool.families.qwen2_vl.reader, packtool.families.qwen3_vl.reader; "
            "from packtool.runtime import read_packs, megatron_bridge_batch; "
            "from packtool.families.conventions import media_first; "
            "assert media_first('Look at <image>') == '<image>Look at'; "
            "print([m for m in sys.modules if m.startswith('packtool.packer')])")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]", out.stdout
    # The control: the build side's encoder does import it.
    with_encoder = code.replace("packtool.families.qwen3_vl.reader;",
                                "packtool.families.qwen3_vl.reader, packtool.packer.encoder;")
    control = subprocess.run([sys.executable, "-c", with_encoder],
                             capture_output=True, text=True, check=True, env={"PYTHONPATH": str(root),
                                                                             "PATH": "/usr/bin:/bin"})
    assert "packtool.packer.encoder" in control.stdout


def test_images_without_a_rule_are_quarantined_with_the_reason(demo_dir, tmp_path):
    """A folder with no media rule (no image settings) packs text and quarantines image samples with the reason."""
    folder = tmp_path / "text"
    shutil.copytree(demo_dir / "tokenizer", folder)
    (folder / "preprocessor_config.json").unlink()
    enc = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048))
    assert isinstance(enc.family, families.base.NoMedia)
    assert enc.family.manifest_entries()["image_processor"] is None
    image = raw({"json": {"conversations": [{"from": "human", "value": "<image> what?"},
                                            {"from": "gpt", "value": "x"}]}, "png": png(32, 32)})
    text = raw({"json": {"conversations": [{"from": "human", "value": "what?"}, {"from": "gpt", "value": "x"}]}})
    got = enc.encode_many([image, text])
    assert got[0].status == "error" and "image_tokens" in got[0].reason and "processor mode" in got[0].reason
    assert got[1].status == "packed"


def test_verify_the_reader_and_the_loaders_take_the_family_the_manifest_names():
    """``from_manifest`` gives each manifest's family (the NeMo-RL variant where the manifest's preset names it)
    and ``of_batch`` each reader batch's layout; the modules that read packs name no family of their own."""
    import re

    from packtool.families.base import manifest_tokens
    from packtool.families.nemotron_omni import NemoRLNemotronOmni, NemotronOmni, NemotronOmniSettings

    entries = NemotronOmni(manifest_tokens({}), families.TRANSFORMERS, "", NemotronOmniSettings()).manifest_entries()
    plain = families.from_manifest({**entries, "settings": {"pack_size": 4096}})
    assert type(plain) is NemotronOmni and plain.expanded_in_text and plain.shared_image_budget
    assert plain.run.pack_size == 0  # the plain family takes no run facts; its NeMo-RL variant is built with them
    nemo_rl = families.from_manifest({**entries, "settings": {"preset": "nemo-rl-nemotron-omni", "pack_size": 4096}})
    assert isinstance(nemo_rl, NemoRLNemotronOmni) and nemo_rl.run.pack_size == 4096 and nemo_rl.plans_sample_images
    assert nemo_rl.convention.name == "nemo-rl-nemotron-omni"
    assert families.of_batch({"family": "nemotron_omni", "image_grid_hw": None}) is NemotronOmni
    assert families.of_batch({"family": "qwen2_vl", "image_grid_hw": None}) is Qwen2VL  # the name, not the keys
    with pytest.raises(ValueError, match="names no family"):  # nothing guessed from the keys
        families.of_batch({"image_grid_hw": None, "media_kinds": []})
    with pytest.raises(ValueError, match="no family is called 'qwen9'"):
        families.of_batch({"family": "qwen9"})
    root = Path(__file__).resolve().parents[1] / "packtool"
    branch = re.compile(r"is_nemotron|processor_family|NEMOTRON_FAMILY|\.get\(\"family\"\)|image_grid_hw\" in|"
                        r"hasattr\([a-z_]+, \"temporal_patch_size\"\)|\"nemo-rl-nemotron-omni\"|nemotron6|"
                        r"\"second_per_grid_ts\", \"sound_length\"|\"qwen2_vl\"|\"qwen3_vl\"")
    readers = ["runtime/read.py", "runtime/loader.py", "runtime/megatron_batch.py", "runtime/nemo_rl.py",
               "runtime/hf.py", "readkit.py", "verify/packs.py", "verify/source.py", "packer/encoder.py",
               *sorted(f"format/{p.name}" for p in (root / "format").glob("*.py"))]
    assert [f for f in readers if branch.search((root / f).read_text())] == []
    # The controls: the families' own modules name them.
    assert branch.search((root / "families/nemotron_omni/family.py").read_text())
    assert branch.search((root / "families/nemotron_omni/nemo_rl.py").read_text())


def _qwen3_vl_folders(demo_dir, tmp_path) -> dict[str, Path]:
    """A Qwen3-VL folder as transformers' ``save_pretrained`` writes it (the processor class and both
    sub-processors nested in ``processor_config.json``) and as the hub ships it (``preprocessor_config.json`` with
    Qwen2-VL's image processor, ``video_preprocessor_config.json`` with Qwen3-VL's video processor, ``config.json``),
    both with the demo's vocabulary."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLProcessor, Qwen3VLVideoProcessor

    tok = AutoTokenizer.from_pretrained(str(demo_dir / "tokenizer"))
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, min_pixels=1024, max_pixels=65536),
        video_processor=Qwen3VLVideoProcessor(patch_size=16), tokenizer=tok, chat_template=tok.chat_template)
    saved = tmp_path / "qwen3-vl-saved"
    processor.save_pretrained(str(saved))
    hub = tmp_path / "qwen3-vl-hub"
    shutil.copytree(demo_dir / "tokenizer", hub)
    nested = json.loads((saved / "processor_config.json").read_text())
    (hub / "preprocessor_config.json").write_text(json.dumps(
        {**nested["image_processor"], "image_processor_type": "Qwen2VLImageProcessorFast",
         "processor_class": "Qwen3VLProcessor"}))
    (hub / "video_preprocessor_config.json").write_text(json.dumps(
        {**nested["video_processor"], "processor_class": "Qwen3VLProcessor"}))
    (hub / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    return {"saved": saved, "hub": hub}


def test_a_qwen3_vl_folder_is_refused_by_the_qwen2_vl_rule_and_counted_by_its_processor(demo_dir, tmp_path):
    """Qwen3-VL ships Qwen2-VL's image processor under its own processor and video processor: its video tokens
    follow other rules, so the Qwen2-VL rule refuses the folder in one line naming the processor mode, in both
    layouts (the Qwen3-VL family, detected first, takes it); the processor mode counts its tokens as transformers'
    ``Qwen3VLProcessor`` does. The control: the same folder under Qwen2.5-VL's names is taken by the Qwen2-VL
    rule."""
    import io

    import pytest
    from PIL import Image
    from transformers import AutoProcessor

    from packtool.errors import ConfigError
    from packtool.families.processor import ProcessorMode

    sample = raw({"json": {"conversations": [{"from": "human", "value": "<image> what is it?"},
                                             {"from": "gpt", "value": "a box"}]},
                  "img0.png": png(320, 200)})
    for layout, folder in _qwen3_vl_folders(demo_dir, tmp_path).items():
        with pytest.raises(ConfigError, match=r"no Qwen2-VL or Qwen2\.5-VL one.*--media-tokens processor"):
            Qwen2VL.detect(folder, EncodeSettings(tokenizer=str(folder), pack_size=2048))
        assert isinstance(Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048)).family, Qwen3VL), layout
        enc = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048, media_tokens="processor"))
        assert isinstance(enc.family, ProcessorMode), layout
        e = enc.encode_many([sample])[0]
        assert e.status == "packed", (layout, e.reason)
        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
        assert type(processor).__name__ == "Qwen3VLProcessor", layout
        image = Image.open(io.BytesIO(png(320, 200))).convert("RGB")
        grid = processor.image_processor(images=[image], return_tensors="np")["image_grid_thw"][0]
        expected = int(grid.prod()) // processor.image_processor.merge_size ** 2
        assert [m.tokens for m in e.media] == [expected], layout
    # The control: Qwen2.5-VL's names on the hub layout are the Qwen2-VL rule's.
    hub = tmp_path / "qwen3-vl-hub"
    for name, value in (("preprocessor_config.json", "Qwen2_5_VLProcessor"),
                        ("video_preprocessor_config.json", "Qwen2_5_VLProcessor")):
        cfg = json.loads((hub / name).read_text())
        cfg["processor_class"] = value
        if "video_processor_type" in cfg:
            cfg["video_processor_type"] = "Qwen2VLVideoProcessor"
        (hub / name).write_text(json.dumps(cfg))
    (hub / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert isinstance(Encoder(EncodeSettings(tokenizer=str(hub), pack_size=2048)).family, Qwen2VL)


def test_a_variant_serves_only_its_own_family():
    """Each family holds its own variants: one registered for Qwen2-VL is not Qwen3-VL's, Nemotron Omni's or the
    base's (a dict shared through the base class once registered a variant for every family), and a convention
    registered twice for one family is refused."""
    from packtool.families.nemotron_omni import NemotronOmni
    from packtool.families.qwen2_vl import Qwen2VL
    from packtool.families.qwen3_vl import Qwen3VL

    class Custom(Qwen2VL):
        pass

    Qwen2VL.register_variant("test-only-convention", Custom)
    try:
        assert Qwen2VL.variants["test-only-convention"] is Custom
        for other in (Qwen3VL, NemotronOmni, families.Family):
            assert "test-only-convention" not in other.variants, other
        assert set(NemotronOmni.variants) == {"megatron-bridge-nemotron-omni", "nemo-rl-nemotron-omni"}
        with pytest.raises(ValueError, match="already has a variant"):
            Qwen2VL.register_variant("test-only-convention", Custom)
        with pytest.raises(TypeError, match="not a subclass of Qwen3VL"):
            Qwen3VL.register_variant("another", Custom)
    finally:
        del Qwen2VL.variants["test-only-convention"]


def test_a_family_is_registered_once_with_its_trainer_layouts():
    """One spec per family (name, rule class, trainer layouts) in one registry, which refuses a name twice and a
    spec whose class has another name; the trainers' layouts are the spec's, not methods of the shared base."""
    from packtool.families import REGISTRY, FamilySpec, TrainerLayouts, register
    from packtool.families.base import Family
    from packtool.families.spec import spec_named

    assert list(REGISTRY) == [cls.name for cls in families.FAMILIES]
    assert list(REGISTRY) == ["nemotron_omni", "qwen3_vl", "fixed", "qwen2_vl", "none"]
    with pytest.raises(ValueError, match="'qwen2_vl' is already registered"):
        register(FamilySpec("qwen2_vl", Qwen2VL))
    with pytest.raises(ValueError, match="which is called 'qwen2_vl'"):
        FamilySpec("qwen4_vl", Qwen2VL)
    assert list(REGISTRY) == ["nemotron_omni", "qwen3_vl", "fixed", "qwen2_vl", "none"]  # nothing half-added
    for trainer_method in ("bridge_media", "nemo_rl_media", "nemo_rl_patch_dim", "check_recipe_options",
                           "owns_batch"):
        assert not hasattr(Family, trainer_method), trainer_method
    fields = ("megatron_bridge", "nemo_rl_media", "nemo_rl_patch_dim", "nemo_rl_recipe", "nemo_rl_prompt",
              "hugging_face")
    for spec in REGISTRY.values():
        for field in fields:  # every layout a spec gives is a function (no import string), the one it holds
            fn = getattr(spec.layouts, field)
            assert fn is None or (callable(fn) and not isinstance(fn, str)), (spec.name, field)
            assert spec.layouts.function(field) is fn
    with pytest.raises(TypeError, match="not a function"):  # control: an import string is refused where it is read
        TrainerLayouts(hugging_face="packtool.readkit:text_positions").function("hugging_face")  # type: ignore[arg-type]
    # registering every family (as each build worker does) loads no torch: the layouts import their readers when
    # a batch is laid out
    probe = "import sys, packtool.families; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    assert spec_named("qwen3_vl").layouts.megatron_bridge_refused
    assert spec_named("nemotron_omni").layouts.nemo_rl_media is not None
    assert TrainerLayouts().function("nemo_rl_media") is None
    with pytest.raises(ValueError, match="no family is called 'qwen9'"):
        spec_named("qwen9")


def test_a_familys_reader_is_its_own_class_registered_beside_it():
    """What a pack becomes in a reader batch is the family's reader, a class in its home registered in its
    ``FamilySpec``, not methods of the family: the registry builds, for each manifest, the reader of the family
    it names under the convention it records (Megatron-Bridge's Nemotron Omni variant its own), and the family's
    rule class holds none of the reader's members."""
    from packtool.families import PROCESSOR_MODE, REGISTRY, FamilyReader, FamilySpec
    from packtool.families.base import Family, manifest_tokens
    from packtool.families.nemotron_omni import (
        MBridgeNemotronOmni,
        MBridgeNemotronOmniReader,
        NemotronOmni,
        NemotronOmniReader,
        NemotronOmniSettings,
    )
    from packtool.families.processor import ProcessorReader
    from packtool.families.reading import NoMediaReader

    expected = {"nemotron_omni": "NemotronOmniReader", "qwen3_vl": "Qwen3VLReader", "fixed": "FamilyReader",
                "qwen2_vl": "Qwen2VLReader", "none": "NoMediaReader"}
    assert {name: spec.reader.__name__ for name, spec in REGISTRY.items()} == expected
    assert PROCESSOR_MODE.reader is ProcessorReader and "processor" not in REGISTRY
    for member in ("reader_processor", "video_entry", "read_videos", "reader_images", "image_patch_dim",
                   "read_media", "temporal_patch_dim", "position_ids", "batch_family", "batch_keys",
                   "reads_folder"):
        assert not hasattr(Family, member), member  # the rule class holds none of the reader's members
    assert hasattr(FamilyReader, "read_media") and hasattr(FamilyReader, "batch_keys")  # control: the reader does
    with pytest.raises(TypeError, match="not a FamilyReader class"):  # control: a spec's reader is a reader class
        FamilySpec("qwen2_vl", Qwen2VL, reader=Qwen2VL)  # type: ignore[arg-type]

    entries = NemotronOmni(manifest_tokens({}), families.TRANSFORMERS, "", NemotronOmniSettings()).manifest_entries()
    plain = families.reader_of({**entries, "settings": {}})
    assert type(plain) is NemotronOmniReader and plain.reads_folder and plain.batch_family() == "nemotron_omni"
    mb = families.CONVENTIONS["megatron-bridge-nemotron-omni"]
    mb_entries = {**entries, "image_processor": {**entries["image_processor"],
                                                 "megatron_bridge": {"audio_count": "frames"}}}
    variant = families.reader_of({**mb_entries, "settings": {}, "convention": mb.record()})
    assert type(variant) is MBridgeNemotronOmniReader and isinstance(variant.family, MBridgeNemotronOmni)
    assert variant.family.run.audio_count == "frames" and not variant.reads_folder and variant.processor() is None
    assert set(variant.batch_keys) - set(plain.batch_keys) == {"sound_length", "num_image_tiles"}
    assert variant.batch_family() == "nemotron_omni"  # the variant's batches follow the family's layouts
    text = families.reader_of({"image_processor": None, "settings": {}})
    assert type(text) is NoMediaReader and text.batch_keys == () and text.processor() is None
    processor = families.reader_of({"image_processor": {"family": "processor"}, "settings": {}})
    assert type(processor) is ProcessorReader and processor.batch_family() == "none" and processor.reads_folder

    class Custom(NemotronOmniReader):
        pass

    NemotronOmniReader.register_variant("test-only-convention", Custom)
    try:  # each reader holds its own variants, as each family does
        assert "test-only-convention" not in FamilyReader.variants
        assert set(MBridgeNemotronOmniReader.variants) == set()
        with pytest.raises(ValueError, match="already has a variant"):
            NemotronOmniReader.register_variant("test-only-convention", Custom)
        with pytest.raises(TypeError, match="not a subclass of NoMediaReader"):
            NoMediaReader.register_variant("another", Custom)
    finally:
        del NemotronOmniReader.variants["test-only-convention"]


def test_a_conventions_variant_keeps_its_trainer_refusal_under_the_registered_layout():
    """Megatron-Bridge's Nemotron Omni packs are laid out for Megatron-Bridge: NeMo-RL's registered Nemotron Omni
    layout, given the variant's reader (the one the registry builds for a family of that convention), refuses them
    with the reason (the plain family's reader passes the same check)."""
    from packtool.families.base import manifest_tokens
    from packtool.families.nemotron_omni import (
        MBridgeNemotronOmni,
        MBridgeNemotronOmniReader,
        NemotronOmni,
        NemotronOmniReader,
        NemotronOmniSettings,
    )
    from packtool.families.spec import spec_named

    media = spec_named("nemotron_omni").layouts.function("nemo_rl_media")
    assert media is not None
    settings = NemotronOmniSettings()
    variant = MBridgeNemotronOmni.__new__(MBridgeNemotronOmni)
    variant.convention = families.CONVENTIONS["megatron-bridge-nemotron-omni"]
    reader = families.reader_for(variant)
    assert type(reader) is MBridgeNemotronOmniReader and reader.family is variant
    with pytest.raises(ValueError, match="laid out for Megatron-Bridge, not NeMo-RL"):
        media(reader, None, None, "here")
    plain = families.reader_for(NemotronOmni(manifest_tokens({}), families.TRANSFORMERS, "", settings))
    assert type(plain) is NemotronOmniReader  # control: the plain family's reader is not refused
    assert getattr(plain, "nemo_rl_refused", None) is None
