"""Megatron-Bridge's converter output as input: ``convert_to_qwenvl_wds.py`` shards (pickled numpy image arrays,
pickled video frame lists, a ``ChatMLWebdataset`` ``dataset.yaml``) pack without an adapter, and the restricted
unpickler accepts numpy's own pickles of plain numeric arrays (protocols 2-5, numpy 1.x and 2.x module names)
while refusing every other global, object and structured dtypes, lying shapes and ndarray subclasses."""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import demo
from packtool.errors import SourceError
from packtool.packer.pipeline import pack
from packtool.packer.sources.mbridge import ChatMLFields, chatml_adapter, chatml_fields
from packtool.packer.sources.safepickle import load_bytes_list, load_videos, png_bytes, safe_loads
from packtool.packer.sources.sample import SampleError
from packtool.settings import EncodeSettings, PackSettings, PlanSettings
from packtool.verify.packs import verify_output
from test_hostile import segments

#: ``.nv-meta/dataset.yaml`` as Bridge documents it for this converter's output.
DATASET_YAML = {
    "__module__": "megatron.bridge.data.energon.task_encoder_utils",
    "__class__": "ChatMLWebdataset",
    "field_map": {"imgs": "jpgs", "videos": "videos", "conversation": "json"},
    "subflavors": {},
}


