"""``packtool verify``: prove a packed OUTPUT is whole and consistent; with a source, that it is faithful.

Without the source every output shard is read once, in parallel (one task per shard), and checked:

- the tar against its ``.tar.idx``, its ``.info.json`` count and its rows of ``index.sqlite``;
- every record through :meth:`PackRecord.from_members` (the format's own parser), then its pack size, alignment,
  targets, media placeholders (inside each item's span, as the reader checks them) and the manifest's per-pack caps;
- every media member: byte size and SHA-256 against its :class:`MediaRef` (a swapped member is caught; records
  written before these were recorded skip it), a full decode, and what it decodes to (an image's size, a video's
  size and frames, an audio clip's waveform length), then its grid, frames, samples and tokens against the rules
  the manifest describes (Qwen2-VL images and video, Nemotron Omni images, video and audio; the processor mode has
  no rule to re-derive them with);
- every token id against the embedded tokenizer: in the vocabulary and, for byte-level BPE tokenizers, equal to
  what the tokenizer makes of the segment's own decoded text (Qwen's placeholder runs collapsed first; Nemotron
  Omni and the processor mode expanded them in the text).

Each shard task returns a 64-bit digest of every segment it found (its identity and its facts). The parent streams
``ledger.parquet`` a batch at a time and matches its kept rows against those digests, so no Python object is held
per sample (numpy arrays of a few dozen bytes per sample). Names are looked up again only for the mismatches.

With a source, every source sample is also re-encoded and compared (:mod:`packtool.verify.source`).

The result is a list of problems (empty = ok); each line names the file, pack or member and what is wrong.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from packtool import families
from packtool.errors import FormatError
from packtool.families import Family
from packtool.families.base import NoMedia
from packtool.families.conventions import TRANSFORMERS
from packtool.format import (
    ARRAYS,
    KEPT,
    LEDGER,
    LEDGER_SCHEMA,
    META,
    STATUSES,
    InfoJson,
    Manifest,
    MediaRef,
    PackRecord,
    SplitYaml,
    aligned_lengths,
    arrays_digest,
    copied_key,
    energon_dataset_yaml,
    in_split,
    read_mapping,
    row_length,
    safe_relative,
    sha256,
    span_problems,
    tokenizer_fingerprint,
)
from packtool.media import image_size, probe_audio, probe_frames, probe_video
from packtool.media.audio import decode_audio
from packtool.packer.engine import Engine
from packtool.packer.sources.files import FileSource
from packtool.packer.tokenizing import encode_fast, normal_forms
from packtool.settings import EngineKind
from packtool.shards import idx_path, index_tar, parse_record, record_offsets, scan_records
from packtool.storage import local_copy, location, open_read, parquet_file

MAX_LISTED = 200
#: Segments whose tokens are re-encoded in one tokenizer call.
TOKEN_BATCH = 512
#: Ledger rows read at a time.
LEDGER_BATCH = 65536


def _digest(*values: object) -> int:
    """A 64-bit digest of some values, the same in every process (unlike ``hash``)."""
    text = "\0".join(map(str, values)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


# -- token ids -------------------------------------------------------------------------------------------------
class TokenCheck:
    """Checks token ids against the tokenizer embedded in the output.

    Every id must lie in the vocabulary. For byte-level BPE tokenizers (Qwen, GPT-2 style) decoding is lossless,
    so a segment's ids (each media span collapsed back to its one placeholder) must be exactly what the tokenizer
    makes of their own decoded text; for a truncated segment, up to the last pre-token piece, which a cut may
    leave tokenized differently. Other tokenizers get the range check only.

    The tokenizer is the one ``pack`` used (:func:`packtool.packer.encoder.load_tokenizer`), called through its Rust
    backend in batches: whole segments without offsets (``encode_batch_fast``), truncated ones with them.
    """

    #: Characters at the end of a truncated segment's text pre-tokenized to find its last piece.
    TAIL = 256

    def __init__(self, tokenizer_dir: Path, expanded_in_ids: bool):
        from tokenizers import decoders

        from packtool.packer.encoder import load_tokenizer

        self.tok = load_tokenizer(tokenizer_dir).backend_tokenizer
        ids = np.fromiter(self.tok.get_vocab(with_added_tokens=True).values(), dtype=np.int64)
        self.known = np.zeros(int(ids.max()) + 1 if ids.size else 0, dtype=bool)
        self.known[ids] = True
        self.size = int(self.known.sum())
        #: Whether pack expanded each media placeholder in the ids (Qwen: one placeholder token repeated), so a
        #: span collapses back to one placeholder before the round trip; families that expand them in the text
        #: (:attr:`Family.expanded_in_text`: Nemotron Omni, the processor mode) are encoded as they stand.
        self.expanded_in_ids = expanded_in_ids
        self.exact = isinstance(self.tok.decoder, decoders.ByteLevel)
        self.pre_tokenizer = self.tok.pre_tokenizer
        self.forms = normal_forms(self.tok)

    def problems(self, segments: list[tuple[str, np.ndarray, list[MediaRef], bool, bool]]) -> list[str]:
        """Problems of ``(where, tokens, media, truncated, roundtrip)`` segments (checked as one batch): every id
        in the vocabulary, and, where ``roundtrip``, equal to the tokenizer's encoding of its own text."""
        problems: list[str] = []
        whole: list[tuple[str, np.ndarray]] = []
        cut: list[tuple[str, np.ndarray]] = []
        for where, tokens, media, truncated, roundtrip in segments:
            inside = (tokens >= 0) & (tokens < len(self.known))
            bad = np.flatnonzero(~inside)
            if not bad.size:
                bad = np.flatnonzero(~self.known[tokens])
            if bad.size:
                problems.append(f"{where}: token id {int(tokens[bad[0]])} at {int(bad[0])} is outside the "
                                f"vocabulary of {self.size}")
            elif self.exact and roundtrip:
                (cut if truncated else whole).append((where, self._collapse(tokens, media)))
        if whole:
            texts = self.tok.decode_batch([ids.tolist() for _, ids in whole], skip_special_tokens=False)
            again = encode_fast(self.tok, texts, self.forms)
            for (where, ids), enc in zip(whole, again):
                if not np.array_equal(ids, enc.ids):
                    problems.append(f"{where}: token ids differ from the tokenizer's encoding of their own text "
                                    f"(corrupted tokens)")
        if cut:
            texts = self.tok.decode_batch([ids.tolist() for _, ids in cut], skip_special_tokens=False)
            again = self.tok.encode_batch(texts, add_special_tokens=False)
            for (where, ids), text, enc in zip(cut, texts, again):
                stable = self._last_piece_start(text)
                n = sum(1 for _, end in enc.offsets if end <= stable)
                if n > len(ids) or not np.array_equal(ids[:n], enc.ids[:n]):
                    problems.append(f"{where}: token ids differ from the tokenizer's encoding of their own text "
                                    f"(corrupted tokens)")
        return problems

    def _collapse(self, tokens: np.ndarray, media: list[MediaRef]) -> np.ndarray:
        if not media or not self.expanded_in_ids:
            return tokens
        keep = np.ones(len(tokens), dtype=bool)
        for m in media:
            keep[m.token_offset + 1: m.token_offset + m.tokens] = False
        return tokens[keep]

    def _last_piece_start(self, text: str) -> int:
        """Where the last pre-token piece of ``text`` starts: text before it is tokenized as in the whole sample.
        Found in a tail window (pre-tokenizing a long text costs as much as tokenizing it); a window that holds too
        few pieces to be sure its split agrees with the whole text's is widened to the whole text."""
        if self.pre_tokenizer is None:
            return 0
        start = max(0, len(text) - self.TAIL)
        pieces = self.pre_tokenizer.pre_tokenize_str(text[start:])
        if start and len(pieces) < 4:
            start, pieces = 0, self.pre_tokenizer.pre_tokenize_str(text)
        return start + pieces[-1][1][0] if pieces else 0


