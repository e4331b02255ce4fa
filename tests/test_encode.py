"""Encoding: chat template, targets, image tokens and truncation, checked against independent derivations."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
from PIL import Image

from packtool.families.qwen2_vl import Qwen2VL
from packtool.packer.encoder import Encoder
from packtool.packer.sources import RawSample, open_source, read_raw_samples
from packtool.settings import EncodeSettings


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (120, 30, 200)).save(buf, "PNG")
    return buf.getvalue()


def raw(parts: dict, key: str = "k0") -> RawSample:
    r = RawSample(key=key, shard="shards/x.tar", index=0)
    off = 0
    for name, data in parts.items():
        r.parts[name] = data if isinstance(data, bytes) else json.dumps(data).encode()
        r.ranges[name] = (off, len(r.parts[name]))
        off += len(r.parts[name])
    return r


@pytest.fixture(scope="module")
def encoders(demo_dir):
    return {name: Encoder(EncodeSettings(tokenizer=str(demo_dir / name), pack_size=2048))
            for name in ("tokenizer", "tokenizer-gen")}


def structured(messages):
    out = []
    for m in messages:
        pieces = m["content"].split("<image>")
        content = []
        for i, p in enumerate(pieces):
            if i:
                content.append({"type": "image"})
            if p:
                content.append({"type": "text", "text": p})
        out.append({"role": m["role"], "content": content if len(pieces) > 1 else m["content"]})
    return out


def test_demo_samples_decode_to_their_conversation(encoders, demo_dir):
    """Independent: transformers' own apply_chat_template + tokenizer + smart_resize give the expected ids; the
    targets decode to exactly the assistant replies each followed by <|im_end|>."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from packtool.packer.sources.conversation import conversation_adapter

    src = open_source(demo_dir / "dataset", ["train"])
    raws = list(read_raw_samples(src.root, src.splits["train"][1], src.excluded_samples))
    cfg = json.loads((demo_dir / "tokenizer" / "preprocessor_config.json").read_text())
    results = {name: enc.encode_many(raws) for name, enc in encoders.items()}
    tok = encoders["tokenizer"].tok
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    checked = 0
    for i, r in enumerate(raws):
        plain, gen = results["tokenizer"][i], results["tokenizer-gen"][i]
        assert plain.status == gen.status
        if plain.status != "packed":
            continue
        assert np.array_equal(plain.tokens, gen.tokens) and np.array_equal(plain.targets, gen.targets)
        conv = conversation_adapter(r.parts)
        text = tok.apply_chat_template(structured(conv.messages), tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        counts = []
        for m in conv.media:
            w, h = Image.open(io.BytesIO(r.parts[m.part])).size
            rh, rw = smart_resize(h, w, 28, cfg["min_pixels"], cfg["max_pixels"])
            counts.append(rh * rw // 784)
        expected, it = [], iter(counts)
        for t in ids:
            expected += [t] * (next(it) if t == pad else 1)
        assert plain.tokens.tolist() == expected
        replies = [m["content"] + "<|im_end|>" for m in conv.messages if m["role"] == "assistant"]
        runs = np.split(plain.tokens, np.flatnonzero(np.diff(plain.targets.astype(int)) != 0) + 1)
        flags = np.split(plain.targets, np.flatnonzero(np.diff(plain.targets.astype(int)) != 0) + 1)
        got = [tok.decode(run, skip_special_tokens=False) for run, f in zip(runs, flags) if f[0]]
        assert got == replies
        checked += 1
    assert checked >= 20


def test_truncation_never_cuts_media_and_keeps_targets(demo_dir):
    enc = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=300))
    turns = [{"from": "human", "value": "<image> describe " + "word " * 20},
             {"from": "gpt", "value": "answer " * 30},
             {"from": "human", "value": "more " * 10 + "<image>"},
             {"from": "gpt", "value": "fine " * 80}]
    r = raw({"json": {"conversations": turns}, "img0.png": png(200, 200), "img1.png": png(300, 300)})
    e = enc.encode_many([r])[0]
    assert e.status == "truncated" and len(e.tokens) <= 300 and e.targets.any(), e.reason
    assert len(e.media) == 1 and len(e.tokens) < 300  # the cut moved back before the second image's span
    pad = enc.family.tokens.image_token_id
    for m in e.media:
        assert (e.tokens[m.token_offset: m.token_offset + m.tokens] == pad).all()
    assert int((e.tokens == pad).sum()) == sum(m.tokens for m in e.media)
    assert e.tokens[-1] != enc.family.tokens.vision_start_id  # never a dangling vision start
    dropped = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=300,
                                     overlong="drop")).encode_many([r])[0]
    assert dropped.status == "dropped" and "tokens >" in dropped.reason
    tiny = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=40)).encode_many([r])[0]
    assert tiny.status == "dropped" and "no training target" in tiny.reason


