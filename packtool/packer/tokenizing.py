"""Batched tokenization that also answers "which token holds character *i*" — without the tokenizer's own
offset tracking where that can be proven unnecessary.

Encoding needs both a text's ids and where its replies and media start in tokens. A fast tokenizer's
``encode_batch`` records character offsets for every token, which costs about a fifth of its time. For a
byte-level BPE tokenizer (GPT-2, Qwen, Llama 3, Nemotron) every token is a byte string and the text's UTF-8 bytes
are exactly its tokens' bytes, one after the other, whenever nothing in the pipeline rewrote the text (a
normalizer that changed it, a prefix space, an added token that swallows the whitespace beside it). So
:class:`Tokenizing` calls ``encode_batch_fast`` (ids only), checks each text byte for byte against the
concatenation of its tokens (one numpy comparison per batch), and takes token positions from the tokens'
cumulative byte lengths. A text that fails the check — or any text of a tokenizer that is not byte-level, or
whose post-processor trims offsets — is encoded again with the tokenizer's offsets: the answers are the same
either way (tests compare both on every tokenizer packtool ships or tests with).

A tokenizer whose normalizer is only Unicode normal forms (Qwen's NFC) spends about a tenth of its time
normalizing text that is already in that form, which is almost every text. Such a text is encoded with the
normalizer set aside for the call: the normalizer would have returned it unchanged, so the ids are the same.
The backend is therefore not to be used from another thread while :meth:`Tokenizing.encode` runs.

>>> from tokenizers import Tokenizer  # doctest: +SKIP
>>> tokens = Tokenizing(Tokenizer.from_file("tokenizer.json")).encode(["<|im_start|>user\\nhi"])[0]  # doctest: +SKIP
>>> tokens.token_at(13, len(tokens)), tokens.covering(13, len(tokens))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any, Literal, Protocol, cast

import numpy as np

#: Code points below this may be byte-level symbols (the alphabet ends at U+0143).
_SYMBOLS = 0x200
#: Characters of text compared with their tokens' bytes at once (the comparison holds ~10 bytes per character).
_CHECK_CHARS = 1 << 21
#: A batch of at least this many texts, most of which fail the byte check, turns the byte path off.
_GIVE_UP_AFTER = 32
#: Texts per ``encode_batch_fast`` call.
_FAST_BATCH = 64
NormalForm = Literal["NFC", "NFD", "NFKC", "NFKD"]
#: Normalizers that only bring text to a Unicode normal form.
_NORMAL_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


class Tokens(Protocol):
    """A text's token ids and where its characters went."""

    #: Token ids (int64).
    ids: np.ndarray

    def __len__(self) -> int: ...

    def token_at(self, pos: int, n: int) -> int:
        """Index of the first token that starts at character ``pos`` or later (at most ``n``)."""

    def covering(self, pos: int, n: int) -> int | None:
        """Index of the token that covers character ``pos`` (at most ``n``); None if no token covers it."""


