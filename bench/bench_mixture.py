#!/usr/bin/env python
"""Benchmark a mixture packed jointly against the same proportions packed apart: packs, fill and planner seconds.

    python bench/bench_mixture.py [--samples 1000000] [--pack-size 16384] [--algorithm auto]
                                  [--end-to-end DEMO_FOLDER]

Five synthetic datasets (seeded lognormal lengths, capped at the pack size), in the proportions a VLM SFT mixture
might declare as ``blend_epochized`` repetitions:

  chat       short text turns, mean ~300 tokens        repetitions 1
  caption    one image and a caption, mean ~700        repetitions 2
  vqa        1-3 images and a question, mean ~1.2k     repetitions 1
  ocr        a document page, mean ~2.5k               repetitions 0.5
  video      a clip, mean ~7k                          repetitions 1.5

``--samples`` is the samples taken (copies counted) over all five. Joint: one plan over every copy, told which rows
copy one sample (:func:`packtool.packer.algorithms.pack_lengths` with ``samples``, as ``pack`` runs it), then
what is left together moved apart (:func:`packtool.packer.mixing.separate_copies`); apart: one plan per dataset,
its copies kept apart the same way. Printed: packs, the L1 bound,
fill, seconds of each, the packs apart / joint ratio, and the copies left sharing a pack. Grouped: the same rows in
three packing groups (:data:`GROUPS`: text, images, video), each planned on its own as ``pack`` plans a split's
groups; printed against the joint plan (what grouping costs).

``--end-to-end DEMO_FOLDER`` (a folder ``make run`` wrote) also packs a mixture of the demo's Energon dataset, a
JSONL of its samples with their images in a folder, a Parquet file with the images in cells and a save_to_disk
folder, with 2 workers, grouped and not: wall seconds of each, and the packs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packtool.packer.algorithms import l1_bound, pack_lengths
from packtool.packer.mixing import copy_samples, separate_copies

#: name -> (mean tokens, sigma of the log, repetitions, share of the distinct samples)
DATASETS = {"chat": (300, 0.8, 1.0, 0.40), "caption": (700, 0.4, 2.0, 0.15), "vqa": (1200, 0.5, 1.0, 0.25),
            "ocr": (2500, 0.5, 0.5, 0.12), "video": (7000, 0.4, 1.5, 0.08)}
#: Each dataset's packing group in the grouped plan.
GROUPS = {"chat": "text", "caption": "images", "vqa": "images", "ocr": "images", "video": "video"}


def make(samples: int, pack_size: int, seed: int = 0) -> dict[str, tuple[np.ndarray, float]]:
    """Each dataset's distinct lengths and repetitions, sized so the copies total about ``samples``."""
    rng = np.random.default_rng(seed)
    per_distinct = sum(share * reps for _, _, reps, share in DATASETS.values())
    distinct = samples / per_distinct
    out = {}
    for name, (mean, sigma, reps, share) in DATASETS.items():
        n = max(1, round(distinct * share))
        lengths = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, n).astype(np.int64)
        out[name] = (np.clip(lengths, 16, pack_size), reps)
    return out