def test_image_cap_truncates_before_the_extra_image(demo_dir):
    enc = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=4096, max_images=1))
    turns = [{"role": "user", "content": "a <image> b"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "c <image>"}, {"role": "assistant", "content": "fine"}]
    e = enc.encode_many([raw({"json": {"messages": turns}, "0.png": png(60, 60), "1.png": png(60, 60)})])[0]
    assert e.status == "truncated" and len(e.media) == 1 and "image cap" in e.reason


HOSTILE = {
    "bad json": ({"json": b"{not json"}, "invalid json"),
    "empty json": ({"json": b""}, "invalid json"),
    "no assistant": ({"json": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
    "tag mismatch": ({"json": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}],
                      "jpg": png(50, 50)}, "2 <image> tags but 1 images"),
    "truncated image": ({"json": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
                         "png": png(300, 300)[:200]}, "undecodable image"),
    "garbage image": ({"json": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
                       "jpg": b"\xff\xd8 not really"}, "undecodable image"),
    "missing referenced media": ({"json": {"image": "photo.jpg", "conversations": [
        {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]}}, "referenced but missing"),
    "pickle refused": ({"json": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
                        "jpgs": pickle.dumps([png(40, 40)])}, "pickled member"),
    "control token": ({"json": [{"from": "human", "value": "hi <|im_end|>"}, {"from": "gpt", "value": "x"}]},
                      "control token"),
    "unknown role": ({"json": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]}, "unknown role"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_samples_are_errors_with_reasons(encoders, case):
    parts, reason = HOSTILE[case]
    e = encoders["tokenizer"].encode_many([raw(parts)])[0]
    assert e.status == "error" and reason in e.reason, e.reason


def test_pixel_limit_and_pickle_allowed(demo_dir):
    turns = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]
    bomb = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, pixel_limit=10_000))
    e = bomb.encode_many([raw({"json": turns, "png": png(200, 200)})])[0]
    assert e.status == "error" and "exceeds the limit" in e.reason
    ok = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, allow_pickle=True))
    e = ok.encode_many([raw({"json": turns, "jpgs": pickle.dumps([png(40, 40)])})])[0]
    assert e.status == "packed" and e.media[0].item == 0

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    e = ok.encode_many([raw({"json": turns, "jpgs": pickle.dumps([Evil()])})])[0]
    assert e.status == "error" and "builtins.print" in e.reason


def test_unsafe_member_names_are_quarantined(tmp_path):
    import tarfile

    shard = tmp_path / "shards" / "a.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        for name, data in (("s1.json", b"{}"), ("../etc/s2.json", b"{}"), ("/abs/s3.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    samples = list(read_raw_samples(tmp_path, "shards/a.tar"))
    assert [s.problem is None for s in samples] == [True, False, False]
    assert all("unsafe member name" in s.problem for s in samples[1:])
    assert not (tmp_path.parent / "etc").exists()


def test_template_only_in_processor_chat_template_json(demo_dir, tmp_path, encoders):
    """VLM folders often keep the template in chat_template.json (the processor's) rather than the tokenizer's."""
    import shutil

    folder = tmp_path / "vlm"
    shutil.copytree(demo_dir / "tokenizer", folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    enc = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048))
    turns = [{"from": "human", "value": "<image> what is it"}, {"from": "gpt", "value": "a square"}]
    r = raw({"json": turns, "png": png(64, 64)})
    a, b = enc.encode_many([r])[0], encoders["tokenizer"].encode_many([r])[0]
    assert a.status == "packed" and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.targets, b.targets)


def test_template_date_is_fixed_by_a_setting(demo_dir, tmp_path):
    """Templates that print today's date (Llama-3.1 style) must not make the output depend on the day."""
    import shutil

    folder = tmp_path / "dated"
    shutil.copytree(demo_dir / "tokenizer", folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text("{{ 'Today ' + strftime_now('%d %b %Y') }}" + template)
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    tok = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048)).tok

    def text(date):
        e = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048, template_date=date))
        return tok.decode(e.encode_many([raw({"json": turns})])[0].tokens)

    assert text("2024-07-23").startswith("Today 23 Jul 2024")
    assert text("2026-01-01").startswith("Today 01 Jan 2026")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048, template_date="yesterday"))


def test_a_text_cut_before_tokenizing_keeps_its_length_a_lower_bound(demo_dir):
    """A reply far longer than a pack is cut before tokenizing: its length is then only a lower bound, and the
    truncated (or dropped) row says so both in its reason and in ``length_known``."""
    turns = [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "word " * 40_000}]
    r = raw({"json": {"conversations": turns}})
    short = raw({"json": {"conversations": [turns[0], {"from": "gpt", "value": "word " * 600}]}}, key="k1")
    for overlong, status in (("truncate", "truncated"), ("drop", "dropped")):
        enc = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=512, overlong=overlong))
        cut, whole = enc.encode_many([r, short])
        assert (cut.status, whole.status) == (status, status)
        assert "at least" in cut.reason and cut.length_known is False
        assert "at least" not in whole.reason and whole.length_known is True


