"""The packed format: every file packtool writes or reads (a typed class, or the function that writes it), and the
rules of keys and rows.

This package is the contract (with docs/format.md): the writer, the reader, ``verify``, ``inspect`` and the tests all
go through it, so a field is defined once. Its modules follow the files they describe: :mod:`~packtool.format.names`
(files, statuses, tags, keys, rows, reader batch entries), :mod:`~packtool.format.record` (a pack record's members),
:mod:`~packtool.format.metadata` (``split.yaml``, ``.info.json``, the manifest), :mod:`~packtool.format.ledger` and
:mod:`~packtool.format.energon` (Energon's metadata as written); every name is also here.

OUTPUT layout::

    .nv-meta/dataset.yaml    CrudeWebdataset with subflavors {packtool: 1} (write_energon_metadata)
    .nv-meta/split.yaml      SplitYaml     split -> shard paths (also read from the source dataset)
    .nv-meta/.info.json      InfoJson      shard -> record count (+ .info.yaml for Energon <= 6)
    .nv-meta/index.sqlite    Energon's sample index (Energon's schema) + index.uuid (write_energon_metadata)
    .nv-meta/packtool.json   Manifest      written last: an OUTPUT with a manifest is complete
    .nv-meta/tokenizer/      the model folder's tokenizer files, so readers need nothing but OUTPUT
    <split>/pack-NNNNNN.tar  one PackRecord per pack (+ .tar.idx)
    ledger.parquet           one row per source sample (LEDGER_SCHEMA)

Keys follow WebDataset's and Energon's rule (:func:`split_member`): a tar member ``dir/KEY.part.ext`` belongs to
sample ``dir/KEY`` as part ``part.ext``; the members of a sample are adjacent.
"""

from __future__ import annotations

from packtool.format.energon import (
    IndexedRecord,
    energon_dataset_yaml,
    write_energon_metadata,
)
from packtool.format.ledger import (
    LEDGER_SCHEMA,
    MIXTURE_LEDGER_COLUMNS,
    WEIGHT_LEDGER_COLUMN,
)
from packtool.format.metadata import (
    MAX_YAML_NODES,
    InfoJson,
    Manifest,
    SplitYaml,
    load_manifest,
    read_mapping,
    safe_relative,
    split_shard_paths,
    yaml_bytes,
)
from packtool.format.names import (
    AUDIO_TAG,
    BATCH_CONTEXT,
    BATCH_FAMILY,
    FORMAT_VERSION,
    IMAGE_TAG,
    KEPT,
    LEDGER,
    MANIFEST,
    MEDIA_TAGS,
    META,
    PACK_NUMBER_DIGITS,
    STATUSES,
    SUBFLAVOR,
    TAG_PATTERN,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    VIDEO_TAG,
    MediaKind,
    Status,
    aligned_lengths,
    check_split_name,
    copied_key,
    in_split,
    member_name,
    pack_key,
    pack_keys,
    pack_numbers,
    record_position,
    row_length,
    shard_path,
    split_member,
    tag_kinds,
)
from packtool.format.record import (
    ARRAYS,
    MediaRef,
    PackRecord,
    Segment,
    arrays_digest,
    load_npy,
    npy_bytes,
    sha256,
    span_problems,
    tokenizer_fingerprint,
)

__all__ = [
    "ARRAYS",
    "AUDIO_TAG",
    "BATCH_CONTEXT",
    "BATCH_FAMILY",
    "FORMAT_VERSION",
    "IMAGE_TAG",
    "IndexedRecord",
    "InfoJson",
    "KEPT",
    "LEDGER",
    "LEDGER_SCHEMA",
    "MANIFEST",
    "MAX_YAML_NODES",
    "MEDIA_TAGS",
    "META",
    "MIXTURE_LEDGER_COLUMNS",
    "Manifest",
    "MediaKind",
    "MediaRef",
    "PACK_NUMBER_DIGITS",
    "PackRecord",
    "STATUSES",
    "SUBFLAVOR",
    "Segment",
    "SplitYaml",
    "Status",
    "TAG_PATTERN",
    "TOKENIZER_DIR",
    "TOKENIZER_FILES",
    "VIDEO_TAG",
    "WEIGHT_LEDGER_COLUMN",
    "aligned_lengths",
    "arrays_digest",
    "check_split_name",
    "copied_key",
    "energon_dataset_yaml",
    "in_split",
    "load_manifest",
    "load_npy",
    "member_name",
    "npy_bytes",
    "pack_key",
    "pack_keys",
    "pack_numbers",
    "read_mapping",
    "record_position",
    "row_length",
    "safe_relative",
    "sha256",
    "shard_path",
    "span_problems",
    "split_member",
    "split_shard_paths",
    "tag_kinds",
    "tokenizer_fingerprint",
    "write_energon_metadata",
    "yaml_bytes",
]
