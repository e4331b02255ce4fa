"""Build a Hugging Face tokenizer folder with the real Qwen2 vocabulary, offline, for benchmarks and integration tests.

The Qwen2 byte-level BPE ranks ship inside the PyPI wheel ``qwen-agent`` (``qwen_agent/utils/qwen.tiktoken``,
151,643 ranks). This script converts them into ``tokenizer.json`` with ``tokenizers`` (Qwen2's regex
pre-tokenizer, byte level), adds the Qwen2-VL special tokens at their real ids (151643 ``<|endoftext|>`` …
151656 ``<|video_pad|>``), and writes the demo's ChatML chat template and a Qwen2-VL image processor config with
transformers' defaults (min_pixels 3,136, max_pixels 1,003,520).

Usage::

    python scripts/qwen_tokenizer.py OUTDIR [PATH]   # PATH: qwen.tiktoken or the qwen-agent wheel

Without PATH the wheel is fetched from PyPI with ``pip download --no-deps`` into a temporary folder (nothing is
installed, nothing comes from a model hub).
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

QWEN_AGENT_WHEEL = "qwen-agent==0.0.34"
TIKTOKEN_MEMBER = "qwen_agent/utils/qwen.tiktoken"
N_RANKS = 151643

#: Qwen2-VL's added special tokens, in id order from 151643.
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",  # 151643
    "<|im_start|>",  # 151644
    "<|im_end|>",  # 151645
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",  # 151652
    "<|vision_end|>",  # 151653
    "<|vision_pad|>",  # 151654
    "<|image_pad|>",  # 151655
    "<|video_pad|>",  # 151656
)

#: Ids the rest of packtool relies on.
EXPECTED_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}

QWEN_MIN_PIXELS = 3136
QWEN_MAX_PIXELS = 1003520


def load_demo() -> ModuleType:
    """Import ``examples/demo.py`` (chat template, config writers) without making ``examples`` a package."""
    path = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
    spec = importlib.util.spec_from_file_location("packtool_demo", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def byte_symbols() -> list[str]:
    """The byte-level alphabet: the printable character standing for each byte value 0..255.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, a few more) are shifted to
    code points 256, 257, … in byte order, so every byte has a visible, unique symbol.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols: list[str] = []
    shifted = 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def read_tiktoken(path: Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file: one ``base64(token) rank`` per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Turn tiktoken ranks into a byte-level BPE vocab and merge list with the same encoding behaviour.

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank. A BPE merge list
    reproduces that when every split ``(left, right)`` of a token into two known tokens is a merge, ordered by
    the rank of the joined token.
    """
    symbols = byte_symbols()

    def text(token: bytes) -> str:
        return "".join(symbols[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    entries: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                entries.append((rank, left_rank, right_rank, left, right))
    entries.sort()
    merges = [(text(left), text(right)) for _, _, _, left, right in entries]
    return vocab, merges


def build_tokenizer(ranks: dict[bytes, int], demo: ModuleType):
    """A ``tokenizers.Tokenizer`` for the Qwen2 vocabulary plus the Qwen2-VL special tokens."""
    from tokenizers import AddedToken, models

    vocab, merges = bpe_vocab_and_merges(ranks)
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = demo.qwen2_style_tokenizer(model)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_VL_SPECIAL_TOKENS])
    return tok


def fetch_tiktoken(path: Path | None, work_dir: Path) -> Path:
    """Return a ``qwen.tiktoken`` path: ``path`` itself, extracted from a given wheel, or from a fresh download."""
    if path is not None and path.suffix != ".whl":
        return path
    if path is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", QWEN_AGENT_WHEEL, "-d", str(work_dir)],
            check=True,
        )
        wheels = sorted(work_dir.glob("qwen_agent-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download of {QWEN_AGENT_WHEEL} gave no wheel in {work_dir}")
        path = wheels[0]
    with zipfile.ZipFile(path) as wheel:
        target = work_dir / "qwen.tiktoken"
        target.write_bytes(wheel.read(TIKTOKEN_MEMBER))
    return target


def check_folder(out_dir: Path) -> None:
    """Load the folder with transformers and check ids of the special tokens and of a plain sentence."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    for token, expected in EXPECTED_IDS.items():
        got = tok.convert_tokens_to_ids(token)
        if got != expected:
            raise SystemExit(f"{token} has id {got}, expected {expected}")
    sentence = "Hello world, this is a test of the Qwen2 tokenizer.\n"
    ids = tok(sentence)["input_ids"]
    if tok.decode(ids) != sentence or len(ids) > 16 or max(ids) >= N_RANKS:
        raise SystemExit(f"unexpected encoding of {sentence!r}: {ids}")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    ids = tok(chat)["input_ids"]
    if EXPECTED_IDS["<|image_pad|>"] not in ids or ids[0] != EXPECTED_IDS["<|im_start|>"]:
        raise SystemExit(f"unexpected chat encoding: {ids}")
    processor = AutoImageProcessor.from_pretrained(out_dir)
    print(f"ok: {type(tok).__name__} with {len(tok)} tokens, {type(processor).__name__}; "
          f"{sentence!r} -> {tok(sentence)['input_ids']}")


def convert(tiktoken_path: Path, out_dir: Path, *, generation_tags: bool = False) -> Path:
    """Write the Hugging Face folder for the Qwen2 vocabulary at ``tiktoken_path`` into ``out_dir``."""
    demo = load_demo()
    ranks = read_tiktoken(tiktoken_path)
    if len(ranks) != N_RANKS or sorted(ranks.values()) != list(range(N_RANKS)):
        raise SystemExit(f"{tiktoken_path}: expected ranks 0..{N_RANKS - 1}, got {len(ranks)} entries")
    tok = build_tokenizer(ranks, demo)
    return demo.write_model_folder(
        out_dir, tok, generation_tags=generation_tags, tokenizer_class="Qwen2Tokenizer",
        min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("source", type=Path, nargs="?", help="qwen.tiktoken or the qwen-agent wheel")
    parser.add_argument("--generation-tags", action="store_true", help="wrap replies in {%% generation %%}")
    parser.add_argument("--no-check", action="store_true", help="skip loading the result with transformers")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qwen-tiktoken-") as tmp:
        path = fetch_tiktoken(args.source, Path(tmp))
        convert(path, args.outdir, generation_tags=args.generation_tags)
    if not args.no_check:
        check_folder(args.outdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
