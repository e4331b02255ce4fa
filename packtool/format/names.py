"""What the packed format calls things: its files and folders, the statuses, the media tags, the keys of
samples and packs, the rows of a pack, the entries of a reader batch."""

from __future__ import annotations

import re
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packtool.errors import FormatError

#: Version of the on-disk format (``Manifest.format``); a reader refuses a newer one.
FORMAT_VERSION = 2
META = ".nv-meta"
MANIFEST = f"{META}/packtool.json"
TOKENIZER_DIR = f"{META}/tokenizer"
#: Files of a model folder that decide the encoding (their bytes form the tokenizer fingerprint); an output's
#: ``TOKENIZER_DIR`` holds a copy of each the model folder has.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
LEDGER = "ledger.parquet"
#: Subflavor that marks a packed dataset (the Energon task encoder's cooker matches it).
SUBFLAVOR = {"packtool": 1}

Status = Literal["packed", "truncated", "dropped", "error"]
STATUSES: tuple[Status, ...] = ("packed", "truncated", "dropped", "error")
#: Statuses whose sample lies in a pack.
KEPT: tuple[Status, ...] = ("packed", "truncated")
MediaKind = Literal["image", "video", "audio"]
#: The tags a conversation's message text holds where an image, a video or an audio clip goes (adapters write
#: them; the encoder and the conventions lay the text out around them).
IMAGE_TAG, VIDEO_TAG, AUDIO_TAG = "<image>", "<video>", "<audio>"
MEDIA_TAGS: dict[MediaKind, str] = {"image": IMAGE_TAG, "video": VIDEO_TAG, "audio": AUDIO_TAG}
#: Any media tag.
TAG_PATTERN = re.compile("|".join(re.escape(t) for t in MEDIA_TAGS.values()))
_KIND_OF_TAG = {t: k for k, t in MEDIA_TAGS.items()}


def tag_kinds(text: str) -> list[MediaKind]:
    """Kinds of the media tags in ``text``, in order."""
    if "<" not in text:  # every tag starts with it
        return []
    return [_KIND_OF_TAG[m.group(0)] for m in TAG_PATTERN.finditer(text)]


# -- keys ------------------------------------------------------------------------------------------------------
def split_member(name: str) -> tuple[str, str]:
    """``dir/key.part.ext`` -> (``dir/key``, ``part.ext``): the sample key is the member path up to the first dot
    of its basename (WebDataset's ``base_plus_ext``, Energon's rule); a name without a dot has part ``""``."""
    head, _, base = name.rpartition("/")
    stem, _, part = base.partition(".")
    return (f"{head}/{stem}" if head else stem), part


def member_name(key: str, part: str) -> str:
    return f"{key}.{part}"


#: Digits of the pack number that ends a pack key.
PACK_NUMBER_DIGITS = 9


def record_position(number: int) -> str:
    """A record's position in a JSON/JSONL/Parquet/Arrow source as its ledger key and chunk label begin
    (``000000042``: sorts as the number)."""
    return f"{number:0{PACK_NUMBER_DIGITS}d}"


def copied_key(key: str, copy: int) -> str:
    """A sample's identity among the copies a mixture takes of it: its key, ``#k`` added for copy k > 0."""
    return f"{key}#{copy}" if copy else key


def pack_key(split: str, number: int) -> str:
    """Key of pack ``number`` (output order) of ``split``: unique across the dataset, no dots."""
    return f"{split}-{number:0{PACK_NUMBER_DIGITS}d}"


def pack_keys(split: str, numbers: np.ndarray) -> pa.Array:
    """:func:`pack_key` of each of ``numbers`` as an Arrow column (no Python string per row); null where a
    number is negative (a sample in no pack)."""
    digits = pc.utf8_lpad(pc.cast(pa.array(numbers, mask=numbers < 0), pa.string()), PACK_NUMBER_DIGITS, "0")
    return pc.binary_join_element_wise(pa.scalar(f"{split}-"), digits, "")


def pack_numbers(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The pack number of each of ``keys`` (made by :func:`pack_key`; no nulls), parsed by Arrow."""
    return pc.cast(pc.utf8_slice_codeunits(keys, start=-PACK_NUMBER_DIGITS), pa.int64()).to_numpy()


def in_split(key: str, split: str) -> bool:
    """Whether a pack key (see :func:`pack_key`) names a pack of ``split``."""
    number = key[len(split) + 1:]
    return key.startswith(f"{split}-") and len(number) == PACK_NUMBER_DIGITS and number.isdigit()


# -- rows ------------------------------------------------------------------------------------------------------
def aligned_lengths(lengths: np.ndarray, align: int) -> np.ndarray:
    """Each length rounded up to a multiple of ``align``: what a sample takes in a pack row (the planner's cost,
    the steps of ``cu_seqlens_padded``)."""
    return -(-lengths // align) * align


def row_length(pack_size: int, align: int) -> int:
    """Length of a full pack row: ``pack_size`` rounded down to a multiple of ``align``. The aligned lengths of a
    pack's samples sum to at most this, and no sample is longer."""
    return pack_size // align * align


def check_split_name(split: str) -> None:
    """A split name must make valid pack keys and shard paths (no dots, slashes or control characters) and fit
    a USTAR member name (``<split>/pack-NNNNNN.tar`` within 100 bytes)."""
    if not split or not re.fullmatch(r"[A-Za-z0-9_\-]+", split):
        raise FormatError(f"split name {split!r} cannot name packs: use letters, digits, '_' and '-' only")
    if len(shard_path(split, 0).encode()) > 100 or len(member_name(pack_key(split, 0), "targets.npy")) > 100:
        raise FormatError(f"split name {split!r} is too long for a tar member name (at most 80 characters)")


def shard_path(split: str, number: int) -> str:
    """Path of output shard ``number`` of ``split``, relative to OUTPUT."""
    return f"{split}/pack-{number:06d}.tar"


# -- reader batches ---------------------------------------------------------------------------------------------
#: A reader batch's entry naming the registered family whose trainer layouts the batch follows
#: (``FamilyReader.batch_family``): the layouts read it, never guess the family from the batch's keys.
BATCH_FAMILY = "family"
#: A reader batch's entry with the manifest's facts its trainer layouts need beside the tensors (media token ids, the
#: image processor's merge size: :func:`packtool.readkit.layout_context`), so a layout takes the batch alone.
BATCH_CONTEXT = "layout_context"
