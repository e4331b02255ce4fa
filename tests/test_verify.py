"""``packtool verify``: passes on a good output, names what is wrong in a tampered one."""

from __future__ import annotations

import io
import json
import shutil
import sqlite3
import tarfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from packtool.cli import app
from packtool.verify import TokenCheck, verify_output
from packtool.shards import write_tar


@pytest.fixture
def copy(packed, tmp_path) -> Path:
    """A private copy of the packed demo output, free to tamper with."""
    out = tmp_path / "out"
    shutil.copytree(packed, out, ignore=shutil.ignore_patterns(".packtool"))
    return out


def first_shard(out: Path) -> str:
    return next(iter(json.loads((out / ".nv-meta/.info.json").read_text())["shard_counts"]))


def part_location(out: Path, part: str, pick=lambda rows: rows[0]) -> tuple[str, str, int, int]:
    """(shard, pack key, content offset, size) of a part, chosen among the records that have it."""
    shards = list(json.loads((out / ".nv-meta/.info.json").read_text())["shard_counts"])
    con = sqlite3.connect(out / ".nv-meta/index.sqlite")
    rows = con.execute("SELECT s.tar_file_id, s.sample_key, p.content_byte_offset, p.content_byte_size FROM "
                       "sample_parts p JOIN samples s ON s.tar_file_id = p.tar_file_id AND "
                       "s.sample_index = p.sample_index WHERE p.part_name = ? ORDER BY 1, 3", (part,)).fetchall()
    con.close()
    fid, key, offset, size = pick(rows)
    return shards[fid], key, offset, size


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def text_token_offset(out: Path, shard: str, offset: int, size: int) -> int:
    """File offset of the low byte of a plain text token (not special, not an image token) in a tokens.npy."""
    with open(out / shard, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    tokens = np.load(io.BytesIO(data))
    header = size - tokens.nbytes
    i = int(np.flatnonzero(tokens > 20)[len(tokens) // 3 % max(1, (tokens > 20).sum())])
    return offset + header + 4 * i


def problems_of(out: Path, **kw) -> str:
    problems = verify_output(out, **kw)
    return "\n".join(problems)


def test_good_output_passes_with_and_without_source(packed, demo_dir):
    assert verify_output(packed) == []
    assert verify_output(packed, source=demo_dir / "dataset") == []
    result = CliRunner().invoke(app, ["verify", str(packed), "--source", str(demo_dir / "dataset")])
    assert result.exit_code == 0 and "ok" in result.output


def test_flipped_token_byte_is_caught_without_source(copy):
    shard, key, offset, size = part_location(copy, "tokens.npy")
    flip(copy / shard, text_token_offset(copy, shard, offset, size))
    found = problems_of(copy)
    assert key in found and "token" in found, found


def test_token_outside_the_vocabulary_is_caught(copy):
    shard, key, offset, size = part_location(copy, "tokens.npy")
    flip(copy / shard, text_token_offset(copy, shard, offset, size) + 2, mask=0x40)
    found = problems_of(copy)
    assert key in found and "vocabulary" in found, found


def test_flipped_target_is_caught_without_source(copy):
    shard, key, offset, size = part_location(copy, "targets.npy")
    flip(copy / shard, offset + size - 1)  # the last target flag of the pack
    found = problems_of(copy)
    assert key in found and "targets" in found, found


def test_missing_record_is_caught(copy):
    shard = first_shard(copy)
    with tarfile.open(copy / shard) as tar:
        records: dict[str, list] = {}
        for m in tar:
            key, _, part = m.name.partition(".")
            records.setdefault(key, []).append((part, tar.extractfile(m).read()))
    dropped = list(records)[1]
    del records[dropped]
    write_tar(copy / shard, list(records.items()))  # rewrites .tar.idx too; .info.json and sqlite stay as they are
    found = problems_of(copy)
    assert ".info.json" in found and dropped in found, found
    result = CliRunner().invoke(app, ["verify", str(copy)])
    assert result.exit_code == 1 and dropped in result.output


def test_wrong_info_json_count_is_caught(copy):
    info_path = copy / ".nv-meta/.info.json"
    info = json.loads(info_path.read_text())
    shard = first_shard(copy)
    info["shard_counts"][shard] += 1
    info_path.write_text(json.dumps(info))
    found = problems_of(copy)
    assert shard in found and ".info.json" in found, found


def test_changed_media_byte_is_caught_with_source(copy, demo_dir):
    shard, key, offset, size = part_location(copy, "m0.jpg", pick=lambda rows: rows[len(rows) // 2])
    flip(copy / shard, offset + size // 2)
    found = problems_of(copy, source=demo_dir / "dataset")
    assert key in found and "m0.jpg" in found and "differs" in found, found


def test_broken_idx_is_caught(copy):
    shard = first_shard(copy)
    idx = copy / (shard + ".idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    found = problems_of(copy)
    assert f"{shard}.idx" in found, found


def test_missing_metadata_is_reported_not_raised(copy):
    (copy / ".nv-meta/split.yaml").unlink()
    assert verify_output(copy) == [".nv-meta/split.yaml: missing"]
    result = CliRunner().invoke(app, ["verify", str(copy)])
    assert result.exit_code == 1 and "split.yaml: missing" in result.output


def test_token_check_accepts_every_cut_and_catches_a_changed_token(demo_dir):
    """A truncated segment may end inside a word or a multi-byte character: no cut is a false alarm, while a
    changed token before the cut still is caught."""
    check = TokenCheck(demo_dir / "tokenizer", image_token_id=None)
    text = ("<|im_start|>assistant\nThe quick brown fox 你好，世界！ 👨‍👩‍👧 jumps over naïve café résumé "
            "Привет 1234567 tomorrow<|im_end|>\n")
    ids = np.asarray(check.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
    cuts = [(f"cut{k}", ids[:k], [], True) for k in range(1, len(ids) + 1)]
    assert check.problems(cuts + [("whole", ids, [], False)]) == []
    changed = ids.copy()
    changed[len(ids) // 3] = ids[len(ids) // 3 + 1]
    assert len(check.problems([("changed", changed[:-5], [], True), ("whole", changed, [], False)])) == 2


def test_caps_from_the_manifest_are_checked(copy):
    manifest = json.loads((copy / ".nv-meta/packtool.json").read_text())
    manifest["settings"]["max_segments"] = 1
    (copy / ".nv-meta/packtool.json").write_text(json.dumps(manifest))
    problems = verify_output(copy)
    assert problems and any("segments exceed max_segments 1" in p for p in problems)
