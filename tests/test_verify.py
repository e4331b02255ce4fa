"""``packtool verify``: passes on a good output, names what is wrong in a tampered one."""

from __future__ import annotations

import dataclasses
import functools
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

from packtool.cli import app
from packtool.format import PackRecord, SplitYaml, write_energon_metadata
from packtool.media.image import open_image
from packtool.shards import index_tar, scan_records, write_tar
from packtool.verify import packs as verify
from packtool.verify.packs import TokenCheck, verify_output


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
    check = TokenCheck(demo_dir / "tokenizer", expanded_in_ids=True)
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


def _edited(out: Path, tmp_path: Path, edit) -> tuple[Path, str, dict]:
    """A copy of ``out`` with ``edit(ref, record, changed)`` applied to the first media item it returns True for."""
    copy = tmp_path / "out"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".packtool"))
    changed: dict = {}

    def first(record: PackRecord) -> bool:
        return any(edit(ref, record, changed) for ref in record.media_refs)

    return copy, rewrite_first(copy, first), changed


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
    from packtool.packer.pipeline import pack
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


def test_video_bytes_are_checked_against_the_encoded_sha256_when_the_pack_is_written(video_pack, demo_dir, tmp_path):
    """The encoder records the SHA-256 of each video's bytes it measured; the writer checks the bytes it packs
    against it (here the encode store says other bytes were measured for one video of each form): a one-line
    error naming the sample and member, and no pack."""
    from packtool.errors import SourceError
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings

    source, _ = video_pack
    settings = PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, allow_pickle=True),
                            PlanSettings(shard_size="2"))
    for form in ("mp4", "numbered", "pickled"):
        out = tmp_path / form
        pack(source, out, settings, workers=1, progress=False, dry_run=True)
        [store] = {p.parent for p in (out / ".packtool").rglob("samples.parquet")}
        table = pq.read_table(store / "samples.parquet")
        rows = table.to_pylist()
        for r in rows:
            media = json.loads(r["media"])
            videos = [m for m in media if m["kind"] == "video"]
            if r["key"] == form:
                assert len(videos) == 1 and len(videos[0]["sha256"]) == 64
                videos[0]["sha256"] = "0" * 64
                r["media"] = json.dumps(media, separators=(",", ":"))
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), store / "samples.parquet")
        with pytest.raises(SourceError, match=f"sample {form} differ from those encoded"):
            pack(source, out, settings, workers=1, progress=False)
        assert not list(out.rglob("*.tar")), "a pack was written with bytes other than those encoded"


def _swap_video_member(out: Path, tmp_path: Path, replace, *, keep_digest: bool) -> tuple[Path, str, str]:
    """A copy of ``out`` whose first video member for which ``replace(ref, record)`` gives ``(member, bytes)`` holds
    those bytes instead; with ``keep_digest`` the record's size and SHA-256 are recomputed (as a packing bug would
    write them), so only the source can tell. Returns the copy, the pack key and the member changed."""
    def swap(ref, record: PackRecord, changed: dict) -> bool:
        found = replace(ref, record) if ref.kind == "video" else None
        if found is None:
            return False
        changed["member"], record.media[found[0]] = found
        if keep_digest:
            data = b"".join(record.media[n] for n in ref.members)
            ref.size, ref.sha256 = len(data), hashlib.sha256(data).hexdigest()
        return True

    copy, key, changed = _edited(out, tmp_path, swap)
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

    def recount(ref, record: PackRecord, changed: dict) -> bool:
        if ref.kind != "video" or bool(ref.frames) != (form == "frames"):
            return False
        ref.total_frames += 1
        changed["member"] = ref.member
        return True

    copy, key, changed = _edited(out, tmp_path, recount)
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and changed["member"] in problems[0], problems
    assert "frames, recorded" in problems[0], problems


