"""Benchmark ``packtool pack`` stage by stage on a generated dataset, against bare tokenization of the same texts.

    .venv/bin/python bench/bench_pack.py [--samples 20000] [--workers 1] [--image-fraction 0.3] [--tokenizer DIR]

Prints seconds for scan+encode, plan and write, samples/s and tokens/s, and the tokenizer-only throughput on the
very texts the encoder rendered (batch mode, same process), with the ratio between the two.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402
from packtool.packer.encoder import get_encoder  # noqa: E402
from packtool.packer.pipeline import pack  # noqa: E402
from packtool.packer.sources import open_source, read_raw_samples  # noqa: E402
from packtool.settings import EncodeSettings, PackSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--image-fraction", type=float, default=0.3)
    ap.add_argument("--pack-size", type=int, default=4096)
    ap.add_argument("--tokenizer", type=Path, default=None, help="model folder (default: the demo tokenizer)")
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temp folder)")
    args = ap.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="packtool-bench-"))
    data, out = work / "dataset", work / "packed"
    tok = args.tokenizer or work / "tokenizer"
    t = time.perf_counter()
    if not (data / ".nv-meta").exists():
        demo.build_dataset(data, n_train=args.samples, n_val=0, samples_per_shard=1000,
                           image_fraction=args.image_fraction, long_fraction=0.01)
    if args.tokenizer is None and not (tok / "tokenizer.json").exists():
        demo.build_tokenizer(tok)
    print(f"dataset: {args.samples} samples, image fraction {args.image_fraction} "
          f"(built in {time.perf_counter() - t:.1f} s)")

    shutil.rmtree(out, ignore_errors=True)
    settings = PackSettings(EncodeSettings(tokenizer=str(tok), pack_size=args.pack_size), splits=("train",))
    result = pack(data, out, settings, workers=args.workers, progress=False)
    n = result.counts["train"]["samples"]
    import pyarrow.parquet as pq

    tokens = int(pq.read_table(out / "ledger.parquet", columns=["tokens"]).column("tokens").to_numpy().sum())
    s = result.seconds
    print(f"pack (workers={args.workers}): " + ", ".join(f"{k} {v:.2f} s" for k, v in s.items()))
    print(f"  scan+encode: {n / s['scan+encode']:,.0f} samples/s, {tokens / s['scan+encode']:,.0f} tokens/s")
    print(f"  plan: {n / max(s['plan'], 1e-9):,.0f} samples/s; write: {tokens / max(s['write'], 1e-9):,.0f} tokens/s")

    # Tokenizer alone on the same rendered texts, batched as the encoder batches them.
    src = open_source(data, ["train"])
    enc = get_encoder(settings.encode, src.dataset_yaml)
    texts = []
    t = time.perf_counter()
    for shard in src.splits["train"]:
        for raw in read_raw_samples(src.root, shard, src.excluded_samples):
            try:
                texts.append(enc.target_spans(enc.conversation(raw).messages)[0])
            except Exception:
                pass
    render = time.perf_counter() - t
    t = time.perf_counter()
    n_tok = 0
    for i in range(0, len(texts), 256):
        batch = enc.tok.backend_tokenizer.encode_batch(texts[i:i + 256], add_special_tokens=False)
        n_tok += sum(len(x.ids) for x in batch)
    tok_s = time.perf_counter() - t
    print(f"tokenizer only: {n_tok / tok_s:,.0f} text tokens/s ({tok_s:.2f} s for {len(texts)} texts; "
          f"rendering alone {render:.2f} s)")
    print(f"ratio scan+encode / tokenizer-only time: {s['scan+encode'] / tok_s:.2f}x")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