@lru_cache(maxsize=2)
def _token_check(tokenizer_dir: str, expanded_in_ids: bool) -> TokenCheck:
    return TokenCheck(local_copy(location(tokenizer_dir)), expanded_in_ids)


def manifest_family(manifest: Manifest) -> Family:
    """The family the manifest was written by (:func:`packtool.families.from_manifest`): what verify re-derives
    each media item's plan with; :class:`FormatError` for settings no family reads."""
    try:
        return families.from_manifest(manifest)
    except ValueError as exc:
        raise FormatError(f"{META}/packtool.json: {exc}") from None


# -- one pack --------------------------------------------------------------------------------------------------
def check_pack(where: str, record: PackRecord, members: dict[str, bytes], manifest: Manifest,
               family: Family) -> list[str]:
    """Problems of one parsed pack record beyond what :meth:`PackRecord.from_members` checks: pack size and
    alignment, targets, media spans (the placeholders of the manifest's ``family``), the manifest's caps and
    members no segment names."""
    problems = []
    settings = manifest.settings
    size, align = record.pack_size, record.align
    if (size, align) != (settings.get("pack_size", size), settings.get("align", align)):
        problems.append(f"{where}: pack_size/align {size}/{align} differ from the manifest's")
    cost = int(aligned_lengths(record.seqlens.astype(np.int64), max(align, 1)).sum())
    if cost > row_length(size, max(align, 1)):
        problems.append(f"{where}: aligned length {cost} exceeds pack size {size}")
    if (record.targets > 1).any():
        problems.append(f"{where}: targets hold values other than 0/1")
    starts = record.segment_starts()
    ids = family.placeholder_ids()
    for seg, a, b in zip(record.segments, starts[:-1], starts[1:]):
        problems += _check_segment(where, seg.key, record.tokens[a:b], record.targets[a:b], seg.media, ids)
    refs = record.media_refs
    caps = (("max_segments", len(record.segments), "segments"), ("max_images", len(refs), "images"),
            ("max_image_tokens", sum(m.tokens for m in refs), "image tokens"))
    for setting, value, what in caps:
        if settings.get(setting) is not None and value > int(settings[setting]):
            problems.append(f"{where}: {value} {what} exceed {setting} {settings[setting]}")
    extra = sorted(set(members) - set(ARRAYS) - {"json"} - set(record.media))
    if extra:
        problems.append(f"{where}: members {extra} are not named by any segment")
    return problems


