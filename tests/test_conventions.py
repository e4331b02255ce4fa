"""A convention (``--preset``) has one owner: registered once, applied once (by the settings, which name the config
file a conflicting value came from), its own settings declared by it, and the resolved convention recorded in a
preset run's manifest and read back from there (an older manifest without the record: by the preset's name)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from packtool import families
from packtool.errors import ConfigError
from packtool.families.conventions import CONVENTIONS, TRANSFORMERS, Convention, from_record, register_convention
from packtool.format import MANIFEST, Manifest
from packtool.settings import CONVENTION_OPTIONS, EncodeSettings


def test_a_convention_is_registered_once():
    before = dict(CONVENTIONS)
    for name in ("megatron-bridge-qwen-vl", "transformers"):
        with pytest.raises(ValueError, match="already registered"):
            register_convention(Convention(name))
    assert CONVENTIONS == before


def test_a_conventions_own_settings_are_declared_by_it():
    assert CONVENTION_OPTIONS == {"thinking_trace_format": ("nemo-rl-nemotron-omni",),
                                  "audio_count": ("megatron-bridge-nemotron-omni",)}
    with pytest.raises(ConfigError, match="thinking_trace_format applies to --preset nemo-rl-nemotron-omni only"):
        EncodeSettings(tokenizer="t", pack_size=1024, thinking_trace_format="ultra", preset="nemo-rl-qwen-vl")
    ok = EncodeSettings(tokenizer="t", pack_size=1024, thinking_trace_format="ultra", preset="nemo-rl-nemotron-omni")
    assert ok.thinking_trace_format == "ultra"


def test_nemo_rl_nemotrons_trace_format_defaults_to_its_recipes():
    """Under ``--preset nemo-rl-nemotron-omni`` an unset ``thinking_trace_format`` is ``ultra`` (NeMo-RL's Nemotron
    Omni recipe), recorded in the manifest; ``normalized`` stays when given (control); a manifest written before
    the default (none recorded) reads back as ``normalized``, what it was packed with."""
    from packtool.settings import PackSettings, recorded_settings

    unset = EncodeSettings(tokenizer="t", pack_size=1024, preset="nemo-rl-nemotron-omni")
    assert unset.thinking_trace_format == "ultra"
    assert PackSettings(unset).describe()["thinking_trace_format"] == "ultra"
    given = EncodeSettings(tokenizer="t", pack_size=1024, preset="nemo-rl-nemotron-omni",
                           thinking_trace_format="normalized")
    assert given.thinking_trace_format == "normalized"
    assert EncodeSettings(tokenizer="t", pack_size=1024).thinking_trace_format is None  # no preset: not used
    old = recorded_settings({"preset": "nemo-rl-nemotron-omni", "pack_size": 1024, "tokenizer": "t"})
    assert EncodeSettings(**old).thinking_trace_format == "normalized"


def test_the_preset_is_applied_once_and_a_given_conflict_names_where_it_came_from():
    preset = "megatron-bridge-qwen-vl"
    filled = EncodeSettings(tokenizer="t", pack_size=1024, preset=preset)
    assert (filled.media_first, filled.overlong, filled.max_pixels) == (True, "drop", 1_003_520)
    # a value equal to the default but given is a conflict too; the message names the file it came from
    with pytest.raises(ConfigError, match=r"sets media_first to True, not False \(given in run\.yaml\)"):
        EncodeSettings(tokenizer="t", pack_size=1024, preset=preset, media_first=False, given={"media_first"},
                       origin={"media_first": "run.yaml"})
    with pytest.raises(ConfigError, match=r"not False \(given explicitly\)"):
        EncodeSettings(tokenizer="t", pack_size=1024, preset=preset, media_first=False, given={"media_first"})
    # control: not given, the same value is the default and the preset fills it
    assert EncodeSettings(tokenizer="t", pack_size=1024, preset=preset, media_first=False, given=set()).media_first


def test_the_recorded_convention_is_what_a_reader_takes(packed):
    manifest = json.loads((packed / MANIFEST).read_text())
    assert "convention" not in manifest  # a run without a preset records none (its bytes are unchanged)
    base = CONVENTIONS["nemo-rl-qwen-vl"]
    record = base.record()
    assert from_record(record) == base and type(from_record(json.loads(json.dumps(record)))) is type(base)
    with_preset = {**manifest, "settings": {**manifest["settings"], "preset": "nemo-rl-qwen-vl"}}
    assert families.from_manifest(with_preset).convention == base  # no record: by the name
    changed = replace(base, overlong="truncate", target_newline_after_eot=False)
    recorded = {**with_preset, "convention": changed.record()}
    family = families.from_manifest(recorded)
    assert family.convention == changed and family.convention != base  # the record wins over the registry
    assert families.recorded_convention(recorded) == changed
    owner = families.owner(recorded)  # a family is built under the convention, never given it afterwards
    assert owner is not None and owner.from_manifest(recorded, changed).convention is changed
    assert families.from_manifest(manifest).convention == TRANSFORMERS
    assert Manifest.parse({**recorded, "format": manifest["format"]}, "x").convention == changed.record()


def test_the_convention_is_built_once_from_the_settings_by_name(demo_dir):
    """Settings build their convention once (the family the run loads holds that very object, the manifest records
    it): every convention field that is also an encode setting takes the setting's value, found by name, under
    every preset and the default; an option left unset keeps the convention's own value. Control: a settings
    value the convention does not carry (a changed pack size) leaves it as it is."""
    from dataclasses import fields

    from transformers import PreTrainedTokenizerFast

    shared = {f.name for f in fields(Convention)} & {f.name for f in fields(EncodeSettings)}
    assert {"target_newline_after_eot", "media_first", "overlong", "thinking_trace_format"} <= shared
    for preset in (None, *CONVENTIONS):
        settings = EncodeSettings(tokenizer="t", pack_size=1024, preset=preset)
        convention = settings.convention
        assert convention is settings.convention and convention.name == (preset or "transformers")
        assert type(convention) is type(CONVENTIONS.get(preset or "", TRANSFORMERS))
        for name in shared:
            value = getattr(settings, name)
            assert getattr(convention, name) == (value if value is not None or name != "thinking_trace_format"
                                                 else getattr(CONVENTIONS.get(preset or "", TRANSFORMERS), name))
        assert replace(settings, pack_size=2048).convention == convention
    given = EncodeSettings(tokenizer="t", pack_size=1024, overlong="drop", media_first=True, min_pixels=3136)
    made = given.convention
    assert (made.overlong, made.media_first, made.min_pixels) == ("drop", True, 3136)
    settings = EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=1024)
    tok = PreTrainedTokenizerFast.from_pretrained(str(demo_dir / "tokenizer"))
    assert families.load(settings, tok).convention is settings.convention
