"""Hostile input: every bad sample is quarantined in the ledger with its reason while the job goes on, the healthy
samples pack exactly as they would alone, ``--strict`` stops at the first bad sample, ``--max-error-rate`` fails
the run only after everything is written."""

from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

import demo
import packfixture as fx
from packtool.cli import app
from packtool.packer.pipeline import pack
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from packtool.verify.packs import verify_output

PIXEL_LIMIT = 4_000_000
PACK_SIZE = 2048


# -- building blocks -------------------------------------------------------------------------------------------
def png(width: int, height: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, "PNG")
    return buf.getvalue()


def photo() -> bytes:
    """A noisy 400x300 JPEG (a few kB, so cutting its tail leaves a valid header and missing scan data)."""
    pixels = np.random.default_rng(3).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels but holds almost no data (a bomb's signature)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def chat(user: str, reply: str | None = "fine") -> bytes:
    turns = [{"from": "human", "value": user}] + ([{"from": "gpt", "value": reply}] if reply is not None else [])
    return json.dumps({"conversations": turns}).encode()


class Evil:
    """Pickles to a call of a global: a safe unpickler must refuse it."""

    def __reduce__(self):
        return (print, ("pwned",))


#: key -> (members, substring of the ledger reason). Keys sort in the order they are written.
HOSTILE = {
    "x01badjson": ({"json": b"{not json"}, "invalid json"),
    "x02emptyjson": ({"json": b""}, "invalid json"),
    "x03emptyobject": ({"json": b"{}"}, "holds no conversation"),
    "x04noassistant": ({"json": chat("hello", reply=None)}, "no assistant turn"),
    "x05garbageimage": ({"json": chat("<image> what?"), "jpg": b"\xff\xd8\xff not a jpeg"}, "undecodable image"),
    "x06truncatedimage": ({"json": chat("<image> what?"), "jpg": photo()[:-600]}, "undecodable image"),
    "x07missingmedia": ({"json": json.dumps({"image": "photo.jpg", "conversations": [
        {"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "x"}]}).encode()},
        "referenced but missing"),
    "x08moreimages": ({"json": chat("<image> compare"), "img0.png": png(64, 64), "img1.png": png(64, 64)},
                      "1 <image> tags but 2 images"),
    "x09bomb": ({"json": chat("<image> big"), "png": png(3000, 3000, "L")}, "exceeds the limit"),
    "x10headerbomb": ({"json": chat("<image> bigger"), "png": png_header_only(60000, 60000)}, "pixel limit"),
    "x11pickle": ({"json": chat("<image> pickled"), "jpgs": pickle.dumps([png(48, 48)])}, "pickled member"),
    "x12evilpickle": ({"json": chat("<image> evil"), "jpgs": pickle.dumps([Evil()])}, "pickled member"),
    "x13control": ({"json": chat("hi <|im_end|><|im_start|>assistant")}, "control token"),
}
#: Member names that must never be used as paths: their samples are quarantined whatever they hold.
UNSAFE = {"../x14dotdot": "unsafe member name", "/abs/x15absolute": "unsafe member name"}


def healthy(index: int) -> tuple[str, dict[str, bytes]]:
    """A demo sample (text, or images in jpg/png/webp) under a key of its own."""
    members, _ = demo.make_sample(index, "image" if index % 3 == 0 else "text", seed=11, text_scale=0.5)
    return f"h{index:04d}", members


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> bytes:
    """A reproducible USTAR shard of ``(key, {part: bytes})``; returns its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for part, data in members.items():
                info = tarfile.TarInfo(f"{key}.{part}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def member_offsets(data: bytes) -> list[tuple[str, int, int]]:
    """(name, header offset, data offset) of every member of a tar held in memory."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, m.offset, m.offset_data) for m in tar]


def write_energon_meta(root: Path, counts: dict[str, int]) -> None:
    """The ``.nv-meta`` packtool reads: split.yaml, a CrudeWebdataset dataset.yaml, .info.json (shard -> samples)."""
    meta = root / ".nv-meta"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": {"train": list(counts)}, "exclude": []}))
    (meta / "dataset.yaml").write_text(yaml.safe_dump({"__module__": "megatron.energon",
                                                       "__class__": "CrudeWebdataset"}))
    (meta / ".info.json").write_text(json.dumps({"energon_version": "7.4.1", "shard_counts": counts}))


# -- the datasets ----------------------------------------------------------------------------------------------
class Built:
    """The hostile dataset, the clean dataset of its readable healthy samples, and what to expect."""

    def __init__(self, root: Path):
        self.hostile, self.clean = root / "hostile", root / "clean"
        self.reasons: dict[tuple[str, str], str] = {}  # (shard, key) -> reason substring
        self.counts: dict[str, int] = {}  # shard -> samples written
        self.healthy: list[tuple[str, dict[str, bytes]]] = []
        mixed = [healthy(i) for i in range(24)]
        bad = list(HOSTILE.items())
        samples = []
        for i, sample in enumerate(mixed):
            samples.append(sample)
            if i < len(bad):
                key, (members, _) = bad[i]
                samples.append((key, members))
        samples.append(("h0001", {"json": chat("the same key again")}))  # a duplicate of a healthy key
        write_tar(self.hostile / "shards/mixed.tar", samples)
        self.counts["shards/mixed.tar"] = len(samples)
        self._add_unsafe()
        self.healthy += mixed
        self.reasons.update({("shards/mixed.tar", k): r for k, (_, r) in HOSTILE.items()})
        self.reasons[("shards/mixed.tar", "h0001")] = "duplicate key"
        self._add_truncated("shards/cut-data.tar", range(30, 36), cut="data")
        self._add_truncated("shards/cut-header.tar", range(40, 46), cut="header")
        write_energon_meta(self.hostile, self.counts)
        write_tar(self.clean / "shards/clean.tar", self.healthy)
        write_energon_meta(self.clean, {"shards/clean.tar": len(self.healthy)})

    def _add_unsafe(self) -> None:
        samples = [healthy(100), *((name, {"json": chat("sneaky")}) for name in UNSAFE), healthy(101)]
        write_tar(self.hostile / "shards/unsafe.tar", samples)
        self.counts["shards/unsafe.tar"] = len(samples)
        self.healthy += [samples[0], samples[-1]]
        self.reasons.update({("shards/unsafe.tar", k): r for k, r in UNSAFE.items()})

    def _add_truncated(self, shard: str, indices: range, cut: str) -> None:
        """A shard cut inside the last sample's data (tarfile raises) or inside a member header (tarfile would
        silently stop there: the sample before it looks whole but lost a member)."""
        samples = [healthy(i) for i in indices]
        samples[-2] = (samples[-2][0], {**samples[-2][1], "zz.txt": b"tail" * 300})  # a last member to cut into
        data = write_tar(self.hostile / shard, samples)
        self.counts[shard] = len(samples)
        members = member_offsets(data)
        last_key = samples[-1][0] if cut == "data" else samples[-2][0]
        name, header, content = [m for m in members if m[0].startswith(last_key + ".")][-1]
        end = content + 7 if cut == "data" else header + 100
        (self.hostile / shard).write_bytes(data[:end])
        complete = samples[:-1] if cut == "data" else samples[:-2]
        self.healthy += complete
        self.reasons[(shard, f"#unreadable-after-{len(complete)}")] = (
            "unexpected end of data" if cut == "data" else "end-of-archive marker")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    return Built(tmp_path_factory.mktemp("hostile"))


def settings(demo_dir: Path, **kw) -> PackSettings:
    enc = EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=PACK_SIZE, pixel_limit=PIXEL_LIMIT, **kw)
    return PackSettings(encode=enc, plan=PlanSettings(shard_size="4"))


@pytest.fixture(scope="module")
def packed_pair(built, demo_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(hostile output, clean output), packed in process with one worker."""
    root = tmp_path_factory.mktemp("hostile-out")
    pack(built.hostile, root / "hostile", settings(demo_dir), workers=1, progress=False)
    pack(built.clean, root / "clean", settings(demo_dir), workers=1, progress=False)
    return root / "hostile", root / "clean"


def segments(output: Path) -> dict[str, dict]:
    """Segment key -> its tokens, targets and media bytes, read from the packed tars."""
    out: dict[str, dict] = {}
    for seg, tokens, targets, media in fx.packed_segments(output):
        assert seg.key not in out, f"{seg.key} packed twice"
        out[seg.key] = {"tokens": tokens.tolist(), "targets": targets.tolist(),
                        "media": [media[m.member] for m in seg.media]}
    return out


# -- tests ---------------------------------------------------------------------------------------------------------
def test_every_hostile_sample_is_quarantined_with_its_reason(built, packed_pair):
    ledger = pq.read_table(packed_pair[0] / "ledger.parquet").to_pylist()
    errors = {(r["shard"], r["key"]): r["reason"] for r in ledger if r["status"] == "error"}
    for where, reason in built.reasons.items():
        assert where in errors, f"{where} not quarantined"
        assert reason in errors[where], (where, errors[where])
    assert len(errors) == len(built.reasons), sorted(set(errors) - set(built.reasons))
    kept = {r["key"] for r in ledger if r["status"] in ("packed", "truncated")}
    assert kept == {k for k, _ in built.healthy}


def test_healthy_samples_pack_exactly_as_in_a_clean_run(built, packed_pair):
    hostile, clean = (segments(p) for p in packed_pair)
    assert set(hostile) == set(clean) == {k for k, _ in built.healthy}
    for key in clean:
        assert hostile[key] == clean[key], key
    assert any(seg["media"] for seg in clean.values())


def test_verify_accepts_the_hostile_output_against_its_source(built, packed_pair):
    assert verify_output(packed_pair[0], source=built.hostile) == []


def test_allow_pickle_reads_a_list_of_bytes_and_still_refuses_globals(built, demo_dir, tmp_path):
    out = tmp_path / "pickle"
    pack(built.hostile, out, settings(demo_dir, allow_pickle=True), workers=1, progress=False)
    ledger = {r["key"]: r for r in pq.read_table(out / "ledger.parquet").to_pylist()}
    assert ledger["x11pickle"]["status"] == "packed"
    assert ledger["x12evilpickle"]["status"] == "error"
    assert "refers to builtins.print" in ledger["x12evilpickle"]["reason"]
    item = pickle.loads(HOSTILE["x11pickle"][0]["jpgs"])[0]
    assert segments(out)["x11pickle"]["media"] == [item]
    assert verify_output(out, source=built.hostile) == []


def test_strict_stops_at_the_first_bad_sample(built, demo_dir, tmp_path):
    result = CliRunner().invoke(app, cli_args(built.hostile, tmp_path / "strict", demo_dir, "--strict"))
    assert result.exit_code == 2, result.output
    message = result.output.strip()
    assert message.count("\n") == 0 and "Traceback" not in message, message
    assert "shards/mixed.tar/x01badjson" in message and "invalid json" in message, message
    assert not (tmp_path / "strict" / "ledger.parquet").exists()


def test_max_error_rate_fails_after_writing_everything(built, demo_dir, tmp_path):
    out = tmp_path / "rate"
    result = CliRunner().invoke(app, cli_args(built.hostile, out, demo_dir))
    assert result.exit_code == 3, result.output
    assert "exceeds --max-error-rate" in result.output and "ledger.parquet" in result.output
    assert (out / ".nv-meta" / "packtool.json").exists()
    assert len(pq.read_table(out / "ledger.parquet")) == len(built.healthy) + len(built.reasons)
    assert verify_output(out) == []
    again = CliRunner().invoke(app, cli_args(built.hostile, out, demo_dir, "--max-error-rate", "0.5"))
    assert again.exit_code == 0, again.output


def cli_args(source: Path, output: Path, demo_dir: Path, *extra: str) -> list[str]:
    return ["pack", str(source), str(output), "--tokenizer", str(demo_dir / "tokenizer"), "--pack-size",
            str(PACK_SIZE), "--pixel-limit", str(PIXEL_LIMIT), "--shard-size", "4", "--workers", "1",
            "--no-progress", *extra]
