"""The ledger (``ledger.parquet``): one row per source sample, with its status, its reason and its pack."""

from __future__ import annotations

import pyarrow as pa

#: ``ledger.parquet``: one row per source sample, its fate.
LEDGER_SCHEMA = pa.schema([
    ("key", pa.string()),  # sample key in its source shard (``#unreadable-after-N``: a shard's unreadable tail)
    ("split", pa.string()),
    ("shard", pa.string()),  # source shard path relative to the source root
    ("status", pa.string()),  # one of STATUSES
    ("reason", pa.string()),  # why, unless ``packed`` (empty then)
    ("tokens", pa.int32()),  # tokens in the pack (after truncation; 0 unless kept)
    ("targets", pa.int32()),  # training targets in the pack
    ("images", pa.int32()),  # media items in the pack
    ("image_tokens", pa.int32()),  # placeholder tokens of those media
    ("pack", pa.string()),  # pack key (see pack_key), null unless kept
    ("source_tokens", pa.int32()),  # length before truncation (0 if encoding failed)
])
#: A mixture's ledger adds the sample's dataset (its name in the manifest's ``mixture``) and its copy number: one
#: row per copy its dataset's proportion took (``copy`` 0 for the first; a sample not kept has one row).
MIXTURE_LEDGER_COLUMNS = ("dataset", "copy")
#: The ledger of an output where some sample's loss weight is not 1 adds it (float64, last): the sample's own
#: ``loss_weight`` times its mixture dataset's.
WEIGHT_LEDGER_COLUMN = "loss_weight"
#: The entry of every reader batch (``packtool.runtime.read.pack_to_batch``) that names the registered family whose