def copies(n: int, reps: float) -> np.ndarray:
    """Row indices of the copies ``reps`` repetitions take of ``n`` samples (the fraction: the first ones)."""
    whole = math.floor(reps)
    extra = math.floor(reps * n + 0.5) - whole * n
    return np.concatenate([np.tile(np.arange(n), whole), np.arange(max(extra, 0))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--pack-size", type=int, default=16384)
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--end-to-end", metavar="DEMO_FOLDER", help="also pack a mixture of four kinds of sources")
    args = ap.parse_args()
    sets = make(args.samples, args.pack_size)
    lengths, ident = [], []
    apart_packs, apart_seconds = 0, 0.0
    for name, (dist, reps) in sets.items():
        rows = copies(dist.size, reps)
        lengths.append(dist[rows])
        ident += [f"{name}\0{i}" for i in rows.tolist()]
        t = time.perf_counter()
        ids = pack_lengths(dist[rows], args.pack_size, algorithm=args.algorithm,
                           samples=copy_samples(ident[-rows.size:]))
        apart_seconds += time.perf_counter() - t
        apart_packs += int(ids.max()) + 1
        print(f"{name:<8} {rows.size:>9} samples ({dist.size} distinct x {reps:g}), {int(ids.max()) + 1} packs alone")
    all_lengths = np.concatenate(lengths)
    tokens = int(all_lengths.sum())
    t = time.perf_counter()
    ids = pack_lengths(all_lengths, args.pack_size, algorithm=args.algorithm, samples=copy_samples(ident))
    plan_seconds = time.perf_counter() - t
    t = time.perf_counter()
    ids = separate_copies(ids, ident, all_lengths, args.pack_size, [])
    separate_seconds = time.perf_counter() - t
    joint = int(ids.max()) + 1
    shared = len(ident) - len({(int(p), i) for p, i in zip(ids.tolist(), ident)})
    bound = l1_bound(all_lengths, args.pack_size)
    print(f"total    {all_lengths.size:>9} samples, {tokens} tokens, L1 bound {bound} packs of {args.pack_size}")
    print(f"joint:  {joint} packs, fill {tokens / (joint * args.pack_size):.4f}, plan {plan_seconds:.2f} s "
          f"+ copies apart {separate_seconds:.2f} s; {shared} copies still share a pack")
    apart_fill = tokens / (apart_packs * args.pack_size)
    print(f"apart:  {apart_packs} packs, fill {apart_fill:.4f}, plan {apart_seconds:.2f} s")
    print(f"apart / joint: {apart_packs / joint:.4f}x packs ({apart_packs - joint:+d}), "
          f"{(apart_seconds / (plan_seconds + separate_seconds)):.2f}x seconds")
    grouped(sets, args)
    if args.end_to_end:
        end_to_end(Path(args.end_to_end))


def grouped(sets: dict[str, tuple[np.ndarray, float]], args: argparse.Namespace) -> None:
    """The same rows in :data:`GROUPS`, each group planned on its own (copies kept apart), against one plan."""
    packs, seconds, tokens, rows_all = 0, 0.0, 0, []
    for group in dict.fromkeys(GROUPS.values()):
        lengths, ident = [], []
        for name, (dist, reps) in sets.items():
            if GROUPS[name] == group:
                rows = copies(dist.size, reps)
                lengths.append(dist[rows])
                ident += [f"{name}\0{i}" for i in rows.tolist()]
        mine = np.concatenate(lengths)
        t = time.perf_counter()
        ids = pack_lengths(mine, args.pack_size, algorithm=args.algorithm, samples=copy_samples(ident))
        ids = separate_copies(ids, ident, mine, args.pack_size, [])
        seconds += time.perf_counter() - t
        n = int(ids.max()) + 1
        packs += n
        tokens += int(mine.sum())
        rows_all.append(mine)
        print(f"group {group:<7} {mine.size:>9} samples, {n} packs, fill {mine.sum() / (n * args.pack_size):.4f}")
    everything = np.concatenate(rows_all)  # the same rows, group by group: one plan over them
    t = time.perf_counter()
    joint = int(pack_lengths(everything, args.pack_size, algorithm=args.algorithm,
                             samples=copy_samples(_grouped_ident(sets))).max()) + 1
    joint_seconds = time.perf_counter() - t
    print(f"grouped: {packs} packs, fill {tokens / (packs * args.pack_size):.4f}, plan {seconds:.2f} s; one plan of "
          f"the same rows {joint} packs ({joint_seconds:.2f} s): grouped / one plan {packs / joint:.4f}x packs "
          f"({packs - joint:+d})")


def _grouped_ident(sets: dict[str, tuple[np.ndarray, float]]) -> list[str]:
    """The copies' sample names in the grouped rows' order (group by group, dataset by dataset)."""
    out: list[str] = []
    for group in dict.fromkeys(GROUPS.values()):
        for name, (dist, reps) in sets.items():
            if GROUPS[name] == group:
                out += [f"{name}\0{i}" for i in copies(dist.size, reps).tolist()]
    return out


def end_to_end(demo_folder: Path, records: int = 2000) -> None:
    """A mixture of an Energon dataset, a JSONL beside an image folder, Parquet with image cells and a
    save_to_disk folder, packed with 2 workers grouped and not, and each entry alone: wall seconds and packs."""
    import json
    import subprocess
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import demo
    from packtool.format import Manifest

    def image_bytes(width: int, height: int, seed: int) -> bytes:
        import io

        from PIL import Image

        buf = io.BytesIO()
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, format="PNG")
        return buf.getvalue()

    tok = demo_folder / "model" if (demo_folder / "model" / "tokenizer.json").exists() else demo_folder / "tokenizer"
    work = Path(tempfile.mkdtemp(prefix="bench-mix-"))
    demo.build_dataset(work / "energon", n_train=records, n_val=0, seed=5)
    (work / "images").mkdir()
    rows = []
    for i in range(records):
        name = f"{i:05d}.png"
        (work / "images" / name).write_bytes(image_bytes(64 + i % 97, 48 + i % 61, i))
        rows.append({"messages": [{"role": "user", "content": f"<image>\nWhat is in picture {i}?"},
                                  {"role": "assistant", "content": f"Thing number {i}. " * (1 + i % 7)}],
                     "images": [name]})
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    (work / "cells").mkdir()
    pq.write_table(pa.table({"messages": pa.array([r["messages"] for r in rows], pa.list_(message)),
                             "images": pa.array([[{"bytes": (work / "images" / r["images"][0]).read_bytes(),
                                                   "path": r["images"][0]}] for r in rows], pa.list_(image))}),
                   work / "cells" / "train-00000-of-00001.parquet")
    (work / "disk").mkdir()
    text = pa.table({"messages": pa.array([[{"role": "user", "content": f"Say fact {i}."},
                                            {"role": "assistant", "content": "A fact. " * (3 + i % 40)}]
                                           for i in range(records)], pa.list_(message))})
    with pa.ipc.new_stream(work / "disk" / "data-00000-of-00001.arrow", text.schema) as writer:
        writer.write_table(text)
    (work / "disk" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    entries = [{"path": "energon", "packtool": {"group": "energon"}},
               {"path": "chat.jsonl", "repetitions": 2, "packtool": {"media_dir": "images", "group": "images"}},
               {"path": "cells", "packtool": {"group": "images"}},
               {"path": "disk", "repetitions": 0.5, "packtool": {"group": "text"}}]

    def mixture(name: str, groups: bool) -> Path:
        chosen = [e if groups else {**e, "packtool": {k: v for k, v in e["packtool"].items() if k != "group"}}
                  for e in entries]
        header = {"__module__": "megatron.energon", "__class__": "MetadatasetV2"}
        (work / name).write_text(yaml.safe_dump({**header, "splits": {"train": {"blend_epochized": chosen}}}))
        return work / name

    def run(source: Path, out: str, *extra: str) -> tuple[float, int]:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "packtool", "pack", str(source), str(work / out), "--tokenizer",
                        str(tok), "--pack-size", "4096", "--workers", "2", "--no-progress", *extra], check=True,
                       stdout=subprocess.DEVNULL)
        return time.perf_counter() - t, Manifest.read(work / out).packs["train"]

    alone = {e["path"]: run(work / e["path"], f"alone-{e['path']}",
                            *(["--media-dir", str(work / "images")] if e["path"] == "chat.jsonl" else []))
             for e in entries}
    plain = run(mixture("mix.yaml", False), "mixed")
    groups = run(mixture("grouped.yaml", True), "grouped")
    print(f"end to end ({records} records per entry, 2 workers): alone " + ", ".join(
        f"{k} {s:.1f} s / {p} packs" for k, (s, p) in alone.items()))
    print(f"mixture {plain[0]:.1f} s, {plain[1]} packs; grouped {groups[0]:.1f} s, {groups[1]} packs; mixture / sum "
          f"of the entries alone {plain[0] / sum(s for s, _ in alone.values()):.2f}x seconds")


if __name__ == "__main__":
    main()