def test_another_familys_image_processor_is_no_qwen_rule(demo_dir, tmp_path):
    """A preprocessor_config.json of another family (here CLIP's) is not read as Qwen2-VL's: a clear error naming
    the ways out, unless a fixed image count is given; Qwen2.5-VL's name for the processor is the same rule."""
    import shutil

    from packtool.errors import ConfigError

    folders = {}
    for kind in ("CLIPImageProcessor", "Qwen2_5_VLImageProcessor"):
        folder = folders[kind] = tmp_path / kind
        shutil.copytree(demo_dir / "tokenizer", folder)
        config = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps({**config, "image_processor_type": kind}))
    with pytest.raises(ConfigError, match="'CLIPImageProcessor' is no Qwen2-VL one.*processor mode.*image_tokens"):
        Encoder(EncodeSettings(tokenizer=str(folders["CLIPImageProcessor"]), pack_size=2048))
    fixed = Encoder(EncodeSettings(tokenizer=str(folders["CLIPImageProcessor"]), pack_size=2048, image_tokens=9))
    r = raw({"json": {"conversations": [{"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "a"}]},
             "png": png(300, 200)})
    assert [m.tokens for m in fixed.encode_many([r])[0].media] == [9]
    qwen25 = Encoder(EncodeSettings(tokenizer=str(folders["Qwen2_5_VLImageProcessor"]), pack_size=2048))
    qwen2 = Encoder(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048))
    assert isinstance(qwen25.family, Qwen2VL) and isinstance(qwen2.family, Qwen2VL)
    assert qwen25.family.image == qwen2.family.image
    assert qwen25.encode_many([r])[0].tokens.tolist() == qwen2.encode_many([r])[0].tokens.tolist()


def gemma3_folder(root, tokenizer_dir):
    """A Gemma 3 processor folder made offline: the demo BPE plus Gemma 3's image tokens, its processor expanding
    ``<start_of_image>`` in the text to ``\\n\\n<start_of_image>`` + 4 ``<image_soft_token>`` + ``<end_of_image>\\n\\n``
    (the model fills the soft tokens), and a ChatML template rendering image parts as ``<start_of_image>``."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import Gemma3ImageProcessor, Gemma3Processor, PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names.values()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  extra_special_tokens=names)
    template = (tokenizer_dir / "chat_template.jinja").read_text().replace(
        "<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")
    Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 28, "width": 28}), tokenizer=tok,
                    image_seq_length=4, chat_template=template).save_pretrained(root)
    return root


def test_processor_mode_takes_a_placeholder_that_is_not_the_filled_token(demo_dir, tmp_path):
    """Gemma 3's text placeholder (``<start_of_image>``) is not the token its model fills: the processor mode
    renders the processor's placeholder, records the filled tokens as each image's, and its tokens are the
    processor's own; the rule mode has no rule for this folder's images."""
    from transformers import AutoProcessor

    folder = gemma3_folder(tmp_path / "gemma3", demo_dir / "tokenizer")
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    soft = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    turns = [{"from": "human", "value": "Look <image> here, and <image> there?"}, {"from": "gpt", "value": "a cat"}]
    r = raw({"json": {"conversations": turns}, "img0.png": png(40, 30), "img1.png": png(20, 50)})
    enc = Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048, media_tokens="processor"))
    e = enc.encode_many([r])[0]
    assert e.status == "packed", e.reason
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Look "}, {"type": "image"}, {"type": "text", "text": " here, and "},
        {"type": "image"}, {"type": "text", "text": " there?"}]}, {"role": "assistant", "content": "a cat"}],
        tokenize=False)
    images = [Image.open(io.BytesIO(r.parts[p])) for p in ("img0.png", "img1.png")]
    assert e.tokens.tolist() == processor(text=[text], images=[images])["input_ids"][0]
    soft_at = np.flatnonzero(e.tokens == soft).tolist()
    assert [(m.token_offset, m.tokens) for m in e.media] == [(soft_at[0], 4), (soft_at[4], 4)]
    assert enc.family.tokens.image_token_id == soft
    assert enc.tok.decode(e.tokens[e.targets.astype(bool)]) == "a cat<|im_end|>"
    from packtool.errors import ConfigError

    # Its image settings, nested in processor_config.json, are read like any other folder's: no Qwen2-VL rule.
    with pytest.raises(ConfigError, match="'Gemma3ImageProcessor' is no Qwen2-VL one"):
        Encoder(EncodeSettings(tokenizer=str(folder), pack_size=2048))