class OffsetTokens:
    """:class:`Tokens` from the tokenizer's own character offsets (a ``tokenizers.Encoding``)."""

    def __init__(self, encoding: Any, text_len: int):
        self.encoding, self.text_len = encoding, text_len
        self.ids = np.asarray(encoding.ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def token_at(self, pos: int, n: int) -> int:
        probe, token = pos, self.encoding.char_to_token(pos)
        while token is None:  # a character no token covers: the next one that is covered
            probe += 1
            if probe >= self.text_len:
                return n
            token = self.encoding.char_to_token(probe)
        if self.encoding.token_to_chars(token)[0] < pos:
            token += 1
        return min(token, n)

    def covering(self, pos: int, n: int) -> int | None:
        token = self.encoding.char_to_token(pos)
        return None if token is None else min(token, n)


class ByteTokens:
    """:class:`Tokens` of a text whose UTF-8 bytes are exactly its tokens' bytes in order (checked by
    :class:`Tokenizing`): a token's position is where its bytes start."""

    def __init__(self, ids: np.ndarray, starts: np.ndarray, text: str, base: int = 0):
        self.ids = ids
        self.starts = starts  # byte offset of each token, increasing: ``base`` where the text begins
        self.text, self.base = text, base
        self._char_bytes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def _byte(self, pos: int) -> int:
        """Byte offset of character ``pos`` in the terms of ``starts`` (past its end: where the text ends)."""
        if self.text.isascii():
            return self.base + min(pos, len(self.text))
        if self._char_bytes is None:  # the byte offset of every character, once
            code = np.frombuffer(self.text.encode("utf-32-le"), dtype=np.uint32)
            width = 1 + (code >= 0x80) + (code >= 0x800) + (code >= 0x10000)
            self._char_bytes = np.concatenate([[0], np.cumsum(width)])
        return self.base + int(self._char_bytes[min(pos, len(self.text))])

    def token_at(self, pos: int, n: int) -> int:
        return min(int(self.starts.searchsorted(self._byte(pos), side="left")), n)

    def covering(self, pos: int, n: int) -> int | None:
        if pos >= len(self.text):
            return None
        return min(int(self.starts.searchsorted(self._byte(pos), side="right")) - 1, n)


class Tokenizing:
    """Tokenizes batches of texts with a ``tokenizers.Tokenizer`` (no special tokens added); see the module
    docstring. A text the tokenizer refuses comes back as the exception it raised."""

    def __init__(self, backend: Any, vocab: dict[str, int] | None = None):
        """``vocab``: the backend's ``get_vocab(with_added_tokens=True)`` when the caller has it already."""
        self.backend = backend
        self.table = _ByteTable.of(backend, vocab)
        #: The normal forms the backend's normalizer applies, where that is all it does (else None).
        self.forms = normal_forms(backend) if self.table is not None else None

    def encode(self, texts: list[str]) -> list[Tokens | Exception]:
        if not texts:
            return []
        out: list[Tokens | Exception | None] = [None] * len(texts)
        if self.table is not None and hasattr(self.backend, "encode_batch_fast"):
            try:
                fast = encode_fast(self.backend, texts, self.forms)
            except Exception:  # the batch fails as a whole: each text on its own below
                fast = None
            if fast is not None:
                ids = [np.asarray(e.ids, dtype=np.int64) for e in fast]
                a = 0
                while a < len(texts):  # checked in groups of about _CHECK_CHARS characters: bounded memory
                    b, size = a + 1, len(texts[a])
                    while b < len(texts) and size + len(texts[b]) <= _CHECK_CHARS:
                        size += len(texts[b])
                        b += 1
                    for i, tokens in self.table.check(texts[a:b], ids[a:b]):
                        out[a + i] = tokens
                    a = b
        slow = [i for i, t in enumerate(out) if t is None]
        if self.table is not None and len(texts) >= _GIVE_UP_AFTER and len(slow) * 2 > len(texts):
            self.table = None  # this tokenizer rewrites most texts: every text would be tokenized twice
        if slow:
            for i, encoding in zip(slow, self._with_offsets([texts[i] for i in slow])):
                out[i] = encoding if isinstance(encoding, Exception) else OffsetTokens(encoding, len(texts[i]))
        return out  # type: ignore[return-value]

    def _with_offsets(self, texts: list[str]) -> list[Any]:
        try:
            return list(self.backend.encode_batch(texts, add_special_tokens=False))
        except Exception:
            out: list[Any] = []
            for t in texts:
                try:
                    out.append(self.backend.encode(t, add_special_tokens=False))
                except Exception as exc:
                    out.append(exc)
            return out


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: each byte's stand-in character in a byte-level BPE vocabulary (printable Latin-1
    bytes stand for themselves, the other 68 for characters from U+0100 on, in byte order)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return chars


def _state(component: Any) -> dict | None:
    """A tokenizer component's settings as its JSON says them (None for no component)."""
    return None if component is None else json.loads(component.__getstate__())


def encode_fast(backend: Any, texts: list[str], forms: tuple[NormalForm, ...] | None) -> list[Any]:
    """``encode_batch_fast`` of each text (no special tokens added), in small batches (measured faster than one
    large batch; the same ids). ``forms``: the backend's :func:`normal_forms`; a text already in them is encoded
    with the normalizer set aside (it would leave the text as it is), so the backend must not be used from another
    thread meanwhile."""
    def batches(some: list[str]) -> list[Any]:
        return [e for k in range(0, len(some), _FAST_BATCH)
                for e in backend.encode_batch_fast(some[k:k + _FAST_BATCH], add_special_tokens=False)]

    if not forms:
        return batches(texts)
    plain = [t.isascii() or all(unicodedata.is_normalized(f, t) for f in forms) for t in texts]
    out: list[Any] = [None] * len(texts)
    rest = [i for i, p in enumerate(plain) if not p]
    for i, e in zip(rest, batches([texts[i] for i in rest])):
        out[i] = e
    kept = [i for i, p in enumerate(plain) if p]
    normalizer = backend.normalizer
    backend.normalizer = None
    try:
        encoded = batches([texts[i] for i in kept])
    finally:
        backend.normalizer = normalizer
    for i, e in zip(kept, encoded):
        out[i] = e
    return out


def normal_forms(backend: Any) -> tuple[NormalForm, ...] | None:
    """The Unicode normal forms a tokenizer's normalizer brings text to, in order, where that is all it does
    (``()``: no normalizer); None for any other normalizer."""
    try:
        return _normal_forms(_state(backend.normalizer))
    except (AttributeError, TypeError, ValueError):  # a component without a JSON state
        return None


def _normal_forms(state: dict | None) -> tuple[NormalForm, ...] | None:
    """:func:`normal_forms` of a normalizer's JSON state."""
    if state is None:
        return ()
    kind = state.get("type")
    if kind in _NORMAL_FORMS:
        return (cast(NormalForm, kind),)
    if kind != "Sequence":
        return None
    forms: list[NormalForm] = []
    for part in state.get("normalizers", []):
        inner = _normal_forms(part)
        if inner is None:
            return None
        forms.extend(inner)
    return tuple(forms)


