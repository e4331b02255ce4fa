"""Token positions from byte lengths equal the tokenizer's own offsets, on every tokenizer shape: the fast path
where it is provably exact, the tokenizer's offsets wherever it is not (and the tests say which path ran)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from packtool.packer.tokenizing import ByteTokens, OffsetTokens, Tokenizing, _ByteTable

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|image_pad|>"]
PIECES = ["hello", " world", "\n", "  ", "é", "e\u0301", "Ünïcödé", "数据", "😀", "🧑‍💻", "x", "\t", "'s", "123",
          " ", "¡", "\u00a0", "Ω", "日本語のテキスト", *SPECIAL]


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def byte_level(*, prefix_space: bool = False, normalizer=normalizers.NFC(), trim: bool = False,
               lstrip_special: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=trim)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(corpus(300, 0), trainer)
    if lstrip_special:
        tok.add_special_tokens([AddedToken("<|tool|>", lstrip=True, rstrip=True)])
    else:
        tok.add_special_tokens([AddedToken("<|tool|>")])
    tok.add_tokens([AddedToken("αβγ", normalized=False)])  # a non-ASCII added token: matched as text
    return tok


def metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIAL], show_progress=False)
    tok.train_from_iterator(corpus(300, 0), trainer)
    return tok


def assert_same_positions(tok: Tokenizer, texts: list[str]) -> list:
    """Every text's ids, and the token at / covering every character, equal the tokenizer's offsets."""
    got = Tokenizing(tok).encode(texts)
    for text, tokens in zip(texts, got):
        ref = OffsetTokens(tok.encode(text, add_special_tokens=False), len(text))
        assert tokens.ids.tolist() == ref.ids.tolist(), text
        n = len(ref)
        for pos in range(len(text) + 2):
            for cap in {n, max(n - 1, 0)}:
                assert tokens.token_at(pos, cap) == ref.token_at(pos, cap), (text, pos, cap)
                if pos < len(text):
                    assert tokens.covering(pos, cap) == ref.covering(pos, cap), (text, pos, cap)
    return got


TEXTS = corpus(150, 1) + ["", " ", "<|im_start|>user\nhi<|im_end|>", "<|tool|>", "a <|tool|> b", "xαβγy"]


def test_byte_level_takes_the_fast_path_and_agrees():
    tok = byte_level()
    got = assert_same_positions(tok, TEXTS)
    fast = [t for t, g in zip(TEXTS, got) if isinstance(g, ByteTokens)]
    slow = [t for t, g in zip(TEXTS, got) if isinstance(g, OffsetTokens)]
    # only texts that NFC changes (a combining accent) need the tokenizer's offsets
    assert slow and all("e\u0301" in t for t in slow)
    assert len(fast) == sum("e\u0301" not in t for t in TEXTS) > 50


@pytest.mark.parametrize("make", [
    lambda: byte_level(prefix_space=True),  # a space is added: no text is its tokens' bytes
    lambda: byte_level(normalizer=normalizers.Lowercase()),  # rewritten letters
    lambda: byte_level(lstrip_special=True),  # an added token that swallows its neighbours' spaces
    lambda: byte_level(normalizer=None),
])
def test_rewriting_tokenizers_fall_back_where_needed(make):
    assert_same_positions(make(), TEXTS)


def test_prefix_space_falls_back_where_a_space_is_added():
    got = Tokenizing(byte_level(prefix_space=True)).encode(["hello world", " hello world"])
    assert isinstance(got[0], OffsetTokens) and isinstance(got[1], ByteTokens)


def test_lstrip_token_falls_back_only_beside_spaces():
    got = Tokenizing(byte_level(lstrip_special=True)).encode(["a <|tool|> b", "a<|tool|>b"])
    assert isinstance(got[0], OffsetTokens) and isinstance(got[1], ByteTokens)


def test_other_tokenizers_use_offsets():
    for tok in (metaspace(), byte_level(trim=True)):
        assert Tokenizing(tok).table is None
        got = assert_same_positions(tok, TEXTS[:40])
        assert all(isinstance(g, OffsetTokens) for g in got)


def test_the_byte_check_catches_a_wrong_table():
    """Control: with two tokens' bytes swapped in the table, texts using them must fall back (and stay right);
    without the check they would get wrong positions."""
    tok = byte_level()
    tokenizing = Tokenizing(tok)
    table = tokenizing.table
    assert table is not None
    vocab = tok.get_vocab()
    a, b = vocab["h"], vocab["x"]  # same length, so only the byte comparison can tell
    table.start[[a, b]] = table.start[[b, a]]
    texts = ["hhx", "xxh", "plain 123"]
    got = tokenizing.encode(texts)
    assert [type(g) for g in got] == [OffsetTokens, OffsetTokens, ByteTokens]
    for text, g in zip(texts, got):
        assert g.ids.tolist() == tok.encode(text, add_special_tokens=False).ids


def test_unknown_and_empty():
    tok = byte_level()
    table = _ByteTable.of(tok)
    assert table is not None
    out = table.check(["", "ab"], [np.zeros(0, dtype=np.int64), np.array([10**9], dtype=np.int64)])
    assert [i for i, _ in out] == [0]
    assert len(out[0][1]) == 0 and out[0][1].token_at(0, 0) == 0


def test_refused_text_comes_back_as_its_error():
    tok = byte_level()
    tok.enable_truncation(1)  # leaves the ids short: never the fast path's business, but still exact
    got = Tokenizing(tok).encode(["hello world"])
    assert isinstance(got[0], OffsetTokens) and len(got[0]) == 1


@pytest.mark.parametrize("folder", ["tokenizer", "tokenizer-gen", "nemotron-omni"])
def test_bundled_model_folders(folder, demo_dir, tmp_path):
    """The model folders the demo packs with take the fast path on NFC text, with the same answers."""
    if folder == "nemotron-omni":
        import nemotron_omni_model

        path = nemotron_omni_model.write_model_folder(tmp_path / "model")
    else:
        path = demo_dir / folder
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    texts = [t for t in TEXTS if "e\u0301" not in t]
    got = assert_same_positions(tok, texts)
    assert all(isinstance(g, ByteTokens) for g in got)


def test_encoder_gives_the_same_rows_on_either_path(demo_dir):
    """The whole demo dataset plus replies that NFC rewrites or that hold wide characters: an encoder using the
    byte positions and one using only the tokenizer's offsets give the same rows, tokens, targets and media."""
    import json

    from packtool.packer.encoder import Encoder
    from packtool.packer.sources import RawSample, open_source, read_raw_samples
    from packtool.settings import EncodeSettings

    src = open_source(demo_dir / "dataset")
    raws = [r for split in src.splits.values() for shard in split
            for r in read_raw_samples(src.root, shard, src.excluded_samples)]
    for k, reply in enumerate(["caf\u0065\u0301 au lait", "数据 😀 ok", " leading space", "e\u0301"]):
        sample = RawSample(key=f"extra{k}", shard="x.tar", index=k)
        sample.parts["json"] = json.dumps({"conversations": [{"from": "human", "value": "q\u0301?"},
                                                              {"from": "gpt", "value": reply}]}).encode()
        sample.ranges["json"] = (0, len(sample.parts["json"]))
        raws.append(sample)
    fast = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    slow = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    assert fast.tokenizing.table is not None
    slow.tokenizing.table = None  # the tokenizer's offsets for every text
    a, b = fast.encode_many(raws), slow.encode_many(raws)
    assert sum(e.status == "packed" for e in a) > len(raws) // 2
    assert [e.key for e in a[-4:]] == [f"extra{k}" for k in range(4)] and all(e.targets.any() for e in a[-4:])
    for x, y in zip(a, b):
        assert (x.key, x.status, x.reason, x.media) == (y.key, y.status, y.reason, y.media)
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.targets, y.targets)


