"""The Python entry point of a pack run: :func:`pack` takes the settings by their names (those of a config file,
:data:`packtool.config.KEYS`) and returns a :class:`PackSummary`.

>>> import packtool
>>> summary = packtool.pack("data/llava.json", "packed", tokenizer="Qwen/Qwen2.5-VL-3B-Instruct",
...                         pack_size=8192, media_dir="data/images")  # doctest: +SKIP
>>> summary.splits["train"].packs  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SplitSummary:
    """What a run made of one split."""

    samples: int
    packed: int
    truncated: int
    dropped: int
    error: int
    packs: int


@dataclass(frozen=True)
class PackSummary:
    """What a run did."""

    output: Path
    #: The source that was packed (an Energon dataset, or a JSON/Parquet file or folder, read in place).
    source: Path
    splits: dict[str, SplitSummary]
    #: Seconds per stage of this call (empty when the output was already complete).
    seconds: dict[str, float] = field(default_factory=dict)
    #: The run's settings as a config file holds them (what ``packtool inspect OUTPUT --config`` prints).
    config: dict = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        total = sum(s.samples for s in self.splits.values())
        return sum(s.error for s in self.splits.values()) / total if total else 0.0


def pack(source: str | Path, output: str | Path, *, config: str | Path | None = None,
         **settings: Any) -> PackSummary:
    """Pack ``source`` (an Energon dataset, JSON/JSONL conversations, Parquet files or a ``save_to_disk`` folder)
    into ``output``, as ``packtool pack`` does. ``settings`` are the keys of a config file (``tokenizer``,
    ``pack_size``, ``media_dir``, ``preset``, ``workers``...); ``config`` a YAML file of them, which ``settings``
    override. Raises :class:`~packtool.errors.PacktoolError` with a one-line message for anything a user can
    cause."""
    from packtool.errors import StoreError
    from packtool.storage import object_store_error

    try:
        return _pack(source, output, config, settings)
    except Exception as exc:
        message = object_store_error(exc)
        if message is None:
            raise
        raise StoreError(message) from None


def _pack(source: str | Path, output: str | Path, config: str | Path | None, settings: dict[str, Any]) -> PackSummary:
    from packtool import config as cfg
    from packtool.packer.pipeline import pack as run_pack
    from packtool.packer.sources.files import resolve_source

    file = cfg.read(config) if config is not None else None
    explicit = {"source": str(source), "output": str(output), **settings}
    values, given = cfg.merge(file, explicit)
    run = cfg.build(values, given, cfg.origins(file, explicit, config))
    src = resolve_source(run.source, media_dir=run.media_dir, absolute_media_paths=run.absolute_media_paths)
    result = run_pack(src, run.output, run.settings, run.options)
    splits = {name: SplitSummary(c["samples"], c["packed"], c["truncated"], c["dropped"], c["error"],
                                 result.packs.get(name, 0)) for name, c in result.counts.items()}
    return PackSummary(result.output, Path(run.source).resolve(), splits, dict(result.seconds), run.config)
