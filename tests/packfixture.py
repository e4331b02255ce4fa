"""Write small packed datasets in the packtool format for reader tests.

A stand-in for `packtool pack` output: the caller gives packs of already-encoded segments (tokens, target flags,
media bytes with their token spans) and gets an Energon-loadable OUTPUT folder. Also a tiny byte-level tokenizer
with the Qwen special tokens, so tests need nothing from a model hub.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from packtool.format import (
    FORMAT_VERSION,
    MANIFEST,
    TOKENIZER_DIR,
    Manifest,
    MediaRef,
    PackRecord,
    Segment,
    npy_bytes,
    pack_key,
    sha256,
    shard_path,
    split_shard_paths,
    write_energon_metadata,
)
from packtool.shards import scan_records, write_tar

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
def tokenizer() -> tokenizers.Tokenizer:  # noqa: F821
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
    """Media entry for an image: grid and token count by the Qwen2-VL resize rule."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    width, height = Image.open(io.BytesIO(data)).size
    factor = processor["patch_size"] * processor["merge_size"]
    h, w = smart_resize(height, width, factor, processor["min_pixels"], processor["max_pixels"])
    grid = [1, h // processor["patch_size"], w // processor["patch_size"]]
    tokens = grid[1] * grid[2] // processor["merge_size"] ** 2
    return {"bytes": data, "ext": ext, "token_offset": token_offset, "tokens": tokens, "grid_thw": grid,
            "width": width, "height": height}


def record(segments: list[dict], *, pack_size: int, align: int, split: str, key: str = "") -> PackRecord:
    """One pack record. A segment is a dict: key, tokens, targets, and optionally media (from `image_media`),
    shard, truncated."""
    media: dict[str, bytes] = {}
    segs = []
    for seg in segments:
        refs = []
        for m in seg.get("media", []):
            member = f"m{len(media)}.{m['ext']}"
            media[member] = m["bytes"]
            refs.append(MediaRef(member=member, kind="image", token_offset=m["token_offset"], tokens=m["tokens"],
                                 grid_thw=m["grid_thw"], width=m["width"], height=m["height"],
                                 size=len(m["bytes"]), sha256=sha256(m["bytes"])))
        segs.append(Segment(seg["key"], split, seg.get("shard", f"src/{split}-0000.tar"),
                            seg.get("truncated", False), refs))
    return PackRecord(
        key, np.concatenate([np.asarray(s["tokens"], np.int32) for s in segments]),
        np.concatenate([np.asarray(s["targets"], np.uint8) for s in segments]),
        np.array([len(s["tokens"]) for s in segments], np.int32), pack_size, align, segs, media, "0.1.0")


def pack_record(segments: list[dict], *, pack_size: int, align: int, split: str) -> dict[str, bytes]:
    """``{part: bytes}`` of one pack record (see :func:`record`), as a loader hands it over."""
    return dict(record(segments, pack_size=pack_size, align=align, split=split).to_members())


npy = npy_bytes


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
    split_parts: dict[str, list[str]] = {}
    indexes = {}
    for split, packs in splits.items():
        split_parts[split] = []
        for first in range(0, len(packs), packs_per_shard):
            name = shard_path(split, first // packs_per_shard)
            chunk = packs[first:first + packs_per_shard]
            records = [record(p, pack_size=pack_size, align=align, split=split, key=pack_key(split, first + i))
                       for i, p in enumerate(chunk)]
            indexes[name] = write_tar(out / name, ((r.key, r.to_members()) for r in records))
            split_parts[split].append(name)
    write_energon_metadata(out, split_parts, indexes, "7.4.1")
    if with_tokenizer:
        make_tokenizer(out / TOKENIZER_DIR)
    manifest = Manifest(
        packtool="0.1.0", format=FORMAT_VERSION, fingerprint={}, settings={"pack_size": pack_size, "align": align},
        source="fixture", splits=split_parts, tokenizer={"fingerprint": "fixture", "dir": TOKENIZER_DIR},
        pad_token_id=PAD_ID, eos_token_id=IM_END_ID, image_token_id=image_token_id,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID, image_processor=image_processor,
        seed=0, counts={}, packs={s: len(p) for s, p in splits.items()},
    )
    (out / MANIFEST).write_bytes(manifest.to_bytes())
    return out


def packed_segments(output: Path, split: str = "train") -> Iterator[tuple[Segment, np.ndarray, np.ndarray, dict]]:
    """``(segment, tokens, targets, media members of its pack)`` of every pack of a split, in on-disk order, read
    from the tars themselves (their headers, not ``.tar.idx``) through the format's own record rules."""
    for shard in split_shard_paths(output, split):
        for key, members in scan_records(shard):
            record = PackRecord.from_members(key, members)
            starts = record.segment_starts()
            for seg, a, b in zip(record.segments, starts[:-1], starts[1:]):
                yield seg, record.tokens[a:b], record.targets[a:b], record.media