def _check_segment(where: str, key: str, t: np.ndarray, g: np.ndarray, media: list[MediaRef],
                   ids: dict[str, int | None]) -> list[str]:
    """Targets and placeholders of one segment; ``ids``: the placeholder token of each media kind
    (:meth:`Family.placeholder_ids`)."""
    problems = []
    if g[0]:
        problems.append(f"{where} segment {key}: first token is a target")
    if not g.any():
        problems.append(f"{where} segment {key}: no targets")
    problems += [f"{where}: {p}" for p in span_problems(key, t, media, ids)]
    for m in media:
        s0, s1 = m.span or (m.token_offset, m.token_offset + m.tokens)
        if 0 <= s0 <= s1 <= len(t) and g[s0:s1].any():
            problems.append(f"{where} segment {key}: media {m.member} tokens marked as targets")
    return problems


def check_media(where: str, ref: MediaRef, members: list[bytes], family: Family, pixel_limit: int, *,
                n_images: int = 1, truncated: bool = False, planned: list[int] | None = None) -> list[str]:
    """Problems of one media item (``members``: its member's bytes, or its frames'): bytes against its recorded
    size and SHA-256, a full decode, and what it decodes to against the record: an image's size, a video's size
    and frame count, an audio clip's waveform length; then its grid, frames, samples and tokens against the rules
    of the manifest's ``family`` (none where it does not re-derive them: the processor mode). ``n_images``:
    images of its segment; ``truncated``: whether the segment was cut (see :meth:`Family.image_counts`);
    ``planned``: the image's grid as its segment's plan re-derives it (a family that plans a sample's images
    together, :meth:`Family.segment_image_grids`), checked instead of the rule's."""
    data = b"".join(members)
    if ref.size or ref.sha256:  # recorded since format 2's first writer; older records have neither
        if len(data) != ref.size:
            return [f"{where}: {len(data)} bytes, recorded {ref.size}"]
        if sha256(data) != ref.sha256:
            return [f"{where}: SHA-256 differs from the recorded one (member changed or swapped)"]
    if ref.kind == "video":
        return _check_video(where, ref, members, family, pixel_limit)
    if ref.kind == "audio":
        return _check_audio(where, ref, data, family)
    if ref.kind != "image":
        return [f"{where}: unsupported media kind {ref.kind!r}"]
    try:
        width, height, _ = image_size(data, max_pixels=pixel_limit, decode=True)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if (width, height) != (ref.width, ref.height):
        return [f"{where}: decodes to {width}x{height}, recorded {ref.width}x{ref.height}"]
    if not family.rederives:
        return []
    if planned is not None:
        if list(ref.grid_thw) != planned:
            return [f"{where}: the image budget of {family.convention.name} gives grid {planned}, recorded "
                    f"{list(ref.grid_thw)}"]
        return []
    if family.plans_sample_images:  # the grid depends on the segment's text: checked with `planned` where known
        return []
    recorded = (list(ref.grid_thw), ref.tokens)
    try:
        derived = family.check_image(width, height, n_images)
        if derived is None:
            return [f"{where}: an image, but the manifest describes no image processor"]
        if derived == recorded or any(family.check_image(width, height, n) == recorded
                                      for n in family.image_counts(n_images, truncated)[1:]):
            return []
    except ValueError as exc:
        return [f"{where}: {exc}"]
    shared = f" ({n_images} images)" if family.shared_image_budget else ""
    return [f"{where}: the image rule gives grid {derived[0]} and {derived[1]} tokens{shared}, recorded "
            f"{recorded[0]} and {recorded[1]}"]


