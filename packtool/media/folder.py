"""The processor settings a model folder gives, found the way transformers finds them.

transformers reads each sub-processor's settings from ``processor_config.json`` when it nests them there (the
layout ``save_pretrained`` writes since v5), else from its own file: ``video_preprocessor_config.json`` for the
video processor, falling back to ``preprocessor_config.json`` (so a folder without a video config gives its video
processor the image settings), and ``preprocessor_config.json`` for the image processor and feature extractor.
Top-level keys of ``processor_config.json`` are the processor's own arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from packtool.errors import ConfigError

#: Keys of ``processor_config.json`` that hold a sub-processor's settings rather than a processor argument.
_NESTED = ("image_processor", "video_processor", "feature_extractor", "audio_processor", "tokenizer")
#: File a folder's video settings come from; ``"none"`` when it has none.
VideoSource = Literal["processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json", "none"]


@dataclass(frozen=True)
class FolderConfigs:
    """The settings dictionaries of one model folder, and which file each came from."""

    image: dict = field(default_factory=dict)
    video: dict = field(default_factory=dict)
    audio: dict = field(default_factory=dict)
    #: The processor's own arguments (top level of ``processor_config.json``).
    processor: dict = field(default_factory=dict)
    #: Named special tokens of the tokenizer (``extra_special_tokens`` of ``tokenizer_config.json`` when a dict).
    tokens: dict = field(default_factory=dict)
    #: File the video settings came from; ``"none"`` when the folder has none.
    video_source: VideoSource = "none"


def read_folder(folder: str | Path) -> FolderConfigs:
    """Read the processor settings of ``folder``; a missing file is no error, an unparsable one is."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"model folder {folder} is not a directory")
    processor = _json(folder / "processor_config.json")
    preprocessor = _json(folder / "preprocessor_config.json")
    video_file = _json(folder / "video_preprocessor_config.json")
    video_source: VideoSource
    if "video_processor" in processor:
        video, video_source = processor["video_processor"], "processor_config.json"
    elif video_file:
        video, video_source = video_file, "video_preprocessor_config.json"
    elif preprocessor:
        video, video_source = preprocessor, "preprocessor_config.json"
    else:
        video, video_source = {}, "none"
    if "feature_extractor" in processor:
        audio = processor["feature_extractor"]
    elif "audio_processor" in processor:
        audio = processor["audio_processor"]
    else:
        audio = preprocessor
    extra = _json(folder / "tokenizer_config.json").get("extra_special_tokens")
    return FolderConfigs(
        image=processor["image_processor"] if "image_processor" in processor else preprocessor,
        video=video,
        audio=audio,
        processor={k: v for k, v in processor.items() if k not in _NESTED},
        tokens=dict(extra) if isinstance(extra, dict) else {},
        video_source=video_source,
    )


def _json(path: Path) -> dict:
    """A JSON object file as a dict; ``{}`` when absent."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return value


def _json_quiet(path: Path) -> dict:
    """A JSON object file as a dict; ``{}`` when absent, unreadable or not an object (looked at only for the names it
    states: :func:`read_folder` reports unreadable processor files)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def stated_names(folder: str | Path) -> list[tuple[str, str]]:
    """What a model folder names itself, as ``(what, name)`` pairs: its processor class wherever the folder states
    it, its image and video processors' classes, and ``config.json``'s model type. A family that recognises a
    folder checks every one of them against the names it knows (:func:`unknown_name`), so one family's rule is
    never applied to another model's folder that shares a name with it."""
    folder = Path(folder)
    configs = read_folder(folder)
    stated: list[tuple[str, str]] = []
    for entry in (configs.processor, configs.image, configs.video, _json_quiet(folder / "tokenizer_config.json")):
        if isinstance(entry.get("processor_class"), str):
            stated.append(("processor class", entry["processor_class"]))
    if isinstance(configs.image.get("image_processor_type"), str):
        stated.append(("image processor", configs.image["image_processor_type"]))
    if isinstance(configs.video.get("video_processor_type"), str):
        stated.append(("video processor", configs.video["video_processor_type"]))
    model_type = _json_quiet(folder / "config.json").get("model_type")
    if isinstance(model_type, str):
        stated.append(("model type", model_type))
    return stated


def unknown_name(stated: list[tuple[str, str]], known: Mapping[str, frozenset[str]]) -> str | None:
    """The first stated name (``"what 'name'"``) that ``known`` (names per kind of name) does not list; ``None``
    when every stated name is known."""
    for what, name in stated:
        if what in known and name not in known[what]:
            return f"{what} {name!r}"
    return None