def _has_byte_level(state: dict | None) -> bool:
    if state is None:
        return False
    if state.get("type") == "Sequence":
        return any(_has_byte_level(s) for s in state.get("pretokenizers", []))
    return state.get("type") == "ByteLevel"


def _keeps_offsets(state: dict | None) -> bool:
    """Whether a post-processor leaves the offsets of a text encoded without special tokens untouched."""
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_keeps_offsets(s) for s in state.get("processors", []))
    if kind == "ByteLevel":
        return not state.get("trim_offsets", False)
    return kind in ("TemplateProcessing", "BertProcessing")


class _ByteTable:
    """Every token's bytes, flat: ``data[start[i]:start[i] + length[i]]`` (``length`` -1: no byte string)."""

    def __init__(self, data: np.ndarray, start: np.ndarray, length: np.ndarray):
        self.data, self.start, self.length = data, start, length

    @classmethod
    def of(cls, backend: Any, vocab: dict[str, int] | None = None) -> _ByteTable | None:
        """The table of a byte-level tokenizer whose post-processor keeps offsets; None for any other."""
        try:
            if not _has_byte_level(_state(backend.pre_tokenizer)) or \
                    not _keeps_offsets(_state(backend.post_processor)):
                return None
        except (AttributeError, TypeError, ValueError):  # a component without a JSON state
            return None
        vocab = backend.get_vocab(with_added_tokens=True) if vocab is None else vocab
        added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        size = max([*vocab.values(), *added, -1]) + 1
        strings = [""] * size  # each vocabulary token's symbols by id (added tokens apart: matched as text)
        for token, i in vocab.items():
            strings[i] = token
        for i in added:
            strings[i] = ""
        # every symbol at once: its byte (-1: not a byte-level symbol), and the symbols each token has
        symbols = np.frombuffer("".join(strings).encode("utf-32-le"), dtype=np.uint32)
        byte_of = np.full(_SYMBOLS, -1, dtype=np.int16)
        for b, c in _bytes_to_unicode().items():
            byte_of[ord(c)] = b
        values = byte_of[np.minimum(symbols, _SYMBOLS - 1)].astype(np.int64)
        values[symbols >= _SYMBOLS] = -1
        counts = np.array([len(t) for t in strings], dtype=np.int64)
        ends = np.cumsum(counts)
        bad = np.concatenate([[0], np.cumsum(values < 0)])[ends] - np.concatenate([[0], np.cumsum(values < 0)])[
            ends - counts]
        length = np.where((bad == 0) & (counts > 0), counts, -1)
        extra = [content.encode("utf-8") for content in added.values()]
        data = np.concatenate([values.astype(np.uint8), np.frombuffer(b"".join(extra), dtype=np.uint8)])
        start = ends - counts
        place = len(values)
        for i, piece in zip(added, extra):
            start[i], length[i] = place, len(piece) if piece else -1
            place += len(piece)
        return cls(data, start, length)

    def check(self, texts: list[str], ids: list[np.ndarray]) -> list[tuple[int, ByteTokens]]:
        """``(i, tokens)`` for each text whose bytes are its tokens' bytes in order."""
        counts = np.array([len(a) for a in ids], dtype=np.int64)
        every = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        known = (every >= 0) & (every < len(self.length))
        length = np.where(known, self.length[np.where(known, every, 0)], -1)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        summed = np.concatenate([[0], np.cumsum(length)])
        unknown = np.concatenate([[0], np.cumsum(length < 0)])
        nbytes = [len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts]
        total = summed[bounds[1:]] - summed[bounds[:-1]]
        bad = unknown[bounds[1:]] - unknown[bounds[:-1]]
        ok = [i for i in range(len(texts)) if not bad[i] and total[i] == nbytes[i]]
        if not ok:
            return []
        if len(ok) == len(texts):  # the usual case: every text's tokens, as they are
            chosen, lens = every, length
        else:
            pick = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in ok])
            chosen, lens = every[pick], length[pick]
        starts = np.cumsum(lens) - lens  # where each token's bytes start among the kept texts' bytes
        got = self.data[np.repeat(self.start[chosen] - starts, lens) + np.arange(int(lens.sum()))]
        want = np.frombuffer("".join(texts[i] for i in ok).encode("utf-8"), dtype=np.uint8)
        text_start = np.concatenate([[0], np.cumsum([nbytes[i] for i in ok])])
        wrong = set(np.searchsorted(text_start[1:], np.flatnonzero(got != want), side="right").tolist())
        kept = np.concatenate([[0], np.cumsum(counts[ok])])
        return [(i, ByteTokens(ids[i], starts[kept[k]:kept[k + 1]], texts[i], int(text_start[k])))
                for k, i in enumerate(ok) if k not in wrong]