def _check_video(where: str, ref: MediaRef, members: list[bytes], family: Family, pixel_limit: int) -> list[str]:
    try:
        facts = probe_frames(members, max_pixels=pixel_limit, decode=True) if ref.frames else \
            probe_video(members[0], max_pixels=pixel_limit, decode=True)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if (facts.width, facts.height, facts.frames) != (ref.width, ref.height, ref.total_frames):
        return [f"{where}: {facts.width}x{facts.height}, {facts.frames} frames, recorded {ref.width}x{ref.height}, "
                f"{ref.total_frames} frames"]
    if not family.rederives:
        return []
    own = family.video_problems(where, ref, members[0])
    if own is not None:
        return own
    try:
        derived = family.check_video(facts)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if derived is None:
        return [f"{where}: a video, but the manifest describes no video processor"]
    recorded = (list(ref.grid_thw), ref.tokens, list(ref.frame_indices), ref.second_per_grid_ts)
    if derived != recorded:
        return [f"{where}: the video rule gives grid, tokens, frames, seconds per grid {derived[0]}, {derived[1]}, "
                f"{_short(derived[2])}, {derived[3]}; recorded {recorded[0]}, {recorded[1]}, {_short(recorded[2])}, "
                f"{recorded[3]}"]
    return []


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{len(values)} frames from {values[0]}]"


def _check_audio(where: str, ref: MediaRef, data: bytes, family: Family) -> list[str]:
    """An audio clip: a full decode, then the waveform length at the processor's rate and the tokens against the
    family's audio rule, and the decoded waveform's length against both."""
    try:
        facts = probe_audio(data, decode=True)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if not family.rederives:
        return []
    try:
        derived = family.check_audio(facts)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if derived is None:
        return [f"{where}: an audio clip, but the manifest describes no audio rule"]
    samples, tokens = derived
    if (samples, tokens) != (ref.samples, ref.tokens):
        return [f"{where}: the audio rule gives {samples} samples and {tokens} tokens, recorded {ref.samples} "
                f"and {ref.tokens}"]
    waveform = family.audio_input()
    if waveform is None:  # the family's plan counted the decoded clip itself
        return []
    rate, limit = waveform
    try:
        wave = decode_audio(data, rate=rate, max_samples=limit)
    except Exception as exc:
        return [f"{where}: undecodable audio ({type(exc).__name__}: {exc})"]
    if len(wave) != samples:
        return [f"{where}: decodes to {len(wave)} samples at {rate} Hz, recorded {samples}"]
    return []


# -- one shard (a task) ------------------------------------------------------------------------------------------
@dataclass
class ShardReport:
    """What a shard task found: its problems, its pack count and a digest per segment."""

    problems: list[str] = field(default_factory=list)
    packs: int = 0
    #: Per segment, in shard order: digest of (split, source shard, key), digest of its facts
    #: (pack, tokens, targets, images, image tokens), ordinal of its record in the shard.
    ident: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    facts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    record: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


def segment_facts(record: PackRecord) -> list[tuple[str, str, str, tuple[int, int, int, int]]]:
    """``(split, source shard, key, (tokens, targets, images, image tokens))`` of each segment: what the ledger
    records of it."""
    starts = record.segment_starts()
    return [(s.split, s.shard, copied_key(s.key, s.copy), (int(b - a), int(record.targets[a:b].sum()), len(s.media),
                                       sum(m.tokens for m in s.media)))
            for s, a, b in zip(record.segments, starts[:-1], starts[1:])]


@dataclass(frozen=True)
class ShardCheck:
    """The check task of one output shard."""

    output: str
    split: str
    #: The shard's path in OUTPUT, its position in ``split.yaml`` (its ``tar_file_id``) and its sample count in
    #: ``.info.json``.
    shard: str
    fid: int
    count: int | None
    manifest: Manifest
    #: Encode every segment's text again, even where the pack's array digest proves its tokens intact.
    retokenize: bool = False


