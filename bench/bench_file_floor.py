"""File sources against the tokenizer-only floor: ``packtool pack`` on the same records as JSONL, a JSON array,
Parquet (text; image cells) and a ``save_to_disk`` folder, each beside the least any packer must do.

    .venv/bin/python bench/bench_file_floor.py [--records 50000] [--words 60] [--images 2000] [--workers 2]
                                               [--repeat 2] [--tokenizer DIR] [--formats jsonl,json,...]

The floor renders each record's chat template once and tokenizes it with the same tokenizer (transformers'
``encode_batch``, in batches of 256), nothing else, with the same number of processes, each taking a contiguous
half of the records, read by the cheapest means there is (``json.loads`` of a JSONL line). Every run, pack and
floor, is a fresh process (start-up counted) whose process tree's resident memory psutil samples every 20 ms.
Runs are interleaved and repeated (the machine is shared); the best of each is reported with the ratios:
floor / pack wall (target >= 1.0) and pack's peak tree memory against the floor's + 300 MB + 100 B a sample.

Record sets: ``--records`` text conversations (``--words`` words a question), written as each text format; and
``--images`` conversations naming one small PNG each, as a JSONL with the PNGs in a folder and as Parquet with the
PNG bytes in an ``images`` cell. Parquet is written as pyarrow writes it (one row group up to 1M rows).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # this checkout's packtool, also in the floor's processes

MB = 2**20
TEXT_FORMATS = ("jsonl", "json", "parquet", "disk")
IMAGE_FORMATS = ("jsonl-images", "parquet-images")


def conversation(i: int, words: int, image: str | None = None) -> dict:
    text = " ".join(f"word{(i * 7 + k) % 997}" for k in range(words))
    record = {"id": f"r{i}", "messages": [
        {"role": "user", "content": ("<image>\n" if image else "") + f"Question {i}: {text}"},
        {"role": "assistant", "content": f"Answer {i}: {text[: len(text) // 2]}"}]}
    if image:
        record["images"] = [image]
    return record


def png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64 + i % 5 * 16, 48 + i % 3 * 16), ((i * 37) % 256, (i * 91) % 256, 128)).save(buf, "PNG")
    return buf.getvalue()


def build(base: Path, records: int, words: int, images: int,
          wanted: list[str]) -> dict[str, tuple[Path, Path | None, Path, int]]:
    """``{format: (source, media_dir, floor_jsonl, records)}``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out: dict[str, tuple[Path, Path | None, Path, int]] = {}
    if records:
        docs = [conversation(i, words) for i in range(records)]
        jsonl = base / "text.jsonl"
        jsonl.write_text("".join(json.dumps(d) + "\n" for d in docs))
        if "json" in wanted:
            (base / "text.json").write_text(json.dumps(docs, indent=1))
        if {"parquet", "disk"} & set(wanted):
            table = pa.Table.from_pylist(docs)
            pq.write_table(table, base / "text.parquet")
            if "disk" in wanted:
                from datasets import Dataset

                Dataset(table).save_to_disk(str(base / "text_disk"))
        out |= {"jsonl": (jsonl, None, jsonl, records), "json": (base / "text.json", None, jsonl, records),
                "parquet": (base / "text.parquet", None, jsonl, records),
                "disk": (base / "text_disk", None, jsonl, records)}
    if images:
        media = base / "media"
        media.mkdir()
        docs = []
        for i in range(images):
            (media / f"{i:06d}.png").write_bytes(png(i))
            docs.append(conversation(i, words, f"{i:06d}.png"))
        jsonl = base / "images.jsonl"
        jsonl.write_text("".join(json.dumps(d) + "\n" for d in docs))
        rows = [{**d, "images": [(media / d["images"][0]).read_bytes()]} for d in docs]
        pq.write_table(pa.Table.from_pylist(rows), base / "images.parquet")
        out |= {"jsonl-images": (jsonl, media, jsonl, images),
                "parquet-images": (base / "images.parquet", None, jsonl, images)}
    return out


# -- the floor ------------------------------------------------------------------------------------------------


