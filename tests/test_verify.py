"""``packtool verify``: passes on a good output, names what is wrong in a tampered one."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sqlite3
import tarfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from packtool import verify
from packtool.cli import app
from packtool.format import PackRecord, SplitYaml, write_energon_metadata
from packtool.media.image import open_image
from packtool.shards import index_tar, scan_records, write_tar
from packtool.verify import TokenCheck, verify_output


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


@pytest.mark.parametrize("tail", [TokenCheck.TAIL, 24])
def test_token_check_accepts_every_cut_and_catches_a_changed_token(demo_dir, tail, monkeypatch):
    """A truncated segment may end inside a word or a multi-byte character: no cut is a false alarm, while a
    changed token before the cut still is caught (the last piece found in the whole text or in a short tail)."""
    monkeypatch.setattr(TokenCheck, "TAIL", tail)
    check = TokenCheck(demo_dir / "tokenizer", image_token_id=None)
    text = ("<|im_start|>assistant\nThe quick brown fox 你好，世界！ 👨‍👩‍👧 jumps over naïve café résumé "
            "Привет 1234567 tomorrow<|im_end|>\n")
    ids = np.asarray(check.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)
    cuts = [(f"cut{k}", ids[:k], [], True, True) for k in range(1, len(ids) + 1)]
    assert check.problems(cuts + [("whole", ids, [], False, True)]) == []
    changed = ids.copy()
    changed[len(ids) // 3] = ids[len(ids) // 3 + 1]
    assert len(check.problems([("changed", changed[:-5], [], True, True), ("whole", changed, [], False, True)])) == 2


def test_caps_from_the_manifest_are_checked(copy):
    manifest = json.loads((copy / ".nv-meta/packtool.json").read_text())
    manifest["settings"]["max_segments"] = 1
    (copy / ".nv-meta/packtool.json").write_text(json.dumps(manifest))
    problems = verify_output(copy)
    assert problems and any("segments exceed max_segments 1" in p for p in problems)


def rewrite_first(out: Path, edit) -> str:
    """Apply ``edit(record)`` to the first record for which it returns True, rewrite that shard and Energon's
    metadata to match (so only the edit itself is wrong); return the pack key."""
    splits = SplitYaml.read(out).split_parts
    for shard in (s for ss in splits.values() for s in ss):
        records = [(k, list(members.items())) for k, members in scan_records(out / shard)]
        for i, (key, members) in enumerate(records):
            record = PackRecord.from_members(key, dict(members))
            if edit(record):
                records[i] = (key, record.to_members())
                write_tar(out / shard, records)
                indexes = {s: index_tar(out / s) for ss in splits.values() for s in ss}
                write_energon_metadata(out, splits, indexes, version("megatron-energon"))
                return key
    raise AssertionError("no record to edit")


def test_swapped_image_of_the_same_size_is_caught_by_sha256(copy):
    """Another valid picture of the same pixel size and byte length: only the recorded SHA-256 tells."""
    shard, key, offset, size = part_location(copy, "m0.jpg")
    with open(copy / shard, "rb") as f:
        f.seek(offset)
        original = f.read(size)
    img = open_image(original)
    other = Image.new("RGB", img.size, (200, 30, 90))
    buf = io.BytesIO()
    other.save(buf, format=img.format, quality=50)
    data = buf.getvalue()
    assert len(data) < size
    data += bytes(size - len(data))  # a JPEG decoder stops at its end marker
    open_image(data).load()
    with open(copy / shard, "r+b") as f:
        f.seek(offset)
        f.write(data)
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and "m0.jpg" in problems[0] and "SHA-256" in problems[0], \
        problems


def test_undecodable_media_is_caught(copy):
    """A record written before sizes and digests were recorded still gets every member decoded."""
    member = {}

    def cut(record: PackRecord) -> bool:
        if not record.media_refs:
            return False
        for m in record.media_refs:
            m.sha256, m.size = "", 0
        ref = record.media_refs[-1]
        record.media[ref.member] = record.media[ref.member][: len(record.media[ref.member]) // 2]
        member["name"] = ref.member
        return True

    key = rewrite_first(copy, cut)
    problems = verify_output(copy)
    assert len(problems) == 1, problems
    assert key in problems[0] and member["name"] in problems[0] and "undecodable" in problems[0], problems


def test_grid_that_the_image_rule_does_not_give_is_caught(copy):
    def regrid(record: PackRecord) -> bool:
        if not record.media_refs:
            return False
        ref = record.media_refs[0]
        ref.grid_thw = [1, ref.grid_thw[1] + 2, ref.grid_thw[2]]
        return True

    key = rewrite_first(copy, regrid)
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and "image rule gives grid" in problems[0], problems


def test_workers_find_the_same_problems(copy):
    shard, key, offset, size = part_location(copy, "tokens.npy")
    flip(copy / shard, text_token_offset(copy, shard, offset, size))
    last = list(json.loads((copy / ".nv-meta/.info.json").read_text())["shard_counts"])[-1]
    (copy / f"{last}.idx").write_bytes(b"")
    one = verify_output(copy, workers=1)
    assert any(key in p for p in one) and any(".idx" in p for p in one), one
    assert verify_output(copy, workers=2) == one


def test_ledger_is_streamed_in_batches(copy, monkeypatch):
    """A ledger read a few rows at a time, in many row groups: a good one passes, a changed row in a late batch
    is named."""
    monkeypatch.setattr(verify, "LEDGER_BATCH", 7)
    table = pq.read_table(copy / "ledger.parquet")
    pq.write_table(table, copy / "ledger.parquet", row_group_size=5)
    assert verify_output(copy) == []
    rows = table.to_pylist()
    i = max(j for j, r in enumerate(rows) if r["status"] == "packed")
    rows[i]["targets"] += 1
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), copy / "ledger.parquet", row_group_size=5)
    problems = verify_output(copy)
    assert len(problems) == 1 and rows[i]["pack"] in problems[0] and rows[i]["key"] in problems[0], problems


def test_token_arrays_are_proven_by_their_digest_and_retokenize_checks_the_text(copy):
    """A record rewritten with a changed token and its array digest recomputed (as an encoder bug would write
    it) passes the digest; encoding its text again shows the ids are not the tokenizer's. (The same change under
    the old digest is caught by the digest alone: test_flipped_token_byte_is_caught_without_source.)"""

    def change_token(record: PackRecord) -> bool:
        tokens = record.tokens
        i = int(np.flatnonzero(tokens > 20)[len(tokens) // 3 % max(1, int((tokens > 20).sum()))])
        tokens[i] ^= 1
        return True

    key = rewrite_first(copy, change_token)
    assert not any("token" in p and key in p for p in verify_output(copy))
    assert any(key in p and "encoding of their own text" in p for p in verify_output(copy, retokenize=True))


# -- outputs with videos ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def video_pack(demo_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A source with videos of every form (mp4 and webm members, numbered frame members, a pickled list of encoded
    frames) and an image, packed for the Qwen demo folder: (source, output)."""
    import pickle

    mf = pytest.importorskip("mediafixture")
    from packtool.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    def chat(user: str) -> bytes:
        return json.dumps([{"from": "human", "value": user}, {"from": "gpt", "value": "It moves."}]).encode()

    frames = [mf.make_image(40, 32, seed=i, fmt="JPEG") for i in range(4)]
    samples = {
        "mp4": {"json": chat("<video>What happens?"), "mp4": mf.make_video("mp4", width=64, height=48, frames=6,
                                                                            fps=4)},
        "webm_image": {"json": chat("<image><video>Same?"), "png": mf.make_image(30, 40),
                       "webm": mf.make_video("webm", width=48, height=40, frames=5, fps=5)},
        "numbered": {"json": chat("<video>Frames."), **{f"clip.{i}.jpg": f for i, f in enumerate(frames)}},
        "pickled": {"json": chat("<video>Frames."), "videos": pickle.dumps([frames[::-1]])},
    }
    root = tmp_path_factory.mktemp("video-verify")
    mf.write_source(root / "src", samples)
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, allow_pickle=True),
                            PlanSettings(shard_size="2"))
    pack(root / "src", root / "out", settings, workers=1, progress=False)
    statuses = {r["key"]: r["status"] for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    assert statuses == dict.fromkeys(samples, "packed")
    return root / "src", root / "out"


def test_output_with_videos_passes_verify_with_source(video_pack):
    source, out = video_pack
    assert verify_output(out) == []
    assert verify_output(out, source=source, retokenize=True) == []


def _swap_video_member(out: Path, tmp_path: Path, replace, *, keep_digest: bool) -> tuple[Path, str, str]:
    """A copy of ``out`` whose first video member for which ``replace(ref, record)`` gives ``(member, bytes)`` holds
    those bytes instead; with ``keep_digest`` the record's size and SHA-256 are recomputed (as a packing bug would
    write them), so only the source can tell. Returns the copy, the pack key and the member changed."""
    copy = tmp_path / "out"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".packtool"))
    changed = {}

    def swap(record: PackRecord) -> bool:
        for ref in record.media_refs:
            found = replace(ref, record) if ref.kind == "video" else None
            if found is None:
                continue
            changed["member"], record.media[found[0]] = found
            if keep_digest:
                data = b"".join(record.media[n] for n in ref.members)
                ref.size, ref.sha256 = len(data), hashlib.sha256(data).hexdigest()
            return True
        return False

    key = rewrite_first(copy, swap)
    return copy, key, changed["member"]


