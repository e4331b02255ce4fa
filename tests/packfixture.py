"""Write small packed datasets in the packtool format (DESIGN §4) for reader tests.

A stand-in for `packtool pack` output: the caller gives packs of already-encoded segments (tokens, target flags,
media bytes with their token spans) and gets an Energon-loadable OUTPUT folder. Also a tiny byte-level tokenizer
with the Qwen special tokens, so tests need nothing from a model hub.
"""

from __future__ import annotations

import functools
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import yaml

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
PAD_ID, IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID = range(256, 262)
VOCAB_SIZE = 262

QWEN_PROCESSOR = {
    "type": "qwen2_vl",
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 64,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


@functools.lru_cache(maxsize=1)
def tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821
    """Byte-level tokenizer without merges: 256 byte tokens, then SPECIALS (ids 256..261)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def make_tokenizer(directory: Path) -> None:
    """Save `tokenizer()` as a Hugging Face tokenizer folder."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer().save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": SPECIALS[0], "eos_token": SPECIALS[2]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def chat_segment(key: str, question: str, answer: str, images: list[tuple[bytes, str]] = (),
                 processor: dict = QWEN_PROCESSOR) -> dict:
    """A ChatML user/assistant exchange; targets are the answer and its `<|im_end|>`; images precede the question."""
    tok = tokenizer()
    ids, targets, media = [], [], []

    def add(text: str, target: bool = False) -> None:
        new = tok.encode(text).ids
        ids.extend(new)
        targets.extend([int(target)] * len(new))

    add("<|im_start|>user\n")
    for data, ext in images:
        add("<|vision_start|>")
        media.append(image_media(data, ext, len(ids), processor))
        ids.extend([IMAGE_PAD_ID] * media[-1]["tokens"])
        targets.extend([0] * media[-1]["tokens"])
        add("<|vision_end|>")
    add(f"{question}<|im_end|>\n<|im_start|>assistant\n")
    add(f"{answer}<|im_end|>", target=True)
    add("\n")
    return {"key": key, "tokens": ids, "targets": targets, "media": media}


def image_bytes(width: int, height: int, seed: int, fmt: str = "JPEG") -> bytes:
    """A random RGB image encoded as `fmt`."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def image_media(data: bytes, ext: str, token_offset: int, processor: dict = QWEN_PROCESSOR) -> dict:
    """Media entry for an image: grid and token count by the Qwen2-VL resize rule (DESIGN §6)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    width, height = Image.open(io.BytesIO(data)).size
    factor = processor["patch_size"] * processor["merge_size"]
    h, w = smart_resize(height, width, factor, processor["min_pixels"], processor["max_pixels"])
    grid = [1, h // processor["patch_size"], w // processor["patch_size"]]
    tokens = grid[1] * grid[2] // processor["merge_size"] ** 2
    return {"bytes": data, "ext": ext, "token_offset": token_offset, "tokens": tokens, "grid_thw": grid,
            "width": width, "height": height}


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def pack_record(segments: list[dict], *, pack_size: int, align: int, split: str) -> dict[str, bytes]:
    """Members (part name -> bytes) of one pack record.

    A segment is a dict: key, tokens, targets, and optionally media (from `image_media`), shard, truncated."""
    parts: dict[str, bytes] = {}
    seg_meta, number = [], 0
    for seg in segments:
        media_meta = []
        for m in seg.get("media", []):
            member = f"m{number}.{m['ext']}"
            number += 1
            parts[member] = m["bytes"]
            media_meta.append({"member": member, "kind": "image", "token_offset": m["token_offset"],
                               "tokens": m["tokens"], "grid_thw": m["grid_thw"], "width": m["width"],
                               "height": m["height"]})
        seg_meta.append({"key": seg["key"], "split": split, "shard": seg.get("shard", f"src/{split}-0000.tar"),
                         "truncated": seg.get("truncated", False), "media": media_meta})
    meta = {"pack_size": pack_size, "align": align, "packtool": "0.1.0", "segments": seg_meta}
    head = {
        "tokens.npy": npy(np.concatenate([np.asarray(s["tokens"], np.int32) for s in segments])),
        "targets.npy": npy(np.concatenate([np.asarray(s["targets"], np.uint8) for s in segments])),
        "seqlens.npy": npy(np.array([len(s["tokens"]) for s in segments], np.int32)),
        "json": json.dumps(meta).encode(),
    }
    return {**head, **parts}


def write_packs(
    out: Path,
    splits: dict[str, list[list[dict]]],
    *,
    pack_size: int,
    align: int = 1,
    image_processor: dict | None = None,
    image_token_id: int | None = IMAGE_PAD_ID,
    packs_per_shard: int = 1_000_000,
    with_tokenizer: bool = True,
) -> Path:
    """Write an Energon CrudeWebdataset of packs: `splits` maps split name -> list of packs (lists of segments)."""
    out = Path(out)
    meta = out / ".nv-meta"
    meta.mkdir(parents=True, exist_ok=True)
    shard_counts, split_parts = {}, {}
    for split, packs in splits.items():
        (out / split).mkdir(exist_ok=True)
        split_parts[split] = []
        for first in range(0, len(packs), packs_per_shard):
            name = f"{split}/pack-{first // packs_per_shard:06d}.tar"
            chunk = packs[first:first + packs_per_shard]
            records = [(f"{split}-{first + i:09d}", pack_record(p, pack_size=pack_size, align=align, split=split))
                       for i, p in enumerate(chunk)]
            _write_shard(out / name, records)
            shard_counts[name] = len(records)
            split_parts[split].append(name)
    (meta / "dataset.yaml").write_text(yaml.safe_dump(
        {"__module__": "megatron.energon", "__class__": "CrudeWebdataset", "subflavors": {"packtool": 1}}))
    (meta / "split.yaml").write_text(yaml.safe_dump({"split_parts": split_parts, "exclude": []}))
    (meta / ".info.json").write_text(json.dumps({"energon_version": "7.4.1", "shard_counts": shard_counts}))
    if with_tokenizer:
        make_tokenizer(meta / "tokenizer")
    manifest = {
        "packtool": "0.1.0", "format": 1, "pad_token_id": PAD_ID, "image_token_id": image_token_id,
        "vision_start_token_id": VISION_START_ID, "vision_end_token_id": VISION_END_ID, "eos_token_id": IM_END_ID,
        "settings": {"pack_size": pack_size, "align": align}, "image_processor": image_processor,
        "tokenizer": {"fingerprint": "fixture", "dir": ".nv-meta/tokenizer"},
        "counts": {s: {"packs": len(p)} for s, p in splits.items()},
    }
    (meta / "packtool.json").write_text(json.dumps(manifest, indent=1))
    return out


def _write_shard(path: Path, records: list[tuple[str, dict[str, bytes]]]) -> None:
    """Uncompressed USTAR tar, fixed metadata, plus the `.tar.idx` Energon needs for loading."""
    offsets = []
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, parts in records:
            offsets.append(tar.offset)
            for part, data in parts.items():
                info = tarfile.TarInfo(f"{key}.{part}")
                info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
                tar.addfile(info, io.BytesIO(data))
        offsets.append(tar.offset)
    np.asarray(offsets, dtype=np.uint64).tofile(str(path) + ".idx")
