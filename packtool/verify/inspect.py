"""`packtool inspect`: one pack of a packed dataset, rendered for a human.

Segments with their source keys and shards, the decoded text with training targets wrapped in ⟦ ⟧ and runs of the
image placeholder collapsed to `<|image_pad|>×N`, and the media (member, bytes, width×height, grid, tokens).
Needs only OUTPUT: the tokenizer copy in `.nv-meta/tokenizer` and the manifest.
"""

from __future__ import annotations

import re
import sqlite3
from itertools import groupby
from pathlib import Path

import numpy as np

from packtool.errors import FormatError
from packtool.format import META, InfoJson, PackRecord, SplitYaml, aligned_lengths, in_split, load_manifest
from packtool.shards import iter_records
from packtool.storage import local_copy, location

OPEN, CLOSE = "⟦", "⟧"
#: Characters a terminal acts on (C0 and C1 controls, DEL, bidirectional overrides and isolates); inspect shows
#: them escaped (``\x1b``), so a sample's text cannot move the cursor, recolour or reorder what is printed.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every terminal control character but newline and tab written as an escape."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def find_pack(path: str | Path, key: str | None = None, split: str | None = None) -> tuple[str, Path, dict]:
    """(key, shard, members) of pack ``key`` (looked up in ``index.sqlite``), or of the first pack of ``split``
    (default: the first split)."""
    root = location(path)
    splits = SplitYaml.read(root)
    names = [split] if split is not None else list(splits.split_parts)
    if key is None:
        for name in names:
            for shard in splits.shards(name):
                for found, members in iter_records(root / shard):
                    return found, root / shard, members
        raise FormatError(f"no packs in split(s) {names}")
    hit = _lookup(root, key)
    if hit is None or (split is not None and not in_split(key, split)):
        raise FormatError(f"no pack {key!r} in split(s) {names}")
    shard, index = hit
    found, members = next(iter_records(root / shard, [index]))
    return found, root / shard, members


def _lookup(root: Path, key: str) -> tuple[str, int] | None:
    """(shard, record index) of pack ``key`` through Energon's sample index (one indexed query)."""
    shards = list(InfoJson.read(root).shard_counts)
    con = sqlite3.connect(f"file:{local_copy(root / META / 'index.sqlite')}?mode=ro", uri=True)
    try:
        hit = con.execute("SELECT tar_file_id, sample_index FROM samples WHERE sample_key=?", (key,)).fetchone()
    except sqlite3.Error as exc:
        raise FormatError(f"{root / META / 'index.sqlite'}: unreadable ({exc})") from None
    finally:
        con.close()
    return None if hit is None else (shards[hit[0]], int(hit[1]))


def inspect_pack(path: str | Path, key: str | None = None, split: str | None = None) -> str:
    """Human-readable rendering of one pack (the first one when ``key`` is None)."""
    from tokenizers import Tokenizer

    manifest = load_manifest(path)
    found, shard, members = find_pack(path, key, split)
    record = PackRecord.from_members(found, members)
    tokenizer = Tokenizer.from_file(str(local_copy(location(path) / manifest.tokenizer.get("dir", f"{META}/tokenizer")
                                                   / "tokenizer.json")))
    tokens, targets, seqlens, align = record.tokens, record.targets, record.seqlens, record.align
    aligned = int(aligned_lengths(seqlens, align).sum())
    lines = [
        f"pack {found}  ({shard.relative_to(location(path))})",
        f"pack_size {record.pack_size}  align {align}  segments {len(seqlens)}  tokens {len(tokens)} "
        f"(aligned {aligned}, fill {aligned / record.pack_size:.1%})  targets {int(targets.sum())}  "
        f"media {len(record.media_refs)}",
    ]
    starts = record.segment_starts()
    for i, seg in enumerate(record.segments):
        a, b = int(starts[i]), int(starts[i + 1])
        trunc = "  TRUNCATED" if seg.truncated else ""
        lines += ["", printable(f"[{i}] {seg.key}  (shard {seg.shard}, split {seg.split})  tokens {b - a}  "
                                f"targets {int(targets[a:b].sum())}{trunc}")]
        for m in seg.media:
            lines.append(f"    {printable(m.member)}  {m.kind}  {len(record.media[m.member])} bytes  "
                         f"{m.width}×{m.height}  grid {m.grid_thw}  {m.tokens} tokens at +{m.token_offset}")
        text = printable(render_text(tokenizer, tokens[a:b], targets[a:b], manifest.image_token_id).rstrip("\n"))
        lines.append("    " + text.replace("\n", "\n    "))
    return "\n".join(lines)


def render_text(tokenizer, tokens: np.ndarray, targets: np.ndarray, image_token: int | None) -> str:
    """Decode runs of equal target flag; target runs wrapped in ⟦ ⟧, image placeholder runs collapsed."""
    out = []
    for is_target, run in groupby(zip(tokens.tolist(), targets.tolist()), key=lambda x: bool(x[1])):
        text = []
        for is_image, group in groupby((t for t, _ in run), key=lambda t: t == image_token):
            ids = list(group)
            if is_image:
                text.append(f"{tokenizer.id_to_token(image_token)}×{len(ids)}")
            else:
                text.append(tokenizer.decode(ids, skip_special_tokens=False))
        joined = "".join(text)
        out.append(f"{OPEN}{joined}{CLOSE}" if is_target else joined)
    return "".join(out)