@pytest.mark.parametrize("field", ["grid", "seconds"])
def test_qwen_video_grid_that_the_video_rule_does_not_give_is_caught(video_pack, tmp_path, field):
    """The video's grid (or its seconds per grid) re-derived from the manifest's video settings and the video."""
    source, out = video_pack

    def regrid(ref, record: PackRecord, changed: dict) -> bool:
        if ref.kind != "video":
            return False
        if field == "grid":
            ref.grid_thw = [ref.grid_thw[0], ref.grid_thw[1] + 2, ref.grid_thw[2]]
        else:
            ref.second_per_grid_ts = (ref.second_per_grid_ts or 1.0) * 2
        changed["member"] = ref.member
        return True

    copy, key, changed = _edited(out, tmp_path, regrid)
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and changed["member"] in problems[0], problems
    assert "video rule gives" in problems[0], problems
    if field == "grid":
        fresh = [p for p in verify_output(copy, source=source) if p not in problems]
        assert len(fresh) == 1 and "grid_thw differ from a fresh encoding" in fresh[0], fresh


# -- Nemotron Omni and the processor mode -----------------------------------------------------------------------------
NEMOTRON_KEYS = ("image_audio", "two_images", "mp4", "frames", "mkv_image_mp3", "second_turn_audio", "text_only")