def floor_part(args: tuple[str, str, int, int]) -> int:
    """Render and tokenize records ``lo`` to ``hi`` of a JSONL file; returns tokens."""
    from packtool.packer.encoder import get_encoder
    from packtool.packer.sources.conversation import parse_turns
    from packtool.settings import EncodeSettings

    path, tok, lo, hi = args
    encoder = get_encoder(EncodeSettings(tokenizer=tok, pack_size=1 << 20), None)
    call, total, texts = encoder.tok.backend_tokenizer.encode_batch, 0, []
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i < lo:
                continue
            if i >= hi:
                break
            texts.append(encoder.render(encoder._template_messages(parse_turns(json.loads(line), []))))
            if len(texts) == 256:
                total += sum(len(e.ids) for e in call(texts, add_special_tokens=False))
                texts = []
    return total + (sum(len(e.ids) for e in call(texts, add_special_tokens=False)) if texts else 0)


def floor_main(path: str, tok: str, records: int, processes: int) -> None:
    cuts = [records * k // processes for k in range(processes + 1)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        tokens = sum(pool.map(floor_part, [(path, tok, cuts[k], cuts[k + 1]) for k in range(processes)]))
    print(tokens)


# -- timing ---------------------------------------------------------------------------------------------------


def timed(cmd: list[str], env: dict) -> tuple[float, int, str]:
    """(wall seconds, peak resident bytes of the process tree, stdout) of one fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def watch() -> None:
        while proc.poll() is None:
            try:
                root = psutil.Process(proc.pid)
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
            except psutil.Error:
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({proc.returncode}): {stderr[-2000:]}")
    return time.perf_counter() - start, peak[0], stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=50000)
    ap.add_argument("--words", type=int, default=60)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tokenizer", type=Path, default=None, help="model folder (default: the demo tokenizer)")
    ap.add_argument("--formats", default=",".join(TEXT_FORMATS + IMAGE_FORMATS))
    ap.add_argument("--floor", nargs=3, metavar=("JSONL", "TOKENIZER", "RECORDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    # One tokenizer thread per process everywhere, so "2 processes" means two cores' worth of work in each run.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.floor:
        floor_main(args.floor[0], args.floor[1], int(args.floor[2]), args.workers)
        return
    import demo

    base = Path(tempfile.mkdtemp(prefix="packtool-bench-floor-"))
    try:
        tok = args.tokenizer or base / "tokenizer"
        if args.tokenizer is None:
            demo.build_tokenizer(tok)
        wanted = args.formats.split(",")
        sets = build(base, args.records if set(wanted) & set(TEXT_FORMATS) else 0, args.words,
                     args.images if set(wanted) & set(IMAGE_FORMATS) else 0, wanted)
        for name in wanted:
            source, media, floor_jsonl, n = sets[name]
            pack = [sys.executable, "-m", "packtool", "pack", str(source), str(base / "out"), "--tokenizer", str(tok),
                    "--pack-size", "4096", "--workers", str(args.workers), "--no-progress", "--media-check", "header"]
            pack += ["--media-dir", str(media)] if media else []
            floor = [sys.executable, __file__, "--workers", str(args.workers), "--floor", str(floor_jsonl), str(tok),
                     str(n)]
            packs, floors, stages = [], [], ""
            for _ in range(args.repeat):
                shutil.rmtree(base / "out", ignore_errors=True)
                wall, rss, out = timed(pack, env)
                packs.append((wall, rss))
                stages = next((line for line in out.splitlines() if line.startswith("seconds:")), stages)
                floors.append(timed(floor, env)[:2])
            (pw, prss), (fw, frss) = min(packs), min(floors)
            budget = min(r for _, r in floors) + 300 * MB + 100 * n
            print(f"{name:<15} {n:>7,} records  pack {pw:6.2f} s ({n / pw:7,.0f}/s), {prss / MB:5.0f} MB tree  "
                  f"floor {fw:6.2f} s, {frss / MB:5.0f} MB  floor/pack {fw / pw:.2f}x (>= 1.0)  "
                  f"memory {'within' if min(r for _, r in packs) <= budget else 'OVER'} floor + 300 MB + 100 B/sample "
                  f"({budget / MB:.0f} MB)  [{stages}]", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