def test_checked_in_groups(monkeypatch):
    """Texts are compared with their tokens in groups of bounded size; the answers do not depend on it."""
    from packtool.packer import tokenizing

    tok = byte_level()
    whole = Tokenizing(tok).encode(TEXTS)
    monkeypatch.setattr(tokenizing, "_CHECK_CHARS", 40)
    grouped = Tokenizing(tok).encode(TEXTS)
    assert [type(g) for g in grouped] == [type(w) for w in whole]
    for g, w, text in zip(grouped, whole, TEXTS):
        assert g.ids.tolist() == w.ids.tolist()
        assert [g.token_at(p, len(g)) for p in range(len(text) + 1)] == [w.token_at(p, len(w))
                                                                         for p in range(len(text) + 1)]


def test_a_tokenizer_that_rewrites_most_texts_turns_the_byte_path_off():
    tok = byte_level(normalizer=normalizers.Lowercase())
    tokenizing = Tokenizing(tok)
    texts = [f"Hello World {i}" for i in range(40)]
    first = tokenizing.encode(texts)
    assert all(isinstance(t, OffsetTokens) for t in first) and tokenizing.table is None
    assert [t.ids.tolist() for t in tokenizing.encode(texts)] == [t.ids.tolist() for t in first]
    kept = Tokenizing(byte_level())  # NFC text: the byte path stays
    kept.encode(texts)
    assert kept.table is not None