@pytest.fixture(scope="module")
def nemotron_pack(tmp_path_factory) -> tuple[Path, Path]:
    """Nemotron Omni samples with images, videos (members, a frame list) and audio (wav, mp3), alone and mixed,
    several to a pack, packed for the offline model folder: (source, output)."""
    import nemotron_omni_model
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings
    from test_media_pack import write_source
    from test_nemotron_pack import SAMPLES, source_sample

    root = tmp_path_factory.mktemp("nemotron-verify")
    folder = nemotron_omni_model.write_model_folder(root / "model")
    write_source(root / "src", {k: source_sample(*SAMPLES[k])[0] for k in NEMOTRON_KEYS})
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=16384), PlanSettings(shard_size="2"))
    pack(root / "src", root / "out", settings, workers=1, progress=False)
    statuses = {r["key"]: r["status"] for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    assert statuses == dict.fromkeys(NEMOTRON_KEYS, "packed")
    return root / "src", root / "out"


def test_nemotron_output_passes_verify_with_source(nemotron_pack):
    source, out = nemotron_pack
    kinds = {m.kind for _, members in _records(out) for m in PackRecord.from_members("k", members).media_refs}
    assert kinds == {"image", "video", "audio"}
    assert verify_output(out) == []
    assert verify_output(out, source=source, retokenize=True) == []
    result = CliRunner().invoke(app, ["verify", str(out), "--source", str(source), "--retokenize"])
    assert result.exit_code == 0, result.output


def _records(out: Path):
    for shard in (s for ss in SplitYaml.read(out).split_parts.values() for s in ss):
        yield from scan_records(out / shard)


def swap_audio(ref, record, changed, *, keep_digest: bool) -> bool:
    """The wav clip replaced by a longer one (another valid clip); with ``keep_digest`` its size and SHA-256 are
    recomputed, as a packing bug would write them."""
    if ref.kind != "audio" or not ref.member.endswith(".wav"):
        return False
    mf = pytest.importorskip("mediafixture")
    record.media[ref.member] = data = mf.make_audio("wav", samples=24000, rate=16000, channels=1)
    if keep_digest:
        ref.size, ref.sha256 = len(data), hashlib.sha256(data).hexdigest()
    changed["member"] = ref.member
    return True


def wrong_samples(ref, record, changed) -> bool:
    if ref.kind != "audio":
        return False
    ref.samples += 1
    changed["member"] = ref.member
    return True


def wrong_image_grid(ref, record, changed) -> bool:
    if ref.kind != "image":
        return False
    ref.grid_thw = [1, ref.grid_thw[1] + 2, ref.grid_thw[2]]
    changed["member"] = ref.member
    return True


def wrong_video_tile(ref, record, changed) -> bool:
    if ref.kind != "video":
        return False
    ref.grid_thw = [ref.grid_thw[0], ref.grid_thw[1] + 2, ref.grid_thw[2] - 2]
    changed["member"] = ref.member
    return True


@pytest.mark.parametrize(("edit", "without", "fresh"), [
    (functools.partial(swap_audio, keep_digest=False), "bytes, recorded", "differs from source member"),
    (functools.partial(swap_audio, keep_digest=True), "audio rule gives", "differs from source member"),
    (wrong_samples, "audio rule gives", "samples differ from a fresh encoding"),
    (wrong_image_grid, "image rule gives grid", "grid_thw differ from a fresh encoding"),
    (wrong_video_tile, "video rule gives", "grid_thw differ from a fresh encoding"),
])
def test_broken_nemotron_media_is_caught(nemotron_pack, tmp_path, edit, without, fresh):
    source, out = nemotron_pack
    copy, key, changed = _edited(out, tmp_path, edit)
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and changed["member"] in problems[0], problems
    assert without in problems[0], problems
    found = [p for p in verify_output(copy, source=source) if p not in problems]
    assert len(found) == 1 and changed["member"] in found[0] and fresh in found[0], found


def test_nemotron_span_that_misses_a_video_chunk_is_caught(nemotron_pack, tmp_path):
    """A video's span ending before its last chunk (frame label, ``<img>``, placeholders, ``</img>``) no longer
    holds its placeholders, though its first placeholder and count are right."""
    source, out = nemotron_pack

    def cut_span(ref, record, changed) -> bool:
        if ref.kind != "video" or ref.grid_thw[0] < 3:  # two chunks at least
            return False
        seg = next(s for s in record.segments if ref in s.media)
        start = record.segment_starts()[record.segments.index(seg)]
        tokens = record.tokens[start + ref.span[0]: start + ref.span[1]]
        last = int(np.flatnonzero(tokens == tokens[ref.token_offset - ref.span[0]])[-1])
        ref.span = [ref.span[0], ref.span[0] + last]
        changed["member"] = ref.member
        return True

    copy, key, changed = _edited(out, tmp_path, cut_span)
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and changed["member"] in problems[0], problems
    assert "does not match its video tokens" in problems[0], problems


@pytest.fixture(scope="module")
def llava_pack(tmp_path_factory) -> tuple[Path, Path]:
    """The processor mode: a LLaVA folder's own processor expands ``<image>`` (two samples, one pack)."""
    pytest.importorskip("torchvision")
    mf = pytest.importorskip("mediafixture")
    import nemotron_omni_model
    from packtool.packer.pipeline import pack
    from packtool.settings import EncodeSettings, PackSettings, PlanSettings
    from test_media_pack import llava_folder, write_source

    root = tmp_path_factory.mktemp("llava-verify")
    folder = llava_folder(root / "model", nemotron_omni_model.write_model_folder(root / "nemotron"))

    def sample(turns: list[str], sizes: list[tuple[int, int]]) -> dict[str, bytes]:
        roles = ["human", "gpt"] * len(turns)
        members = {"json": json.dumps({"conversations": [{"from": r, "value": t}
                                                         for r, t in zip(roles, turns)]}).encode()}
        return {**members, **{f"{i}.png": mf.make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)}}

    write_source(root / "src", {"one": sample(["<image>What is it?", "a picture"], [(40, 30)]),
                                "adjacent": sample(["<image><image>Which?", "the left one"], [(64, 64), (20, 50)])})
    settings = PackSettings(EncodeSettings(tokenizer=str(folder), pack_size=4096, media_tokens="processor"),
                            PlanSettings(shard_size="4"))
    pack(root / "src", root / "out", settings, workers=1, progress=False)
    statuses = {r["key"]: r["status"] for r in pq.read_table(root / "out/ledger.parquet").to_pylist()}
    assert statuses == {"one": "packed", "adjacent": "packed"}
    return root / "src", root / "out"


