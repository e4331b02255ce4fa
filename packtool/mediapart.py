"""The media part of a reader batch: a family's media tensors as typed fields (:class:`MediaPart`).

Each family's reader names its part's class (``FamilyReader.media_part``, a subclass of :class:`MediaPart` in the
family's home) and its reader batches (:class:`packtool.readkit.ReaderBatch`) hold one as ``media``; the batch's
media keys are the part's field names. This module imports nothing of packtool (and no torch), so the families'
reader classes, which load no tensor code, stand on it as the reader kit does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["MediaPart"]

#: Each part class's field names (read on every key access, so computed once per class).
_NAMES: dict[type, tuple[str, ...]] = {}


@dataclass(eq=False)
class MediaPart(MutableMapping[str, Any]):
    """A reader batch's media: one typed field per media entry its family's reader gives (None: this batch has
    none of it, and it is no key), read by attribute or by key; entries a caller adds under other keys are kept
    in :attr:`extra`, after the fields. The base part has no fields (a family whose packs carry no media)."""

    #: Entries under keys that are not the part's fields (what a caller adds; what a model's own processor gives).
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The part's media fields, in declaration order (``extra`` is none of them)."""
        names = _NAMES.get(cls)
        if names is None:
            names = _NAMES[cls] = tuple(f.name for f in fields(cls) if f.name != "extra")
        return names

    @classmethod
    def of(cls, entries: Mapping[str, Any]) -> MediaPart:
        """A part from entries by key: the part's fields, every other entry kept in :attr:`extra`."""
        names = set(cls.field_names())
        return cls(**{k: v for k, v in entries.items() if k in names},
                   extra={k: v for k, v in entries.items() if k not in names})

    def __getitem__(self, key: str) -> Any:
        if key in self.field_names():
            value = getattr(self, key)
            if value is None:
                raise KeyError(key)
            return value
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self.field_names():
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self.field_names():
            if getattr(self, key) is None:
                raise KeyError(key)
            setattr(self, key, None)
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        for name in self.field_names():
            if getattr(self, name) is not None:
                yield name
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self)})"
