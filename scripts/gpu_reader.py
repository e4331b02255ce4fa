"""Reader batches on a GPU: packs read on the host and the same packs moved to a device must agree exactly.

Each pack of a packed OUTPUT's split is read once on the host (`read_packs`) and compared, tensor by tensor (device,
dtype, shape, values), with the same pack reaching the device three ways:

* `read_packs(path, device=...)`: `batch_to`'s non-blocking copies from pageable host memory;
* `DataLoader(PackDataset(path, shuffle=False), batch_size=None, num_workers=2, pin_memory=True)` then `batch_to`:
  non-blocking copies from pinned memory, used at once; the loader must also keep the on-disk pack order;
* `to_megatron(batch, device)` against `megatron_bridge_batch(batch)`: every tensor on the device except the host
  keys (`max_seqlen_*` stay on the host), `visual_inputs` and `packed_seq_params` fields included.

Non-tensor values (sample keys, pack key, `max_seqlen`) must come through unchanged.

    python scripts/gpu_reader.py OUTPUT                 # CUDA, images and videos decoded
    python scripts/gpu_reader.py OUTPUT --device cpu    # same comparisons on the host (no pinned memory)

Prints PASS/FAIL per way in; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable
from itertools import islice
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from packtool.runtime.loader import PackDataset  # noqa: E402
from packtool.runtime.megatron_batch import HOST_KEYS, megatron_bridge_batch, to_megatron  # noqa: E402
from packtool.runtime.read import batch_to, read_packs  # noqa: E402


def mismatches(name: str, got, want, device: torch.device) -> list[str]:
    """Where `got` (tensors expected on `device`) differs from the host value `want`; nested values recursively."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{name}: {type(got).__name__}, not a tensor"]
        if got.device.type != device.type:
            return [f"{name}: on {got.device}, not {device}"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{name}: {got.dtype} {tuple(got.shape)}, host {want.dtype} {tuple(want.shape)}"]
        return [] if torch.equal(got.cpu(), want) else [f"{name}: values differ"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return [f"{name}: keys {sorted(got) if isinstance(got, dict) else got!r}, host {sorted(want)}"]
        return [m for k in want for m in mismatches(f"{name}.{k}", got[k], want[k], device)]
    if dataclasses.is_dataclass(want) and not isinstance(want, type):
        if type(got) is not type(want):
            return [f"{name}: {type(got).__name__}, host {type(want).__name__}"]
        return [m for f in dataclasses.fields(want)
                for m in mismatches(f"{name}.{f.name}", getattr(got, f.name), getattr(want, f.name), device)]
    return [] if got == want else [f"{name}: {got!r}, host {want!r}"]


def megatron_mismatches(batch: dict, device: torch.device) -> list[str]:
    """`to_megatron(batch, device)` against the host `megatron_bridge_batch(batch)`."""
    got, want = to_megatron(batch, device), megatron_bridge_batch(batch)
    found = [f"to_megatron.{key}: on {got[key].device}, must stay on the host"
             for key in HOST_KEYS if got[key].device.type != "cpu"]
    found += [m for key, value in want.items() if key not in HOST_KEYS
              for m in mismatches(f"to_megatron.{key}", got[key], value, device)]
    params = got["packed_seq_params"]
    fields = params if isinstance(params, dict) else vars(params)
    for key in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        found += mismatches(f"packed_seq_params.{key}", fields[key], want[key], device)
    found += [f"packed_seq_params.{key}: {fields[key]!r}, batch {int(want[key])}"
              for key in ("max_seqlen_q", "max_seqlen_kv") if fields[key] != int(want[key])]
    return found


def check(label: str, pairs: Iterable[tuple[dict, dict]], device: torch.device, count: int) -> bool:
    """Compare `(device batch, host batch)` pairs; print one PASS/FAIL line (and the first mismatches)."""
    found, seen, media = [], 0, 0
    for got, want in pairs:
        seen += 1
        media += sum(len(want[k]) for k in ("image_grid_thw", "video_grid_thw") if k in want)
        found += mismatches(f"pack {want['pack_key']}", got, want, device)
    if seen != count:
        found.append(f"{seen} packs, expected {count}")
    print(f"{'FAIL' if found else 'PASS'}  {label:44} {seen} packs, {media} images/videos")
    for line in found[:10]:
        print(f"      {line}")
    return not found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", type=Path, help="a packed OUTPUT folder")
    ap.add_argument("--split", default="train")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--packs", type=int, default=16, help="first N packs of the split")
    ap.add_argument("--no-images", dest="images", action="store_false", help="skip decoding images and videos")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}")

    host = list(islice(read_packs(args.output, args.split, images=args.images), args.packs))
    n = len(host)
    moved = islice(read_packs(args.output, args.split, images=args.images, device=device), n)
    ok = check("read_packs(device=...)", zip(moved, host), device, n)

    pinned = device.type == "cuda"
    loader = torch.utils.data.DataLoader(PackDataset(args.output, args.split, shuffle=False, images=args.images),
                                         batch_size=None, num_workers=2, pin_memory=pinned)
    ok &= check(f"DataLoader(pin_memory={pinned}) + batch_to", ((batch_to(b, device), h)
                                                             for b, h in zip(islice(loader, n), host)), device, n)

    found = [m for batch in host for m in megatron_mismatches(batch, device)]
    print(f"{'FAIL' if found else 'PASS'}  {'to_megatron vs megatron_bridge_batch':44} {n} packs")
    for line in found[:10]:
        print(f"      {line}")
    ok &= not found
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