# -- pickles as the converter and numpy write them -------------------------------------------------------------
def numpy1_spelling(data: bytes) -> bytes:
    """The same pickle as numpy 1.x writes it: ``numpy.core.*`` instead of numpy 2's ``numpy._core.*``.

    FRAME opcodes (optional in a pickle) are dropped first, so renaming a length-prefixed string cannot leave a
    frame with a wrong length.
    """
    frames = [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME"]
    kept, last = [], 0
    for pos in frames:
        kept.append(data[last:pos])
        last = pos + 9
    data = b"".join(kept) + data[last:]
    for module in ("multiarray", "numeric"):
        old, new = f"numpy._core.{module}".encode(), f"numpy.core.{module}".encode()
        data = data.replace(bytes([0x8C, len(old)]) + old, bytes([0x8C, len(new)]) + new)  # SHORT_BINUNICODE
        data = data.replace(old + b"\n", new + b"\n")  # GLOBAL, protocols 0-3
    return data


def picture(width: int, height: int, seed: int) -> np.ndarray:
    """``np.array(pil_image)``: what the converter stores for each image (uint8, HxWx3)."""
    return np.array(demo.render_image(width, height, seed))


def jpgs(images: list[np.ndarray], protocol: int = pickle.DEFAULT_PROTOCOL, numpy1: bool = False) -> bytes:
    data = pickle.dumps([np.array(d) for d in images], protocol=protocol)
    return numpy1_spelling(data) if numpy1 else data


def videos(clips: list[torch.Tensor]) -> bytes:
    """The converter's ``videos`` member: per video, ``np.array`` of each frame of Qwen's float TCHW tensor."""
    with warnings.catch_warnings():  # torch's __array__ predates numpy 2's copy keyword
        warnings.simplefilter("ignore", DeprecationWarning)
        return pickle.dumps([[np.array(d) for d in video] for video in clips])


def chat(user: str, reply: str) -> bytes:
    return json.dumps([{"from": "human", "value": user}, {"from": "gpt", "value": reply}]).encode()


class Evil:
    """Pickles to a call of ``os.system`` that would create ``target``."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


# -- the converter-format dataset ------------------------------------------------------------------------------
IMAGES = {"s0": [picture(64, 48, 0)], "s1": [picture(56, 56, 1), picture(40, 72, 2)],
          "s4": [picture(60, 60, 4)], "s5": [picture(44, 52, 5)]}


def converter_samples(evil_target: Path) -> dict[str, dict[str, bytes]]:
    none = pickle.dumps([])
    clip = torch.rand(4, 3, 28, 28, generator=torch.Generator().manual_seed(0)) * 255
    return {
        "s0": {"jpgs": jpgs(IMAGES["s0"]), "videos": none, "json": chat("<image>\nWhat is shown?", "Cells.")},
        "s1": {"jpgs": jpgs(IMAGES["s1"]), "videos": none,
               "json": chat("Compare <image> and <image>.", "The second is taller.")},
        "s2": {"jpgs": none, "videos": none, "json": chat("Say hello.", "Hello.")},
        "s3": {"jpgs": none, "videos": videos([clip]), "json": chat("<video>\nWhat happens?", "Nothing.")},
        "s4": {"jpgs": jpgs(IMAGES["s4"], protocol=5, numpy1=True), "videos": none,
               "json": chat("<image> Colours?", "Several.")},
        "s5": {"jpgs": jpgs(IMAGES["s5"], protocol=2, numpy1=True), "videos": none,
               "json": chat("Describe <image>", "Blocks.")},
        "s6": {"jpgs": pickle.dumps([Evil(evil_target)]), "videos": none, "json": chat("<image> hi", "x")},
    }


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mbridge") / "wds"
    samples = converter_samples(root.parent / "pwned")
    demo.write_shard(root / "pretrain-0.tar", samples.items())
    demo.prepare_energon(root, ["pretrain-0.tar"], {"train": ["pretrain-0.tar"]}, dataset_yaml=DATASET_YAML)
    return root


def pack_settings(demo_dir: Path, **kw) -> PackSettings:
    return PackSettings(EncodeSettings(tokenizer=str(demo_dir / "tokenizer"), pack_size=2048, **kw),
                        PlanSettings(shard_size="4"))


@pytest.fixture(scope="module")
def packed_mbridge(converted, demo_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mbridge-out") / "out"
    pack(converted, out, pack_settings(demo_dir, allow_pickle=True), workers=1, progress=False)
    return out


# -- end to end --------------------------------------------------------------------------------------------------
def test_converter_output_packs_without_an_adapter(converted, packed_mbridge):
    ledger = {r["key"]: r for r in pq.read_table(packed_mbridge / "ledger.parquet").to_pylist()}
    assert {k: r["status"] for k, r in ledger.items()} == {
        "s0": "packed", "s1": "packed", "s2": "packed", "s3": "error", "s4": "packed", "s5": "packed",
        "s6": "error"}
    assert "pickled video 0 holds 4 frames of 3x28x28 float32: videos of decoded frames are not supported" in \
        ledger["s3"]["reason"]
    assert "refers to posix.system" in ledger["s6"]["reason"] or "refers to os.system" in ledger["s6"]["reason"]
    assert not (converted.parent / "pwned").exists()
    packed = segments(packed_mbridge)
    assert packed["s2"]["media"] == []
    for key, arrays in IMAGES.items():
        media = packed[key]["media"]
        assert len(media) == len(arrays), key
        for data, array in zip(media, arrays):
            assert data.startswith(b"\x89PNG\r\n\x1a\n")
            assert np.array_equal(np.array(Image.open(io.BytesIO(data))), array), key  # pixels kept exactly
    assert verify_output(packed_mbridge, source=converted) == []


def test_converter_output_packs_byte_identically_twice(converted, packed_mbridge, demo_dir, tmp_path):
    again = tmp_path / "again"
    pack(converted, again, pack_settings(demo_dir, allow_pickle=True), workers=1, progress=False)
    shards = sorted(p.relative_to(packed_mbridge) for p in packed_mbridge.rglob("*.tar"))
    assert shards and shards == sorted(p.relative_to(again) for p in again.rglob("*.tar"))
    for shard in shards:
        assert (packed_mbridge / shard).read_bytes() == (again / shard).read_bytes(), shard


def test_without_allow_pickle_every_pickled_sample_is_refused(converted, demo_dir, tmp_path):
    out = tmp_path / "nopickle"
    pack(converted, out, pack_settings(demo_dir), workers=1, progress=False)
    ledger = pq.read_table(out / "ledger.parquet").to_pylist()
    assert {r["status"] for r in ledger} == {"error"}
    assert all("pickled member" in r["reason"] and "refused" in r["reason"] for r in ledger)


# -- the adapter ------------------------------------------------------------------------------------------------
FIELDS = ChatMLFields(conversation="json", imgs="jpgs", videos="videos")


def test_dataset_yaml_gives_the_field_map():
    assert chatml_fields(DATASET_YAML) == FIELDS
    assert chatml_fields({"__class__": "VQAWebdataset"}) is None
    tutorial = {"__class__": "ChatMLWebdataset",
                "field_map": {"imgs": "image.png", "conversation": "conversation.json"}}
    assert chatml_fields(tutorial) == ChatMLFields(conversation="conversation.json", imgs="image.png")
    for field_map, reason in (({"imgs": "jpgs"}, "no field_map.conversation"),
                              ({"conversation": "json", "tools": "tools.json"}, "field_map.tools is not supported"),
                              ({"conversation": "json[messages]"}, "must name one member")):
        with pytest.raises(SourceError, match=reason):
            chatml_fields({"__class__": "ChatMLWebdataset", "field_map": field_map})


def test_adapter_reads_the_bridge_formats():
    one = {"image.png": png_bytes(picture(30, 20, 9)), "conversation.json": json.dumps({"conversation": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Cells."}]}]}).encode()}
    conv = chatml_adapter(one, fields=ChatMLFields(conversation="conversation.json", imgs="image.png"))
    assert [m.part for m in conv.media] == ["image.png"] and conv.messages[0]["content"] == "<image>What?"
    encoded = {"jpgs": pickle.dumps([png_bytes(picture(30, 20, 9))], protocol=4), "videos": pickle.dumps([]),
               "json": chat("<image> what", "x")}
    conv = chatml_adapter(encoded, fields=FIELDS, allow_pickle=True)
    assert [(m.part, m.item) for m in conv.media] == [("jpgs", 0)]
    frames = [png_bytes(picture(28, 28, i)) for i in range(2)]
    with_videos = {**encoded, "videos": pickle.dumps([frames, frames]), "json": chat("<video><image><video>", "x")}
    conv = chatml_adapter(with_videos, fields=FIELDS, allow_pickle=True)
    assert [(m.kind, m.part, m.item) for m in conv.media] == [("video", "videos", 0), ("image", "jpgs", 0),
                                                              ("video", "videos", 1)]
    one_file = {"json": chat("<video> what", "x"), "video.mp4": b"\0"}
    conv = chatml_adapter(one_file, fields=ChatMLFields(conversation="json", videos="video.mp4"))
    assert [(m.kind, m.part, m.item) for m in conv.media] == [("video", "video.mp4", None)]


@pytest.mark.parametrize("parts, fields, reason", [
    ({"json": chat("hi", "x"), "videos": pickle.dumps([])}, FIELDS, "member 'jpgs' (field_map.imgs) is missing"),
    ({"json": chat("<video> hi", "x"), "jpgs": pickle.dumps([]), "videos": pickle.dumps([])}, FIELDS,
     "1 <video> tags but 0 videos"),
    ({"json": chat("hi", "x"), "video.txt": b"\0"}, ChatMLFields(conversation="json", videos="video.txt"),
     "videos member 'video.txt' is neither a video nor a pickled video list"),
    ({"json": chat("hi", "x"), "audio.wav": b"\0"}, ChatMLFields(conversation="json", audio="audio.wav"),
     "audio is not supported yet"),
    ({"json": chat("hi", "x"), "txt": b"\0"}, ChatMLFields(conversation="json", imgs="txt"),
     "neither an image nor a pickled image list"),
])
def test_adapter_quarantines_what_it_cannot_pack(parts, fields, reason):
    with pytest.raises(SampleError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        chatml_adapter(parts, fields=fields, allow_pickle=True)


def test_videos_are_parsed_for_the_video_work():
    clip = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    (video,) = load_videos(videos([clip]))
    assert len(video.frames) == 2 and str(video) == "2 frames of 3x4x5 float32"
    assert np.array_equal(video.frames[1], clip[1].numpy())
    encoded = load_videos(pickle.dumps([[b"\xff\xd8a", b"\xff\xd8b"]]))
    assert encoded[0].frames == (b"\xff\xd8a", b"\xff\xd8b") and str(encoded[0]) == "2 encoded frames"


# -- the restricted unpickler --------------------------------------------------------------------------------------
PLAIN = [np.arange(12, dtype=np.uint8).reshape(2, 2, 3), np.array([True, False]),
         np.arange(6, dtype=">i2").reshape(2, 3), np.asfortranarray(np.arange(6.0).reshape(2, 3)),
         np.arange(24, dtype="<f4").reshape(2, 3, 4).transpose(2, 0, 1), np.zeros((0, 3), np.int64),
         np.float16([1.5, -2]), np.uint64([2**64 - 1]), np.int8([-128, 127]), np.arange(10)[::3]]


@pytest.mark.parametrize("numpy1", [False, True], ids=["numpy2-names", "numpy1-names"])
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_plain_numeric_arrays_round_trip(protocol, numpy1):
    value = {"arrays": PLAIN, "nested": ([PLAIN[0]], b"raw", "text", 3, 2.5, None)}
    data = pickle.dumps(value, protocol=protocol)
    if numpy1:
        data = numpy1_spelling(data)
        assert b"numpy._core" not in data and b"numpy.core." in data
        with warnings.catch_warnings():  # numpy 2 still loads numpy 1's names (deprecated): the edit is valid
            warnings.simplefilter("ignore")
            assert all(np.array_equal(a, b) for a, b in zip(pickle.loads(data)["arrays"], PLAIN))
    out = safe_loads(data)
    assert out["nested"][1:] == (b"raw", "text", 3, 2.5, None)
    for a, b in zip(out["arrays"] + [out["nested"][0][0]], PLAIN + [PLAIN[0]]):
        assert type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


class Sub(np.ndarray):
    pass


def _frombuffer_call(buf, dtype, shape, order="C"):
    """A pickle of numpy's protocol-5 call with arguments chosen by the test (what a hostile writer can send)."""
    from numpy._core.numeric import _frombuffer

    class Call:
        def __reduce__(self):
            return (_frombuffer, (buf, dtype, shape, order))

    return pickle.dumps([Call()], protocol=5)


def _reconstruct_call(state, cls=np.ndarray):
    from numpy._core.multiarray import _reconstruct

    class Call:
        def __reduce__(self):
            return (_reconstruct, (cls, (0,), b"b"), state)

    return pickle.dumps([Call()], protocol=4)


HOSTILE = {
    "os.system by GLOBAL": (b"cos\nsystem\n(S'touch {target}'\ntR.", "refers to os.system"),
    "os.system by STACK_GLOBAL": (b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x0ftouch {target}\x85R.",
                                  "refers to os.system"),
    "os.system by REDUCE inside a list": ("evil", "system"),
    "builtins.eval by INST": (b"(S'open(\"{target}\", \"w\")'\nibuiltins\neval\n.", "refers to builtins.eval"),
    "object dtype": (pickle.dumps([np.array([1, None], dtype=object)]), "dtype 'O8'"),
    "object dtype, protocol 5": (pickle.dumps([np.array([{}, []], dtype=object)], protocol=5), "dtype 'O8'"),
    "structured dtype": (pickle.dumps([np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")])], protocol=5),
                         "dtype 'V8'"),
    "complex dtype": (pickle.dumps([np.complex64([1j])]), "dtype 'c8'"),
    "string dtype": (pickle.dumps([np.array(["a"])]), "dtype 'U1'"),
    "dtype with metadata": (pickle.dumps([np.zeros(2, np.dtype("f4", metadata={"k": 1}))]), "state that is not"),
    "numpy scalar": (pickle.dumps([np.float32(1)]), "refers to numpy._core.multiarray.scalar"),
    "ndarray subclass": (pickle.dumps([np.zeros(3).view(Sub)]), "Sub; only"),
    "ndarray subclass, protocol 5": (pickle.dumps([np.zeros(3).view(Sub)], protocol=5), "Sub; only"),
    "masked array": (pickle.dumps([np.ma.array([1, 2])], protocol=5), "refers to numpy.ma.core._mareconstruct"),
    "huge shape, protocol 5": (_frombuffer_call(b"\0" * 3, np.dtype("u1"), (2**40, 2**40, 3)),
                               "needs 3626777458843887524118528 bytes, has 3"),
    "huge shape, protocol 4": (_reconstruct_call((1, (2**62,), np.dtype("<f8"), False, b"\0" * 8)),
                               "needs 36893488147419103232 bytes, has 8"),
    "negative shape": (_frombuffer_call(b"", np.dtype("u1"), (-1,)), "invalid shape"),
    "data not bytes": (_reconstruct_call((1, (1,), np.dtype("u1"), False, [1])), "data is list"),
    "reconstruct of a dtype": (_reconstruct_call((1, (1,), np.dtype("u1"), False, b"\0"), cls=np.dtype),
                               "not numpy's plain ndarray reconstruction"),
    "nested unknown global": (pickle.dumps([{"a": (1, [np.zeros(2)], {"b": [Evil(Path("/nonexistent/x"))]})}]),
                              "system"),
    "global in a dtype": (b"\x80\x04\x8c\x05numpy\x8c\x05dtype\x93\x8c\x02os\x8c\x06getcwd\x93)R\x85R.",
                          "refers to os.getcwd"),
    "state on an accepted global": (b"\x80\x04\x8c\x05numpy\x8c\x05dtype\x93}b.", "sets state on numpy.dtype"),
    "out-of-band buffer": (pickle.dumps(pickle.PickleBuffer(b"x"), protocol=5, buffer_callback=lambda b: False),
                           "unreadable pickled member"),
    "self-referring list": ("cycle", "refers to itself"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_pickles_are_refused_with_a_reason(case, tmp_path):
    data, reason = HOSTILE[case]
    target = tmp_path / "pwned"
    if data == "evil":
        data = pickle.dumps([Evil(target)], protocol=2)
    elif data == "cycle":
        cycle: list = []
        cycle.append(cycle)
        data = pickle.dumps(cycle)
    else:
        data = data.replace(b"{target}", str(target).encode())
    with pytest.raises(SampleError, match=reason.replace("(", r"\(")) as err:
        load_bytes_list(data)
    assert "\n" not in str(err.value)
    assert not target.exists()


def test_shared_references_are_rebuilt_once():
    node: list = [np.zeros(2, np.uint8)]
    for _ in range(12):  # 1000**12 paths through 12 lists of 1000 references each: every list is walked once
        node = [node] * 1000
    out = safe_loads(pickle.dumps(node))
    assert out[0] is out[999] and out[0][0] is out[999][0]
    deep: list = []
    for _ in range(20):
        deep = [deep]
    with pytest.raises(SampleError, match="nested too deeply"):
        safe_loads(pickle.dumps(deep))


def test_png_of_an_image_array_is_fixed_and_lossless():
    rgba = np.dstack([picture(9, 9, 1), picture(9, 9, 2)[:, :, :1]])
    for array in (picture(33, 17, 7), picture(20, 10, 8)[:, :, 0], rgba, picture(8, 6, 3)[:, :, :1]):
        data = png_bytes(array)
        assert data == png_bytes(array.copy())
        assert np.array_equal(np.array(Image.open(io.BytesIO(data))), array.reshape(array.shape[:2])
                              if array.ndim == 3 and array.shape[2] == 1 else array)
    for bad in (np.zeros((4, 4, 3), np.float32), np.zeros((4, 4, 2), np.uint8), np.zeros((0, 4, 3), np.uint8),
                np.zeros(4, np.uint8)):
        with pytest.raises(SampleError, match="is not an 8-bit"):
            png_bytes(bad)


def test_converter_samples_without_their_dataset_yaml_read_the_same(tmp_path):
    """Without ``ChatMLWebdataset`` in ``dataset.yaml`` the chat JSON adapter takes the sample: same media, and a
    video of decoded frames still quarantines it rather than leaving its ``<video>`` tag as text."""
    from packtool.packer.sources.conversation import conversation_adapter

    samples = converter_samples(tmp_path / "pwned")
    for key in ("s0", "s1", "s2", "s4", "s5"):
        with_yaml = chatml_adapter(samples[key], fields=FIELDS, allow_pickle=True)
        assert conversation_adapter(samples[key], allow_pickle=True) == with_yaml, key
    with pytest.raises(SampleError, match="videos of decoded frames are not supported"):
        conversation_adapter(samples["s3"], allow_pickle=True)
