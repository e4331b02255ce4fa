"""Benchmark ``packtool pack`` from and to an object store against the same pack on local disk.

    PYTHONPATH=... .venv/bin/python bench/bench_objstore.py [--samples 2000] [--image-fraction 0.3]

The object store is moto's S3-compatible server on loopback (started here, as the tests do), reached through a
multi-storage-client profile, so the numbers show packtool's own cost of ranged reads and whole-object puts (no
network latency). Both packs run in this process (one worker) so every request is counted. Prints samples/s of
each, the ratio, and the bytes requested from the store per byte of output (all of it, and the source shards'
part), plus the bytes put. The two outputs are checked equal (but for the manifest, which names the source).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))

import demo  # noqa: E402
import objstore  # noqa: E402
from packtool import storage  # noqa: E402
from packtool.format import MANIFEST  # noqa: E402
from packtool.packer.pipeline import pack  # noqa: E402
from packtool.settings import EncodeSettings, PackSettings, PlanSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--image-fraction", type=float, default=0.3)
    ap.add_argument("--pack-size", type=int, default=4096)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="packtool-bench-objstore-"))
    data, tok = work / "dataset", work / "tokenizer"
    demo.build_dataset(data, n_train=args.samples, n_val=0, samples_per_shard=500,
                       image_fraction=args.image_fraction, long_fraction=0.01)
    demo.build_tokenizer(tok)
    store = objstore.start(work, "bench")
    try:
        source = store.upload_tree(data, "dataset")
        settings = PackSettings(EncodeSettings(tokenizer=str(tok), pack_size=args.pack_size),
                                PlanSettings(shard_size="64MB"), splits=("train",))
        t = time.perf_counter()
        local = pack(data, work / "packed", settings, workers=1, progress=False)
        disk_s = time.perf_counter() - t
        n = local.counts["train"]["samples"]

        storage.REQUESTED.reset()
        t = time.perf_counter()
        remote_run = pack(source, store.url("packed"), settings, workers=1, progress=False)
        store_s = time.perf_counter() - t
        requested, count, put = storage.REQUESTED.bytes, storage.REQUESTED.count, storage.REQUESTED.put
        from_source = sum(n for url, n in storage.REQUESTED.per_object.items() if url.startswith(source + "/"))

        files = {str(p.relative_to(work / "packed")): p for p in (work / "packed").rglob("*")
                 if p.is_file() and ".packtool" not in p.relative_to(work / "packed").parts}
        out_bytes = sum(p.stat().st_size for p in files.values())
        src_bytes = sum(p.stat().st_size for p in (data / "shards").glob("*.tar"))
        remote = store.digest("packed")
        same = all(remote[k] == hashlib.sha256(p.read_bytes()).hexdigest() for k, p in files.items() if k != MANIFEST)
        same = same and len(remote) == len(files)
        print(f"{n} samples (image fraction {args.image_fraction}), source {src_bytes / 2**20:.1f} MiB, "
              f"output {out_bytes / 2**20:.1f} MiB; outputs equal but the manifest: {same}")
        for name, seconds, run in (("disk -> disk:  ", disk_s, local), ("store -> store:", store_s, remote_run)):
            stages = ", ".join(f"{k} {v:.1f}" for k, v in run.seconds.items())
            print(f"{name} {seconds:6.2f} s, {n / seconds:6.0f} samples/s ({stages})")
        print(f"store / disk time: {store_s / disk_s:.2f}x")
        print(f"requested {requested / 2**20:.1f} MiB in {count} requests: {requested / out_bytes:.2f} bytes per "
              f"byte of output; from the source {from_source / src_bytes:.2f} bytes per byte of source "
              f"({from_source / out_bytes:.2f} per byte of output), the rest from the encode store and metadata; "
              f"put {put / 2**20:.1f} MiB ({put / out_bytes:.2f} per byte of output, the encode store included)")
    finally:
        store.stop()


if __name__ == "__main__":
    main()