def check_shard(task: ShardCheck) -> ShardReport:
    """Check one output shard (see the module docstring); the task :func:`verify_output` runs per shard. The
    token arrays of a record that carries their SHA-256 are proven by it; the others, and all with
    ``retokenize``, are also encoded again from their own text."""
    split, shard, fid, count, manifest = task.split, task.shard, task.fid, task.count, task.manifest
    retokenize = task.retokenize
    out = location(task.output)
    report = ShardReport()
    problems = report.problems
    path = out / shard
    if not safe_relative(shard):
        return ShardReport([f"{shard}: shard path leaves the dataset"])
    if not path.is_file():
        return ShardReport([f"{shard}: missing"])
    try:
        index = index_tar(path)
    except Exception as exc:
        return ShardReport([f"{shard}: unreadable tar ({type(exc).__name__}: {exc})"])
    if count != len(index):
        problems.append(f"{shard}: .info.json says {count} samples, the tar holds {len(index)}")
    problems += _check_idx(path, shard, index)
    problems += _check_sqlite(out / META / "index.sqlite", shard, fid, index)
    tok_dir = out / (manifest.tokenizer or {}).get("dir", f"{META}/tokenizer")
    unreadable = None
    try:
        family = manifest_family(manifest)
    except FormatError as exc:  # reported below; nothing is re-derived, placeholders as a text family's
        unreadable, family = exc, NoMedia.from_manifest(manifest, TRANSFORMERS)
    tokens = None
    if (tok_dir / "tokenizer.json").is_file():
        try:
            tokens = _token_check(str(tok_dir), not family.expanded_in_text)
        except Exception as exc:
            problems.append(f"{tok_dir.relative_to(out)}: unreadable tokenizer ({type(exc).__name__}: {exc})")
    if unreadable is not None:
        problems.append(str(unreadable))
    pixel_limit = int(manifest.settings.get("pixel_limit") or 1 << 40)
    ident, facts, ordinal, staged = [], [], [], []
    for i, (key, members) in enumerate(scan_records(path)):
        report.packs += 1
        where = f"{shard}: pack {key}"
        if not in_split(key, split):
            problems.append(f"{where}: does not belong to split {split}")
        try:
            record = PackRecord.from_members(key, members)
        except FormatError as exc:
            problems.append(f"{shard}: {exc}")
            continue
        problems += check_pack(where, record, members, manifest, family)
        if record.arrays_sha256 and arrays_digest(members) != record.arrays_sha256:
            problems.append(f"{where}: token arrays differ from the SHA-256 written with the pack")
        starts = record.segment_starts()
        for seg, a, b in zip(record.segments, starts[:-1], starts[1:]):
            n_images = sum(m.kind == "image" for m in seg.media)
            plan = None if seg.truncated else family.segment_image_grids(record.tokens[a:b], seg.media)
            grids = iter(plan or [])
            for m in seg.media:
                problems += check_media(f"{where} member {m.member}", m, [record.media[n] for n in m.members],
                                        family, pixel_limit, n_images=n_images, truncated=seg.truncated,
                                        planned=next(grids) if plan is not None and m.kind == "image" else None)
        for src_split, src_shard, src_key, held in segment_facts(record):
            ident.append(_digest(src_split, src_shard, src_key))
            facts.append(_digest(key, *held))
            ordinal.append(i)
        if tokens is not None:
            starts = record.segment_starts()
            roundtrip = retokenize or not record.arrays_sha256
            staged += [(f"{where} segment {s.key}", record.tokens[a:b], s.media, s.truncated, roundtrip)
                       for s, a, b in zip(record.segments, starts[:-1], starts[1:])]
            if len(staged) >= TOKEN_BATCH:
                problems += tokens.problems(staged)
                staged = []
    if tokens is not None and staged:
        problems += tokens.problems(staged)
    report.ident = np.asarray(ident, dtype=np.uint64)
    report.facts = np.asarray(facts, dtype=np.uint64)
    report.record = np.asarray(ordinal, dtype=np.int32)
    return report


def _check_idx(path: Path, shard: str, index: Sequence) -> list[str]:
    try:
        offsets = record_offsets(path)
    except FormatError:
        return [f"{shard}.idx: missing"]
    expect = [r.offset for r in index] + ([index[-1].offset + index[-1].size] if index else [0])
    if idx_path(path).stat().st_size % 8 or offsets.tolist() != expect:
        return [f"{shard}.idx: offsets do not match the tar"]
    return []