class _Spy:
    """A backend that records, for each ``encode_batch_fast`` call, whether its normalizer was set aside."""

    def __init__(self, tok: Tokenizer, fail_plain: bool = False):
        object.__setattr__(self, "tok", tok)
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "fail_plain", fail_plain)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __setattr__(self, name, value):
        setattr(self.tok, name, value)

    def encode_batch_fast(self, texts, **kwargs):
        self.calls.append((self.tok.normalizer is None, list(texts)))
        if self.fail_plain and self.tok.normalizer is None:
            raise RuntimeError("refused")
        return self.tok.encode_batch_fast(texts, **kwargs)


#: Texts NFC rewrites: a combining accent, a CJK compatibility ideograph, the Angstrom sign, Hangul jamo.
NFC_CHANGES = ["e\u0301", "\uf900 x", "\u212b", "\u1100\u1161 hi", "Ω\u0301 <|im_end|>"]


def test_text_in_normal_form_is_encoded_with_the_normalizer_set_aside():
    import unicodedata

    tok = byte_level()
    spy = _Spy(tok)
    texts = TEXTS + NFC_CHANGES + [f"数据 {t} tail" for t in NFC_CHANGES]
    assert assert_same_positions(tok, texts)  # the reference, then through the spy:
    got = Tokenizing(spy).encode(texts)
    for text, tokens in zip(texts, got):
        assert tokens.ids.tolist() == tok.encode(text, add_special_tokens=False).ids, text
    assert isinstance(tok.normalizer, normalizers.NFC)  # given back
    plain = [t for aside, batch in spy.calls if aside for t in batch]
    normalized = [t for aside, batch in spy.calls if not aside for t in batch]
    assert sorted(plain + normalized) == sorted(texts)
    assert all(unicodedata.is_normalized("NFC", t) for t in plain)
    assert sorted(normalized) == sorted(t for t in texts if not unicodedata.is_normalized("NFC", t))
    assert len(normalized) >= 2 * len(NFC_CHANGES) and any(not t.isascii() for t in plain)
    # control: the routing matters, the normalizer set aside changes these texts' ids
    tok.normalizer = None
    aside = [tok.encode(t, add_special_tokens=False).ids for t in NFC_CHANGES]
    tok.normalizer = normalizers.NFC()
    assert all(a != tok.encode(t, add_special_tokens=False).ids for a, t in zip(aside, NFC_CHANGES))


def test_the_normalizer_comes_back_when_the_call_fails():
    tok = byte_level()
    got = Tokenizing(_Spy(tok, fail_plain=True)).encode(["hello world", "e\u0301"])
    assert isinstance(tok.normalizer, normalizers.NFC)
    assert [g.ids.tolist() for g in got] == [tok.encode(t, add_special_tokens=False).ids
                                             for t in ["hello world", "e\u0301"]]


@pytest.mark.parametrize(("normalizer", "forms"), [
    (None, ()),
    (normalizers.NFC(), ("NFC",)),
    (normalizers.Sequence([normalizers.NFD(), normalizers.NFKC()]), ("NFD", "NFKC")),
    (normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]), None),
    (normalizers.Lowercase(), None),
])
def test_which_normalizers_are_set_aside(normalizer, forms):
    assert Tokenizing(byte_level(normalizer=normalizer)).forms == forms
