"""A model id (``Qwen/Qwen2.5-VL-3B-Instruct``) resolved to its folder in the local Hugging Face cache.

Only the cache is read, never the network: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (where ``huggingface_hub`` puts a model it
downloads). The snapshot is the one ``refs/main`` names (or ``refs/<revision>`` for ``org/name@revision``); a
cache holding a single snapshot and no ref uses that one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from packtool.errors import ConfigError

_MODEL_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w./-]+)?")


def hub_cache() -> Path:
    """The hub cache folder the environment names (it need not exist)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def resolve_model(value: str | Path) -> Path:
    """``value`` as a model folder: an existing folder as it is; otherwise a model id looked up in the local
    cache. Raises :class:`ConfigError` naming where it looked."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path.resolve()
    text = str(value)
    if path.exists() or not _MODEL_ID.fullmatch(text) or text.startswith((".", "/")):
        raise ConfigError(f"tokenizer folder {path} does not exist")
    model, _, revision = text.partition("@")
    cache = hub_cache()
    repo = cache / ("models--" + model.replace("/", "--"))
    snapshot = _snapshot(repo, revision or "main")
    if snapshot is None:
        raise ConfigError(f"tokenizer {text!r} is neither a folder nor a Hugging Face model id in the local "
                          f"Hugging Face cache (looked for {repo}; set HF_HUB_CACHE or HF_HOME, or download it first: "
                          f"`hf download {model}`, then pass its id or the folder it prints)")
    return snapshot.resolve()


def _snapshot(repo: Path, revision: str) -> Path | None:
    snapshots = repo / "snapshots"
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
        return snapshots / commit if (snapshots / commit).is_dir() else None
    if (snapshots / revision).is_dir():  # a commit hash given as the revision
        return snapshots / revision
    found = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    return found[0] if len(found) == 1 and revision == "main" else None


def model_id_of(folder: str | Path | None) -> str | None:
    """The model id whose local hub-cache snapshot ``folder`` is (``org/name``, with ``@commit`` when the cache's
    ``main`` does not point at it), so a config written from a run names the model as a user gives it; None for
    any other folder (or a hub cache elsewhere)."""
    if not folder:
        return None
    path = Path(folder).expanduser()
    cache = hub_cache().expanduser()
    try:
        rel = path.resolve().relative_to(cache.resolve())
    except (OSError, ValueError):
        return None
    parts = rel.parts
    if len(parts) != 3 or not parts[0].startswith("models--") or parts[1] != "snapshots":
        return None
    model = parts[0][len("models--"):].replace("--", "/")
    if not _MODEL_ID.fullmatch(model) or resolve_model_quiet(model) != path.resolve():
        return f"{model}@{parts[2]}"
    return model


def resolve_model_quiet(model: str) -> Path | None:
    """:func:`resolve_model` of ``model``, or None where it finds none."""
    try:
        return resolve_model(model)
    except ConfigError:
        return None