def _check_sqlite(path: Path, shard: str, fid: int, index: Sequence) -> list[str]:
    """The shard's rows of ``index.sqlite`` (``tar_file_id`` = its position in ``split.yaml``) against its tar."""
    if not path.is_file():
        return [f"{META}/index.sqlite: missing"]
    con = sqlite3.connect(f"file:{local_copy(path)}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT sample_key, sample_index, byte_offset, byte_size FROM samples "
                           "WHERE tar_file_id = ? ORDER BY sample_index", (fid,)).fetchall()
        parts = con.execute("SELECT sample_index, part_name, content_byte_offset, content_byte_size FROM "
                            "sample_parts WHERE tar_file_id = ? ORDER BY sample_index, content_byte_offset",
                            (fid,)).fetchall()
    except sqlite3.Error as exc:
        return [f"{META}/index.sqlite: unreadable ({exc})"]
    finally:
        con.close()
    problems = []
    if rows != [(r.key, i, r.offset, r.size) for i, r in enumerate(index)]:
        problems.append(f"{META}/index.sqlite: samples of {shard} (tar_file_id {fid}) do not match the tar")
    if parts != [(i, p, o, n) for i, r in enumerate(index) for p, o, n in r.parts]:
        problems.append(f"{META}/index.sqlite: sample_parts of {shard} (tar_file_id {fid}) do not match the tar")
    return problems


def _check_sqlite_extent(path: Path, n_shards: int) -> list[str]:
    """Rows of ``index.sqlite`` for shards ``split.yaml`` does not list (the per-shard checks cannot see them)."""
    if not path.is_file():
        return []  # reported by every shard task
    con = sqlite3.connect(f"file:{local_copy(path)}?mode=ro", uri=True)
    try:
        extra = con.execute("SELECT COUNT(*) FROM samples WHERE tar_file_id < 0 OR tar_file_id >= ?",
                            (n_shards,)).fetchone()[0]
    except sqlite3.Error as exc:
        return [f"{META}/index.sqlite: unreadable ({exc})"]
    finally:
        con.close()
    return [f"{META}/index.sqlite: {extra} samples in shards split.yaml does not list"] if extra else []


# -- the whole output -----------------------------------------------------------------------------------------
def verify_output(output: str | Path, *, source: str | Path | FileSource | None = None, workers: int = 1,
                  engine: EngineKind = "local", ray_address: str | None = None, retokenize: bool = False) -> list[str]:
    """Every check (see the module docstring); ``workers``, ``engine`` and ``ray_address`` as for ``pack``
    (the shards, and with ``source`` the source shards, are checked in parallel on one engine). ``retokenize``
    also encodes every segment's text again even where the pack's array digest proves its tokens intact."""
    with Engine(engine, workers, ray_address) as runner:
        where = source if source is None or isinstance(source, FileSource) else location(source)
        return _verify(location(output), where, runner, retokenize)


def _verify(out: Path, source: Path | FileSource | None, runner: Engine, retokenize: bool = False) -> list[str]:
    try:
        manifest = Manifest.read(out)
    except FormatError as exc:
        return [f"{_relative(exc, out)} (not a packtool output, or the run did not finish)"]
    problems: list[str] = []
    reports: list[tuple[str, str, ShardReport]] = []
    if not manifest.dry_run:
        try:
            splits, info = SplitYaml.read(out), InfoJson.read(out)
        except FormatError as exc:
            return [_relative(exc, out)]
        shards = [(split, s) for split, ss in splits.split_parts.items() for s in ss]
        if list(info.shard_counts) != [s for _, s in shards]:
            problems.append(f"{META}/.info.json lists {list(info.shard_counts)}, split.yaml "
                            f"{[s for _, s in shards]}")
        tok_dir = out / (manifest.tokenizer or {}).get("dir", f"{META}/tokenizer")
        if not (tok_dir / "tokenizer.json").is_file():
            problems.append(f"{tok_dir.relative_to(out)}: no tokenizer.json (readers need it; token ids unchecked)")
        elif (manifest.tokenizer or {}).get("fingerprint") not in (None, tokenizer_fingerprint(tok_dir)):
            problems.append(f"{tok_dir.relative_to(out)}: the model files differ from those the packs were made "
                            f"with (their SHA-256 is not the manifest's tokenizer fingerprint)")
        try:
            described = read_mapping(out / META / "dataset.yaml", "dataset file")
            if described != energon_dataset_yaml():
                problems.append(f"{META}/dataset.yaml: {described} is not what packtool writes "
                                f"({energon_dataset_yaml()}; the task encoders match its subflavors)")
        except FormatError as exc:
            problems.append(_relative(exc, out))
        tasks = [ShardCheck(str(out), split, shard, fid, info.shard_counts.get(shard), manifest, retokenize)
                 for fid, (split, shard) in enumerate(shards)]
        done = runner.map(check_shard, tasks, desc="verify", unit="shard", progress=False)
        reports = [(split, shard, r) for (split, shard), r in zip(shards, done)]
        for _, _, r in reports:
            problems += r.problems
        problems += _check_sqlite_extent(out / META / "index.sqlite", len(shards))
    problems += _check_ledger(out, manifest, reports)
    if source is not None:
        from packtool.verify.source import check_against_source

        problems += check_against_source(out, source, manifest, runner)
    problems = list(dict.fromkeys(problems))  # a problem every task sees (the tokenizer) is listed once
    if len(problems) > MAX_LISTED:
        problems = problems[:MAX_LISTED] + [f"... and {len(problems) - MAX_LISTED} more"]
    return problems


