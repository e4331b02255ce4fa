"""Sources: find the samples of an Energon dataset and turn each raw sample into a conversation.

`energon.py` scans (splits, shards, excludes, members with byte ranges); one small file per input format turns a
raw sample into a :class:`Conversation` (`conversation.py` for chat JSON, `typed.py` for Energon's typed
VQA/captioning datasets, `custom.py` for a user's ``module:function``).
"""

from packtool.packer.sources.energon import RawSample, SourceDataset, SourceError, open_source, read_raw_samples
from packtool.packer.sources.sample import Conversation, Media, SampleError

__all__ = [
    "Conversation",
    "Media",
    "RawSample",
    "SampleError",
    "SourceDataset",
    "SourceError",
    "open_source",
    "read_raw_samples",
]
