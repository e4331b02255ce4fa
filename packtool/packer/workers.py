"""The worker processes of a ``pack`` run. They can be started before the parent imports anything heavy (the
command line does), so their start-ups — an interpreter each, transformers, the tokenizer — overlap the parent's
own imports and its reading of the source. The functions here run in the workers and import the encoder there:
the parent never needs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packtool.packer.engine import Engine
from packtool.settings import EncodeSettings, RunOptions
from packtool.storage import fetched, resolved


def pack_engine(source: str | Path, settings: EncodeSettings, run: RunOptions) -> Engine:
    """The engine for packing ``source`` with these settings (not yet entered): every worker builds its encoder
    as it starts (:func:`warm`). Local workers divide this machine's cores among their video decoders
    (each decoder starting a thread per core made two workers barely faster than one); Ray workers, on machines
    this one cannot see, leave it to FFmpeg."""
    from packtool.media.video import decoder_threads_for

    threads = decoder_threads_for(run.workers) if run.engine == "local" else 0
    return Engine(run.engine, run.workers, run.ray_address, initializer=warm,
                  initargs=(settings, str(resolved(source)), threads), import_main=False)


@dataclass(frozen=True)
class FactsTask:
    """The task that reads the model folder's facts: the encode settings and the source's dataset.yaml."""

    settings: EncodeSettings
    dataset_yaml: dict


def model_facts(task: FactsTask) -> dict:
    """What the manifest records of the model folder, from a worker's encoder (the parent never imports the
    encoder: :func:`packtool.packer.encoder.model_facts`)."""
    from packtool.packer.encoder import model_facts as facts

    return facts(fetched(task.settings), task.dataset_yaml)


def warm(settings: EncodeSettings, source: str, decoder_threads: int = 0) -> None:
    """Build this worker's encoder as it starts (the workers' start-ups overlap). A model folder or source that
    does not open is left to the run to report, as its own error. ``decoder_threads`` is what this worker's video
    decode checks use (:func:`packtool.media.video.set_decoder_threads`)."""
    import multiprocessing

    from packtool.media.video import set_decoder_threads
    from packtool.storage import own_process

    if multiprocessing.parent_process() is not None:  # a pool worker: packtool's own process
        own_process()
    set_decoder_threads(decoder_threads)
    try:
        from packtool.packer.encoder import get_encoder
        from packtool.packer.sources.energon import read_dataset_yaml

        get_encoder(settings, read_dataset_yaml(source))
    except Exception:
        pass