def test_processor_mode_output_passes_verify_with_source(llava_pack, tmp_path):
    source, out = llava_pack
    assert verify_output(out) == []
    assert verify_output(out, source=source, retokenize=True) == []
    copy, key, changed = _edited(out, tmp_path, lambda ref, record, changed: bool(
        ref.span and changed.setdefault("member", ref.member) and ref.span.__setitem__(1, ref.span[1] - 2) is None))
    problems = verify_output(copy)
    assert len(problems) == 1 and key in problems[0] and changed["member"] in problems[0], problems


def test_truncated_segment_image_may_keep_the_grid_of_its_whole_sample(tmp_path):
    """Nemotron Omni's image budget depends on the sample's image count; a cut that dropped images leaves the
    segment with fewer, so a truncated segment's image also passes with a larger count's grid, and only then."""
    import nemotron_omni_model
    from packtool.families.base import manifest_tokens
    from packtool.families.conventions import TRANSFORMERS
    from packtool.families.nemotron_omni import NemotronOmni, NemotronOmniSettings
    from packtool.format import MediaRef, sha256

    mf = pytest.importorskip("mediafixture")
    folder = nemotron_omni_model.write_model_folder(tmp_path / "model")
    # A short context: the budget is then the image count's (min_num_patches per image).
    rule = dataclasses.replace(NemotronOmniSettings.from_folder(folder), max_model_len=260)
    data = mf.make_image(2000, 1500, seed=0)
    alone, of_three = rule.image_grid(2000, 1500, n_images=1), rule.image_grid(2000, 1500, n_images=3)
    assert alone != of_three  # the budget of three images is larger

    def problems(grid: tuple[int, int], truncated: bool) -> list[str]:
        ref = MediaRef("m0.png", "image", 0, grid[0] * grid[1] // 4, [1, *grid], 2000, 1500, len(data), sha256(data))
        family = NemotronOmni(manifest_tokens({}), TRANSFORMERS, "", rule)
        return verify.check_media("m0.png", ref, [data], family, 1 << 40, n_images=1,
                                  truncated=truncated)

    assert problems(alone, truncated=False) == [] and problems(alone, truncated=True) == []
    assert problems(of_three, truncated=True) == []
    assert "image rule gives grid" in problems(of_three, truncated=False)[0]
    wrong = (of_three[0] + 2, of_three[1])
    assert "image rule gives grid" in problems(wrong, truncated=True)[0]


# -- the format's rules have one owner ------------------------------------------------------------------------
def test_pack_key_and_row_length_rules_have_one_owner():
    """The format's names module writes the pack-key rule (key from number, numbers back from keys, the split a
    key belongs to) and the row-length rule (aligned lengths, the row of a full pack); the writer, ledger, stats,
    verify, inspect, reader, settings and planner call them instead of their own copies (a split ``train-x``
    shares no packs with ``train``)."""
    import re

    from packtool.format import aligned_lengths, in_split, pack_key, pack_keys, pack_numbers, row_length

    numbers = np.array([0, 7, -1, 123456789])
    keys = pack_keys("train", numbers)
    assert keys.to_pylist() == [pack_key("train", 0), pack_key("train", 7), None, "train-123456789"]
    assert pack_numbers(keys.drop_null()).tolist() == [0, 7, 123456789]
    assert in_split(pack_key("train", 3), "train") and not in_split(pack_key("train-x", 3), "train")
    assert not in_split("train-12", "train") and not in_split(pack_key("val", 3), "train")
    assert aligned_lengths(np.array([1, 8, 9]), 8).tolist() == [8, 8, 16] and row_length(100, 8) == 96
    root = Path(__file__).resolve().parents[1] / "packtool"
    copies = re.compile(r"09d|start=-9|//\s*\(?align\)?\s*\)\s*\*|//\s*align\s*\*\s*align|utf8_lpad")
    owner = root / "format" / "names.py"
    assert copies.search(owner.read_text())  # the control: the owner's own lines are what the pattern finds
    found = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p != owner
             for i, line in enumerate(p.read_text().splitlines(), 1) if copies.search(line)]
    assert found == [], f"pack-key or row-length rule written outside format/names.py: {found}"