def other_mp4(ref, record):
    """The mp4 video encoded again with another codec: same size, frames and rate, other bytes."""
    if not ref.member.endswith(".mp4"):
        return None
    mf = pytest.importorskip("mediafixture")
    return ref.member, mf.make_video("mp4", width=64, height=48, frames=6, fps=4, codec="mpeg4")


def repeated_frame(ref, record):
    """The second frame of a frame list replaced by its first (same size, other bytes)."""
    return (ref.frames[1], record.media[ref.frames[0]]) if ref.frames else None


@pytest.mark.parametrize("replace", [other_mp4, repeated_frame])
@pytest.mark.parametrize("keep_digest", [False, True])
def test_swapped_video_member_is_reported(video_pack, tmp_path, replace, keep_digest):
    source, out = video_pack
    copy, key, member = _swap_video_member(out, tmp_path, replace, keep_digest=keep_digest)
    without = verify_output(copy)
    if keep_digest:
        assert without == [], without
    else:
        assert len(without) == 1 and key in without[0] and "recorded" in without[0], without  # size or SHA-256
    found = [p for p in verify_output(copy, source=source) if p not in without]
    assert len(found) == 1 and key in found[0] and member in found[0] and "differs" in found[0], found


@pytest.mark.parametrize("form", ["member", "frames"])
def test_video_whose_frame_count_is_not_the_recorded_one_is_caught(video_pack, tmp_path, form):
    _, out = video_pack
    copy = tmp_path / "out"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".packtool"))
    changed = {}

    def recount(record: PackRecord) -> bool:
        for ref in record.media_refs:
            if ref.kind == "video" and bool(ref.frames) == (form == "frames"):
                ref.total_frames += 1
                changed["member"] = ref.member
                return True
        return False

    key = rewrite_first(copy, recount)
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and changed["member"] in problems[0], problems
    assert "frames, recorded" in problems[0], problems
