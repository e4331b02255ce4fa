"""File sources read in place: hostile records and media paths are their record's error row (the run goes on),
JSON arrays are streamed, every media column layout ``datasets``/pyarrow write is read (or is an error row naming
the column), split names map one way, the ledger keeps a record's own id, and a run writes nothing outside
OUTPUT while its memory stays bounded."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import packfixture as fx
from mediafixture import make_image
from packtool.packer.pipeline import pack
from packtool.packer.sources import files, jsonfile, records, tables
from packtool.packer.sources.files import detect, resolve_source
from packtool.packer.sources.jsonfile import json_spans
from packtool.settings import EncodeSettings, PackSettings, PlanSettings

PACK_SIZE = 1024


@pytest.fixture()
def pics(tmp_path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    for i in range(4):
        (root / f"{i}.png").write_bytes(make_image(40 + 8 * i, 30 + 4 * i, seed=i, fmt="PNG"))
    return root


def record(i: int, images: list[str] | None = None, text: str | None = None) -> dict:
    names = [f"{i % 4}.png"] if images is None else images
    return {"messages": [{"role": "user", "content": "<image>\n" * len(names) + (text or f"What is {i}?")},
                         {"role": "assistant", "content": f"Picture {i}."}], "images": names}


def run(source: Path, out: Path, tokenizer: Path, media: Path | None = None, *, absolute: bool = False,
        workers: int = 1) -> Path:
    src = resolve_source(source, media_dir=media, absolute_media_paths=absolute)
    settings = PackSettings(EncodeSettings(tokenizer=str(tokenizer), pack_size=PACK_SIZE), PlanSettings(shard_size="4"))
    pack(src, out, settings, workers=workers, progress=False, max_error_rate=1.0)
    return out


def ledger(out: Path) -> dict[str, tuple[str, str]]:
    t = pq.read_table(out / "ledger.parquet", columns=["key", "status", "reason"])
    return {k: (s, r) for k, s, r in zip(*(t.column(c).to_pylist() for c in ("key", "status", "reason")))}


def tokens(out: Path) -> dict[str, tuple]:
    return {seg.key.split(":")[0]: (tuple(t.tolist()), tuple(g.tolist()), len(seg.media))
            for seg, t, g, _ in fx.packed_segments(out)}


def test_hostile_records_and_media_paths_are_error_rows(demo_dir, pics, tmp_path):
    outside = tmp_path / "secret.png"
    outside.write_bytes((pics / "0.png").read_bytes())
    os.symlink(outside, pics / "link.png")
    os.mkfifo(pics / "fifo.png")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(pics / "sock.png"))
    lines = [json.dumps(record(0)).encode(),                                      # 0 fine
             json.dumps(record(1, text="cut \ud83d surrogate")).encode(),         # 1 lone surrogate in text
             json.dumps(record(2, ["a\x00.png"])).encode(),                        # 2 NUL in a media path
             json.dumps(record(3, ["\udc80.png"])).encode(),                       # 3 lone surrogate in a path
             b"[" * 100_000 + b"]" * 100_000,                                      # 4 nested too deep
             b'{"messages": "\xff\xfe bad utf-8"}',                                # 5 bad UTF-8
             json.dumps(record(6, ["fifo.png"])).encode(),                         # 6 a FIFO (never blocks)
             json.dumps(record(7, ["/dev/zero"])).encode(),                        # 7 absolute, not allowed
             json.dumps(record(8, ["sock.png"])).encode(),                         # 8 a socket
             json.dumps(record(9, ["link.png"])).encode(),                         # 9 a link out of the folder
             json.dumps(record(10, [str(pics / "1.png")])).encode(),               # 10 absolute, not allowed
             json.dumps(record(11)).encode()]                                      # 11 fine
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    rows = ledger(run(tmp_path / "d.jsonl", tmp_path / "out", demo_dir / "tokenizer", pics))
    sock.close()
    assert len(rows) == 12
    assert rows["000000000"][0] == "packed" and rows["000000011"][0] == "packed"
    want = {1: "not valid Unicode", 2: "NUL or a lone surrogate", 3: "NUL or a lone surrogate",
            4: "nested too deep", 5: "not valid JSON", 6: "is a FIFO; only regular files", 7: "is absolute",
            8: "is a socket", 9: "outside the media folder", 10: "--absolute-media-paths"}
    for i, why in want.items():
        status, reason = rows[f"{i:09d}"]
        assert status == "error" and why in reason, (i, reason)
    # Absolute paths opted in: a regular file is read, a device is still refused.
    rows = ledger(run(tmp_path / "d.jsonl", tmp_path / "abs", demo_dir / "tokenizer", pics, absolute=True))
    assert rows["000000010"][0] == "packed"
    assert rows["000000007"][0] == "error" and "is a device" in rows["000000007"][1]


def test_json_arrays_are_streamed(demo_dir, pics, tmp_path):
    """A JSON array (or ``{"data": [...]}``) is scanned for its elements' spans: strings holding brackets,
    quotes and escapes do not confuse it; a broken element is its own error row; tokens equal the JSONL's."""
    recs = [record(i, text=f'tricky "[{{,}}]" \\ {i}') for i in range(6)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    texts = [json.dumps(r, indent=2) for r in recs]
    (tmp_path / "a.json").write_text("[\n" + " ,\n".join(texts) + "\n ]\n")
    (tmp_path / "b.json").write_text('{"info": {"data": [1]}, "x": "data", "data": [' + ",".join(texts) + "]}")
    spans = list(json_spans(tmp_path / "a.json"))
    assert [json.loads((tmp_path / "a.json").read_bytes()[a:b]) for a, b in spans] == recs
    assert len(list(json_spans(tmp_path / "b.json"))) == 6
    reference = tokens(run(tmp_path / "r.jsonl", tmp_path / "o-r", demo_dir / "tokenizer", pics))
    assert len(reference) == 6
    (tmp_path / "l.json").write_text((tmp_path / "r.jsonl").read_text())  # JSONL named .json
    assert len(list(json_spans(tmp_path / "l.json"))) == 6
    for name in ("a.json", "b.json", "l.json"):
        assert tokens(run(tmp_path / name, tmp_path / f"o-{name}", demo_dir / "tokenizer", pics)) == reference
    broken = texts[:2] + ['{"messages": tru}', "[" * 50_000 + "]" * 50_000] + texts[2:]
    (tmp_path / "c.json").write_text("[" + ",".join(broken) + "]")
    rows = ledger(run(tmp_path / "c.json", tmp_path / "o-c", demo_dir / "tokenizer", pics))
    assert [rows[f"{i:09d}"][0] for i in range(8)] == ["packed"] * 2 + ["error"] * 2 + ["packed"] * 4
    assert "not valid JSON" in rows["000000002"][1] and "nested too deep" in rows["000000003"][1]


def _walked_spans(path: Path, data_key: bool) -> list[tuple[int, int]]:
    """Reference: the element spans of a JSON array by the byte walk alone (depth, strings, escapes)."""
    scanner, inner, start, out = jsonfile._Scanner(), 2 if data_key else 1, None, []
    keys, in_array = jsonfile._DataKey(), False
    with open(path, "rb") as f:
        for offset, c, depth in scanner.events(path):
            if data_key and not in_array and depth == 1:
                if keys.opens_data_array(f, scanner.in_string, offset, c):
                    in_array, start = True, offset + 1
                continue
            if not data_key and depth == 0 and c == 0x5B and not in_array:
                in_array, start = True, offset + 1
                continue
            if not in_array or depth != inner:
                continue
            if c in (0x2C, 0x5D) and start is not None:
                if c == 0x2C or jsonfile._nonblank(f, start, offset):
                    out.append((start, offset))
                start = offset + 1
                if c == 0x5D:
                    return out
    if in_array and start is not None:
        end = path.stat().st_size
        with open(path, "rb") as f:
            if jsonfile._nonblank(f, start, end):
                out.append((start, end))
    return out


def test_json_array_spans_equal_the_byte_walk(tmp_path, monkeypatch):
    """Elements found by the JSON decoder a buffer at a time give the spans the byte walk gives, on arrays of
    plain and broken elements (unclosed strings, stray brackets, Python literals, deep nesting, blanks, a file
    cut short, non-ASCII text) with buffers that cut elements anywhere; both ways are taken."""
    rng = random.Random(7)
    plain = [json.dumps({"messages": [{"role": "user", "content": 'a "[{,}]" \\ é 中'}]}), "12", "-1.5e3", '"s,]"',
             "true", "null", "[1, [2, {}]]", '{"a": "\u005d"}', '{"t": "tab\there"}']
    broken = ["{'a': 1}", '{"a": tru}', '{"a": "open', "{]", "}", "1 2", "", "  ", "NaN", "[" * 3000 + "]" * 3000,
              '{"a": 1}}', "é"]
    walks = []
    real_walk = jsonfile._walk_element
    monkeypatch.setattr(jsonfile, "_walk_element", lambda *a: walks.append(a) or real_walk(*a))
    decoded = 0
    for case in range(300):
        monkeypatch.setattr(jsonfile, "READ_BLOCK", rng.choice([7, 16, 64, 1 << 20]))
        elements = [rng.choice(plain if rng.random() < 0.7 else broken) for _ in range(rng.randint(0, 12))]
        seps = [rng.choice([",", " , ", ",\n  ", ",,"]) for _ in elements]
        body = "".join(e + s for e, s in zip(elements, seps))[: -1 or None]
        data_key = case % 3 == 0
        text = ('{"x": "data", "data": [' + body + "]}") if data_key else ("[" + body + "]")
        if case % 7 == 0:
            text = text[: rng.randint(1, len(text))]  # cut short
        path = tmp_path / f"{case}.json"
        path.write_bytes(text.encode("utf-8"))
        before = len(walks)
        assert list(jsonfile._array_spans(path, data_key)) == _walked_spans(path, data_key), text
        decoded += len(_walked_spans(path, data_key)) - (len(walks) - before)
    assert walks and decoded > len(walks)
    monkeypatch.setattr(jsonfile, "READ_BLOCK", 1 << 20)  # plain elements in one buffer: the walk is never taken
    path = tmp_path / "plain.json"
    path.write_text("[" + ",\n".join(plain * 50) + "]")
    before = len(walks)
    assert len(list(jsonfile._array_spans(path, False))) == len(plain) * 50 and len(walks) == before


def test_a_stamp_read_unparsed_still_covers_media_named_by_an_escaped_key(pics, tmp_path):
    """A JSON record's stamp is taken from its bytes unparsed only where its text can name no media; a record
    naming its image through an escaped key (``"\\u0069mages"``) is parsed, so replacing the image changes its
    stamp. Control: a text-only record's stamp is its bytes' alone and ignores the folder's files."""
    escaped = b'{"messages": [{"role": "user", "content": "q"}], "\\u0069mages": ["0.png"]}'
    plain = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
    assert json.loads(escaped)["images"] == ["0.png"]
    (tmp_path / "r.jsonl").write_bytes(escaped + b"\n" + plain + b"\n")
    source = detect(tmp_path / "r.jsonl", pics)
    assert source is not None
    chunk = next(iter(files.open_files(source).chunks.values()))

    def stamps() -> list[str]:
        stamped = files.stamp_chunk(chunk)
        return [stamped.stamp(i) for i in range(stamped.count)]

    before = stamps()
    assert not records.names_no_media(escaped) and records.names_no_media(plain)
    (pics / "0.png").write_bytes((pics / "1.png").read_bytes())  # the image replaced (other size)
    after = stamps()
    assert after[0] != before[0] and after[1] == before[1]
    assert before[1] == records.text_stamp(plain + b"\n", chunk.folder())  # a JSONL record: its line


def test_media_column_layouts(demo_dir, pics, tmp_path):
    """Every layout of a media column ``datasets``/pyarrow write gives the tokens of the JSONL with paths; a
    column that cannot be read is an error row naming it, never a sample packed without its media."""
    n = 6
    recs = [record(i, [f"{i % 4}.png", f"{(i + 1) % 4}.png"][: 1 + i % 2]) for i in range(n)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    reference = tokens(run(tmp_path / "r.jsonl", tmp_path / "o-ref", demo_dir / "tokenizer", pics))
    assert sum(m for _, _, m in reference.values()) == 9
    data = [[(pics / name).read_bytes() for name in r["images"]] for r in recs]
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    messages = pa.array([r["messages"] for r in recs], pa.list_(message))
    hf = pa.struct([("bytes", pa.binary()), ("path", pa.string()), ("mime", pa.string())])
    layouts = {
        "list_binary": pa.array(data, pa.list_(pa.binary())),
        "list_large_binary": pa.array(data, pa.list_(pa.large_binary())),
        "list_struct": pa.array([[{"bytes": b, "path": None, "mime": "image/png"} for b in d] for d in data],
                                pa.list_(hf)),
    }
    for name, column in layouts.items():
        pq.write_table(pa.table({"messages": messages, "images": column}), tmp_path / f"{name}.parquet")
        got = tokens(run(tmp_path / f"{name}.parquet", tmp_path / f"o-{name}", demo_dir / "tokenizer"))
        assert got == reference, name
    # An Arrow IPC file (not a stream) of the same rows.
    with pa.ipc.new_file(tmp_path / "f.arrow", pa.schema([("messages", messages.type),
                                                          ("images", pa.list_(pa.binary()))])) as writer:
        writer.write_table(pa.table({"messages": messages, "images": layouts["list_binary"]}), max_chunksize=4)
    assert tokens(run(tmp_path / "f.arrow", tmp_path / "o-f", demo_dir / "tokenizer")) == reference
    # One image per row: a plain binary / large_binary column, a struct (bytes or a path).
    single = [i for i in range(n) if i % 2 == 0]
    one = pa.table({"messages": messages.take(single)})
    first = [data[i][0] for i in single]
    singles = {"binary": pa.array(first, pa.binary()), "large_binary": pa.array(first, pa.large_binary()),
               "struct": pa.array([{"bytes": None, "path": recs[i]["images"][0], "mime": "x"} for i in single],
                                  hf)}
    want = {f"{k:09d}": v for k, v in zip(range(len(single)), (reference[f"{i:09d}"] for i in single))}
    for name, column in singles.items():
        pq.write_table(one.append_column("image", column), tmp_path / f"{name}.parquet")
        got = tokens(run(tmp_path / f"{name}.parquet", tmp_path / f"o1-{name}", demo_dir / "tokenizer", pics))
        assert got == want, name
    # Control: a media column of numbers is every row's error, naming the column.
    pq.write_table(one.append_column("image", pa.array([7] * len(single))), tmp_path / "bad.parquet")
    rows = ledger(run(tmp_path / "bad.parquet", tmp_path / "o-bad", demo_dir / "tokenizer", pics))
    assert {s for s, _ in rows.values()} == {"error"}
    assert all("media column 'image' cannot be read" in r for _, r in rows.values())


def test_split_names_and_record_ids(demo_dir, pics, tmp_path):
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / "f" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "f" / name).write_text("\n".join(json.dumps({**record(i), "id": f"r{i}"}) for i in range(3)))
    src = detect(tmp_path / "f", pics)
    assert src is not None and list(src.splits) == ["train", "val"]
    rows = ledger(run(tmp_path / "f", tmp_path / "out", demo_dir / "tokenizer", pics))
    splits = pq.read_table(tmp_path / "out" / "ledger.parquet", columns=["split", "key"]).to_pylist()
    assert sorted((r["split"], r["key"]) for r in splits) == [(s, f"{i:09d}:r{i}") for s in ("train", "val")
                                                              for i in range(3)]
    assert rows["000000002:r2"][0] == "packed"


def noise_png(width: int, height: int) -> bytes:
    """A PNG of random pixels (PNG cannot compress them: about 3 bytes a pixel)."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def _measured_run(tmp: Path, n: int, blob: bytes, tokenizer: Path) -> tuple[int, int]:
    """Pack ``n`` records of one image each (``blob``) in a subprocess with two workers; returns the peak resident
    memory of its process tree (sampled every 50 ms) and the bytes of files it left outside OUTPUT (its scratch
    and work folders and the source's folder included)."""
    media = tmp / "media"
    media.mkdir(parents=True)
    for i in range(n):
        (media / f"{i}.png").write_bytes(blob)
    (tmp / "d.jsonl").write_text("\n".join(json.dumps(record(i, [f"{i}.png"])) for i in range(n)))
    scratch = tmp / "scratch"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "PACKTOOL_SCRATCH": str(scratch),
           "PACKTOOL_WORK": str(scratch / "work")}
    before = set(tmp.rglob("*"))
    proc = subprocess.Popen([sys.executable, "-m", "packtool.cli", "pack", str(tmp / "d.jsonl"), str(tmp / "out"),
                             "--media-dir", str(media), "--tokenizer", str(tokenizer), "--pack-size", "1024",
                             "--workers", "2", "--media-check", "header", "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=sample)
    watcher.start()
    _, err = proc.communicate(timeout=900)
    watcher.join()
    assert proc.returncode == 0, err
    packed = sum(p.stat().st_size for p in (tmp / "out").rglob("*") if p.is_file())
    assert packed > n * len(blob)  # the packs hold the media's bytes
    new = {p for p in tmp.rglob("*") if not p.is_relative_to(tmp / "out")} - before
    return peak[0], sum(p.stat().st_size for p in new if p.is_file())


def test_many_large_images_bounded_memory_nothing_written_outside_output(demo_dir, tmp_path):
    """200 records of 4 MB images (800 MB of media): the process tree's peak memory is what 20 such records
    take, give or take a few images (bounded by a pack and a sample, not by the media), and nothing is written
    outside OUTPUT (no staging copy; the lock file is all)."""
    blob = noise_png(1180, 1180)
    assert len(blob) > 4_000_000
    small, _ = _measured_run(tmp_path / "small", 20, blob, demo_dir / "tokenizer")
    big, written = _measured_run(tmp_path / "big", 200, blob, demo_dir / "tokenizer")
    assert big < small + 40 * len(blob), (small, big)  # 180 more images (720 MB) cost under 10 of them
    assert big < 1.5 * 2**30
    assert written <= 0.05 * 200 * len(blob), written


def test_media_in_cells_are_read_in_one_pass_per_chunk(demo_dir, pics, tmp_path, monkeypatch):
    """The write stage reads a Parquet chunk's image cells for a batch of packs in one pass over its rows (a
    row group has no random access: read record by record, each read decoded the group from its start); the
    packs are those of the JSONL with the same images, and an image changed after encoding still stops the run."""
    from packtool.packer.sources import files

    n = 40
    recs = [record(i) for i in range(n)]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    reference = tokens(run(tmp_path / "r.jsonl", tmp_path / "o-ref", demo_dir / "tokenizer", pics))
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({"messages": pa.array([r["messages"] for r in recs], pa.list_(message)),
                      "images": pa.array([[(pics / r["images"][0]).read_bytes()] for r in recs],
                                         pa.list_(pa.binary()))})
    pq.write_table(table, tmp_path / "cells.parquet")
    passes = []
    real = files.table_batches

    def counted(path, kind, lo, hi, size=16):
        passes.append(hi - lo)
        yield from real(path, kind, lo, hi, size)

    monkeypatch.setattr(files, "table_batches", counted)
    out = run(tmp_path / "cells.parquet", tmp_path / "o-cells", demo_dir / "tokenizer")
    assert tokens(out) == reference
    reads = [span for span in passes if span < n]  # the stamp and encode passes read the whole chunk
    assert len(reads) <= 2 and not any(span == 1 for span in passes), passes  # never one record at a time
    # The chunk's own reads: records one by one take a pass each, together one pass.
    chunk = next(iter(files.open_files(detect(tmp_path / "cells.parquet")).chunks.values()))
    passes.clear()
    for i in range(5):
        chunk.media_of({i: set()})
    assert len(passes) == 5
    passes.clear()
    assert sorted(chunk.media_of({i: set() for i in range(5)})) == list(range(5)) and len(passes) == 1


def test_a_row_group_is_decoded_once_per_stage_not_once_per_chunk(demo_dir, pics, tmp_path, monkeypatch):
    """A Parquet file of one row group cut into chunks: each stage reads on through the group from where its last
    chunk stopped (a fresh read decodes it from its start). Control: without the open streams, a read per chunk
    and stage."""
    from packtool.packer.sources import files

    monkeypatch.setattr(files, "RECORDS_PER_CHUNK", 8)
    recs = [record(i) for i in range(40)]  # 5 chunks
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    pq.write_table(pa.table({"messages": pa.array([r["messages"] for r in recs], pa.list_(message)),
                             "images": pa.array([[(pics / r["images"][0]).read_bytes()] for r in recs],
                                                pa.list_(pa.binary()))}), tmp_path / "one.parquet")
    opened = []
    real = tables._open_group
    monkeypatch.setattr(tables, "_open_group", lambda *a: opened.append(a) or real(*a))
    first = tokens(run(tmp_path / "one.parquet", tmp_path / "o1", demo_dir / "tokenizer"))
    assert len(first) == 40 and len(opened) <= 3, len(opened)  # stamp, encode, write: a pass each
    opened.clear()
    monkeypatch.setattr(tables, "_STREAMS", 0)
    assert tokens(run(tmp_path / "one.parquet", tmp_path / "o2", demo_dir / "tokenizer")) == first
    assert len(opened) >= 10


def test_a_chunk_holds_a_few_bytes_a_record(tmp_path):
    """The command's process holds every chunk of a run: a stamped chunk's records cost it their offsets and a
    16-byte stamp each (arrays, one bytes object), not Python objects per record. Control: the same facts as
    tuples of ints and of hex strings take over three times as much."""
    import pickle
    import tracemalloc

    n = 1000
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                      {"role": "assistant", "content": f"a{i}"}]}) for i in range(n)]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    source = detect(tmp_path / "r.jsonl", tmp_path)
    assert source is not None
    chunk = next(iter(files.open_files(source).chunks.values()))
    assert chunk.count == n
    blob = pickle.dumps(files.stamp_chunk(chunk))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stamped = pickle.loads(blob)
        compact = tracemalloc.get_traced_memory()[0] - before
        before = tracemalloc.get_traced_memory()[0]
        as_objects = (tuple(stamped.starts.tolist()), tuple(stamped.ends.tolist()),
                      tuple(stamped.stamp(i) for i in range(n)))
        objects = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert compact < 48 * n, compact
    assert objects > 3 * compact, (objects, compact)
    assert len(stamped.stamps) == records.STAMP_BYTES * n
    text = next(stamped.texts(7, 8))
    assert stamped.stamp(7) == records.text_stamp(text, stamped.folder())  # each record's stamp is its own
    assert len(as_objects[2]) == n
