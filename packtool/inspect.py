"""`packtool inspect`: one pack of a packed dataset, rendered for a human.

Segments with their source keys and shards, the decoded text with training targets wrapped in ⟦ ⟧ and runs of the
image placeholder collapsed to `<|image_pad|>×N`, and the media (member, bytes, width×height, grid, tokens).
Needs only OUTPUT: the tokenizer copy in `.nv-meta/tokenizer` and the manifest.
"""

from __future__ import annotations

import io
import json
from itertools import groupby
from pathlib import Path

import numpy as np
import yaml

from packtool.read import iter_records, load_manifest, record_offsets, split_shards

OPEN, CLOSE = "⟦", "⟧"


def find_pack(path: str | Path, key: str | None = None, split: str | None = None) -> tuple[str, Path, dict]:
    """(key, shard, members) of pack `key`, or of the first pack of `split` (default: the first split)."""
    parts = yaml.safe_load((Path(path) / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    splits = [split] if split is not None else list(parts)
    for name in splits:
        for shard in split_shards(path, name):
            if key is None:
                found, members = next(iter_records(shard))
                return found, shard, members
            index = _record_index(shard, key)
            if index is not None:
                found, members = next(iter_records(shard, iter([index])))
                return found, shard, members
    raise KeyError(f"no pack {key!r} in split(s) {splits}" if key else f"no packs in split(s) {splits}")


def _record_index(shard: Path, key: str) -> int | None:
    """Index of the record whose first member is `key.*`, reading one tar header per record."""
    with open(shard, "rb") as f:
        for i, offset in enumerate(record_offsets(shard)[:-1]):
            f.seek(offset)
            name = f.read(100).split(b"\0", 1)[0].decode()
            if name.rpartition("/")[2].partition(".")[0] == key.rpartition("/")[2]:
                return i
    return None


def inspect_pack(path: str | Path, key: str | None = None, split: str | None = None) -> str:
    """Human-readable rendering of one pack (the first one when `key` is None)."""
    from tokenizers import Tokenizer

    manifest = load_manifest(path)
    found, shard, members = find_pack(path, key, split)
    tok_dir = Path(path) / manifest.get("tokenizer", {}).get("dir", ".nv-meta/tokenizer")
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    meta = json.loads(members["json"])
    tokens = np.load(io.BytesIO(members["tokens.npy"]), allow_pickle=False)
    targets = np.load(io.BytesIO(members["targets.npy"]), allow_pickle=False)
    seqlens = np.load(io.BytesIO(members["seqlens.npy"]), allow_pickle=False)
    align = meta["align"]
    aligned = int((-(-seqlens // align) * align).sum())
    n_media = sum(len(s["media"]) for s in meta["segments"])
    image_token = manifest.get("image_token_id")
    lines = [
        f"pack {found}  ({Path(shard).relative_to(path)})",
        f"pack_size {meta['pack_size']}  align {align}  segments {len(seqlens)}  tokens {len(tokens)} "
        f"(aligned {aligned}, fill {aligned / meta['pack_size']:.1%})  targets {int(targets.sum())}  media {n_media}",
    ]
    starts = np.concatenate([[0], np.cumsum(seqlens)])
    for i, seg in enumerate(meta["segments"]):
        a, b = int(starts[i]), int(starts[i + 1])
        trunc = "  TRUNCATED" if seg.get("truncated") else ""
        lines += ["", f"[{i}] {seg['key']}  (shard {seg['shard']}, split {seg['split']})  tokens {b - a}  "
                      f"targets {int(targets[a:b].sum())}{trunc}"]
        for m in seg["media"]:
            lines.append(f"    {m['member']}  {m['kind']}  {len(members[m['member']])} bytes  {m['width']}×{m['height']}"
                         f"  grid {m['grid_thw']}  {m['tokens']} tokens at +{m['token_offset']}")
        text = render_text(tokenizer, tokens[a:b], targets[a:b], image_token).rstrip("\n")
        lines.append("    " + text.replace("\n", "\n    "))
    return "\n".join(lines)


def render_text(tokenizer, tokens: np.ndarray, targets: np.ndarray, image_token: int | None) -> str:
    """Decode runs of equal target flag; target runs wrapped in ⟦ ⟧, image placeholder runs collapsed."""
    out = []
    for is_target, run in groupby(zip(tokens.tolist(), targets.tolist()), key=lambda x: bool(x[1])):
        text = []
        for is_image, ids in groupby((t for t, _ in run), key=lambda t: t == image_token):
            ids = list(ids)
            if is_image:
                text.append(f"{tokenizer.id_to_token(image_token)}×{len(ids)}")
            else:
                text.append(tokenizer.decode(ids, skip_special_tokens=False))
        joined = "".join(text)
        out.append(f"{OPEN}{joined}{CLOSE}" if is_target else joined)
    return "".join(out)