def _relative(exc: Exception, out: Path) -> str:
    """An error message with the output folder left out of the paths it names."""
    return str(exc).replace(f"{out}/", "")


# -- the ledger against the shards ----------------------------------------------------------------------------
@dataclass
class LedgerScan:
    """What one streamed pass over the ledger gathers: problems of single rows, counts, kept-row digests."""

    problems: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    ident: list[np.ndarray] = field(default_factory=list)
    facts: list[np.ndarray] = field(default_factory=list)


def _ledger_batches(out: Path):
    """The ledger as record batches (schema checked first)."""
    pf = parquet_file(out / LEDGER)
    missing = [n for n in LEDGER_SCHEMA.names if n not in pf.schema_arrow.names]
    if missing:
        raise FormatError(f"{LEDGER}: columns {missing} missing")
    copies = ["copy"] if "copy" in pf.schema_arrow.names else []  # a mixture's ledger: a row per copy
    return pf.iter_batches(batch_size=LEDGER_BATCH, columns=LEDGER_SCHEMA.names + copies)


def _scan_ledger(out: Path) -> LedgerScan:
    scan = LedgerScan()
    for batch in _ledger_batches(out):
        cols = {n: batch.column(n).to_pylist() for n in LEDGER_SCHEMA.names}
        keys = cols["key"] if "copy" not in batch.schema.names else [
            copied_key(k, c) for k, c in zip(cols["key"], batch.column("copy").to_pylist())]
        ident, facts = [], []
        for split, shard, key, status, reason, tokens, targets, images, image_tokens, pack in zip(
                cols["split"], cols["shard"], keys, cols["status"], cols["reason"], cols["tokens"],
                cols["targets"], cols["images"], cols["image_tokens"], cols["pack"]):
            scan.counts[(split, status)] += 1
            if status in KEPT:
                ident.append(_digest(split, shard, key))
                facts.append(_digest(pack, tokens, targets, images, image_tokens))
            elif status not in STATUSES:
                scan.problems.append(f"{LEDGER}: {shard}/{key} has unknown status {status!r}")
            elif not reason:
                scan.problems.append(f"{LEDGER}: {shard}/{key} is {status} without a reason")
        scan.ident.append(np.asarray(ident, dtype=np.uint64))
        scan.facts.append(np.asarray(facts, dtype=np.uint64))
    return scan


def _check_ledger(out: Path, manifest: Manifest, reports: list[tuple[str, str, ShardReport]]) -> list[str]:
    """Every ledger row against the packs: kept samples lie exactly once in their pack with the recorded
    lengths; the others lie nowhere and have a reason; the manifest's counts match."""
    try:
        scan = _scan_ledger(out)
    except FormatError as exc:
        return [str(exc)]
    except Exception as exc:
        return [f"{LEDGER}: unreadable ({type(exc).__name__}: {exc})"]
    problems = scan.problems
    if not manifest.dry_run:
        problems += _check_placement(out, scan, reports)
    for split, c in manifest.counts.items():
        by_status: dict[str, int] = {s: scan.counts[(split, s)] for s in STATUSES}
        got: dict[str, int] = {"samples": sum(by_status.values()), **by_status}
        if {k: c.get(k) for k in got} != got:
            problems.append(f"{META}/packtool.json: counts {c} for {split}, the ledger {got}")
    if not manifest.dry_run:
        found: Counter[str] = Counter()
        for split, _, r in reports:
            found[split] += r.packs
        for split, n in (manifest.packs or {}).items():
            if found[split] != n:
                problems.append(f"{META}/packtool.json: {n} packs for {split}, the shards hold {found[split]}")
    return problems


def _check_placement(out: Path, scan: LedgerScan, reports: list[tuple[str, str, ShardReport]]) -> list[str]:
    """Match the ledger's kept rows with the segments found, digest by digest (sorted numpy arrays)."""
    l_ident, l_facts = _concat(scan.ident), _concat(scan.facts)
    f_ident = _concat([r.ident for _, _, r in reports])
    f_facts = _concat([r.facts for _, _, r in reports])
    f_where = np.concatenate([np.zeros(0, np.int64)] + [np.full(len(r.ident), i, np.int64)
                                                        for i, (_, _, r) in enumerate(reports)])
    f_record = _concat([r.record for _, _, r in reports], np.int32)
    l_ids, l_first, l_n = np.unique(l_ident, return_index=True, return_counts=True)
    f_ids, f_first, f_n = np.unique(f_ident, return_index=True, return_counts=True)
    kept_twice = l_ids[l_n > 1]
    placed_twice = f_ids[f_n > 1]
    not_found = np.setdiff1d(l_ids, f_ids, assume_unique=True)
    not_kept = np.setdiff1d(f_ids, l_ids, assume_unique=True)
    both, li, fi = np.intersect1d(l_ids, f_ids, assume_unique=True, return_indices=True)
    single = (l_n[li] == 1) & (f_n[fi] == 1)
    differ = both[single & (l_facts[l_first[li]] != f_facts[f_first[fi]])]
    if not (kept_twice.size or placed_twice.size or not_found.size or not_kept.size or differ.size):
        return []
    # Name the mismatches: the ledger rows again (streamed), the segments from their records.
    wanted = {int(x) for group in (kept_twice, not_found, differ) for x in group[:MAX_LISTED]}
    rows = _ledger_rows_of(out, wanted)
    segments = _Segments(out, [shard for _, shard, _ in reports])

    def found(ident: int) -> list[tuple[str, str, str, tuple]]:
        at = np.flatnonzero(f_ident == np.uint64(ident))[:MAX_LISTED]
        return [segments.get(int(f_where[j]), int(f_record[j]), ident) for j in at]

    problems = []
    for x in kept_twice[:MAX_LISTED]:
        r = rows[int(x)][0]
        problems.append(f"{LEDGER}: {r['shard']}/{r['key']} is kept {len(rows[int(x)])} times")
    for x in placed_twice[:MAX_LISTED]:
        hits = found(int(x))
        problems.append(f"{hits[0][0]}: pack {hits[0][1]}: segment {hits[0][2]} is also in packs "
                        f"{[h[1] for h in hits[1:]]}")
    for x in not_found[:MAX_LISTED]:
        r = rows[int(x)][0]
        problems.append(f"{LEDGER}: {r['shard']}/{r['key']} should be in {r['pack']}, found in no pack")
    for x in not_kept[:MAX_LISTED]:
        shard, pack, name, _ = found(int(x))[0]
        problems.append(f"{shard}: pack {pack}: segment {name} is not a kept sample of the ledger")
    for x in differ[:MAX_LISTED]:
        r = rows[int(x)][0]
        shard, pack, name, held = found(int(x))[0]
        recorded = (r["tokens"], r["targets"], r["images"], r["image_tokens"])
        if pack != r["pack"]:
            problems.append(f"{LEDGER}: {name} should be in {r['pack']}, found in {shard}: pack {pack}")
        else:
            problems.append(f"{shard}: pack {pack} segment {name}: tokens, targets, images, image tokens {held} "
                            f"in the pack, {recorded} in the ledger")
    return problems


def _concat(arrays: list[np.ndarray], dtype=np.uint64) -> np.ndarray:
    return np.concatenate([np.zeros(0, dtype), *arrays])


def _ledger_rows_of(out: Path, wanted: set[int]) -> dict[int, list[dict]]:
    """Kept ledger rows whose identity digest is in ``wanted`` (a second streamed pass)."""
    rows: dict[int, list[dict]] = {}
    for batch in _ledger_batches(out):
        for r in batch.to_pylist():
            if r["status"] in KEPT:
                d = _digest(r["split"], r["shard"], copied_key(r["key"], r.get("copy") or 0))
                if d in wanted:
                    rows.setdefault(d, []).append(r)
    return rows


class _Segments:
    """Segments looked up again by (shard, record ordinal): only for problem lines."""

    def __init__(self, out: Path, shards: list[str]):
        self.out, self.shards = out, shards
        self.index = lru_cache(maxsize=4)(lambda i: index_tar(out / shards[i]))

    def get(self, shard: int, ordinal: int, ident: int) -> tuple[str, str, str, tuple]:
        """``(output shard, pack key, "source shard/key", facts)`` of the segment with digest ``ident``."""
        rec = self.index(shard)[ordinal]
        with open_read(self.out / self.shards[shard]) as f:
            f.seek(rec.offset)
            key, members = parse_record(f.read(rec.size))
        record = PackRecord.from_members(key, members)
        for split, src_shard, src_key, held in segment_facts(record):
            if _digest(split, src_shard, src_key) == ident:
                return self.shards[shard], key, f"{src_shard}/{src_key}", held
        raise AssertionError("a segment digest names no segment of its record")
