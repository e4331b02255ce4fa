"""The encoded media item (:class:`packtool.item.MediaItem`): its encode-store JSON, byte for byte."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from packtool.families.base import MediaTokens, NoMedia
from packtool.families.conventions import TRANSFORMERS
from packtool.item import (
    AUDIO_KEYS,
    DECODED_AUDIO_KEYS,
    IMAGE_KEYS,
    VIDEO_KEYS,
    MediaItem,
    dumps_media,
    loads_media,
)
from packtool.packer.assemble import media_ref

# Media columns of encode stores written before the type existed (the demo's, packed with the Qwen2.5-VL-style
# folder and the Nemotron Omni folder by rule, and by the processor mode): each layout's bytes as they are.
IMAGE_AND_RULE_AUDIO = (
    '[{"part":"jpg","item":null,"kind":"image","ext":"jpg","width":224,"height":417,"offset":387584,"size":5693,'
    '"tokens":276,"grid_thw":[1,46,24],"token_offset":6,"span":[5,283]},{"part":"wav","item":null,"kind":"audio",'
    '"ext":"wav","grid_thw":[],"width":0,"height":0,"offset":394240,"size":16078,"tokens":7,"samples":8000,'
    '"token_offset":284,"span":[283,292]}]')
IMAGE_AND_DECODED_AUDIO = (
    '[{"part":"jpg","item":null,"kind":"image","ext":"jpg","width":224,"height":417,"offset":387584,"size":5693,'
    '"tokens":276,"grid_thw":[1,46,24],"token_offset":6,"span":[5,283]},{"part":"wav","item":null,"kind":"audio",'
    '"ext":"wav","grid_thw":[],"width":0,"height":0,"offset":394240,"size":16078,"samples":8000,"tokens":7,'
    '"token_offset":284,"span":[283,292]}]')
VIDEO_FILE = (
    '[{"part":"webm","item":null,"kind":"video","ext":"webm","width":54,"height":54,"offset":80384,"size":1272,'
    '"sha256":"c044fe668b46a3a97f0a0981ffcb1919c520923f11eda783ed58592a96f4e2f7","frames":[],"total_frames":7,'
    '"fps":2.0,"duration":3.5,"tokens":16,"grid_thw":[4,4,4],"frame_indices":[0,1,2,3,4,5,6],'
    '"second_per_grid_ts":1.0,"token_offset":256,"span":[255,273]}]')
VIDEO_FRAMES = (
    '[{"part":"clip.0.jpg","item":null,"kind":"video","ext":"jpg","width":72,"height":120,"offset":406016,'
    '"size":6824,"sha256":"3dc63ae84b36aa286f30e29df92ffbc2c728a6f012184255f93cbbecb394063a","frames":'
    '[["clip.0.jpg",406016,1703],["clip.1.jpg",408576,1717],["clip.2.jpg",411136,1707],["clip.3.jpg",413696,1697]],'
    '"total_frames":4,"fps":null,"duration":null,"tokens":24,"grid_thw":[2,8,6],"frame_indices":[0,1,2,3],'
    '"second_per_grid_ts":0.08333333333333333,"token_offset":28,"span":[27,53]}]')
#: An image of a pickled list (``item``: its index; ``ext`` from its format).
LIST_IMAGE = ('[{"part":"jpgs","item":1,"kind":"image","ext":"png","width":32,"height":32,"offset":1536,'
              '"size":900,"tokens":4,"grid_thw":[1,4,4],"token_offset":3,"span":[2,9]}]')
STORED = [IMAGE_AND_RULE_AUDIO, IMAGE_AND_DECODED_AUDIO, VIDEO_FILE, VIDEO_FRAMES, LIST_IMAGE]


def test_every_stored_layout_reads_back_and_writes_the_same_bytes():
    for text in STORED:
        items = loads_media(text)
        assert all(isinstance(m, MediaItem) for m in items)
        assert dumps_media(items) == text
        assert [tuple(json.loads(text)[i]) for i in range(len(items))] == [m.keys for m in items]
    assert dumps_media([]) == "[]" and loads_media("[]") == []


def test_the_writer_lays_out_each_kind_as_the_store_does():
    """Items built field by field (as the encoder builds them) write the stored bytes: the key order of each kind,
    and audio decoded before its plan (the processor mode) with ``samples`` before ``tokens``."""
    image = MediaItem("jpg", None, "image", "jpg", 224, 417, 387584, 5693, 276, (1, 46, 24), token_offset=6,
                      span=(5, 283))
    audio = MediaItem("wav", None, "audio", "wav", 0, 0, 394240, 16078, 7, samples=8000, token_offset=284,
                      span=(283, 292))
    assert dumps_media([image, audio]) == IMAGE_AND_RULE_AUDIO
    decoded = replace(audio, decoded=True)
    assert dumps_media([image, decoded]) == IMAGE_AND_DECODED_AUDIO
    assert loads_media(IMAGE_AND_DECODED_AUDIO)[1] == decoded != audio  # the layout is read back too
    video = MediaItem("clip.0.jpg", None, "video", "jpg", 72, 120, 406016, 6824, 24, (2, 8, 6),
                      sha256="3dc63ae84b36aa286f30e29df92ffbc2c728a6f012184255f93cbbecb394063a",
                      frames=(("clip.0.jpg", 406016, 1703), ("clip.1.jpg", 408576, 1717),
                              ("clip.2.jpg", 411136, 1707), ("clip.3.jpg", 413696, 1697)),
                      total_frames=4, frame_indices=(0, 1, 2, 3), second_per_grid_ts=0.08333333333333333,
                      token_offset=28, span=(27, 53))
    assert dumps_media([video]) == VIDEO_FRAMES
    assert (IMAGE_KEYS, VIDEO_KEYS, AUDIO_KEYS, DECODED_AUDIO_KEYS) == (image.keys, video.keys, audio.keys,
                                                                        decoded.keys)
    # The control: audio without its samples (a family that does not count them) leaves the key out.
    assert '"samples"' not in dumps_media([replace(audio, samples=None)])


def test_a_store_written_before_spans_were_recorded_still_reads():
    """An item without ``span`` (older stores) reads with none: its span is then widened from its placeholders,
    and its pack record gets an empty one, as before."""
    old = json.loads(LIST_IMAGE)
    del old[0]["span"]
    (item,) = loads_media(json.dumps(old, separators=(",", ":")))
    assert item.span is None and "span" not in item.to_json()
    start, end = 7, 8
    family = NoMedia(MediaTokens(vision_start_id=start, vision_end_id=end), TRANSFORMERS)
    tokens = np.array([1, 2, start, 9, 9, 9, 9, end, 5])
    assert family.media_span(tokens, item) == (2, 8)  # the placeholders at 3..6 widened by the markers
    assert family.media_span(tokens, replace(item, span=(1, 9))) == (1, 9)  # a recorded span wins
    ref = media_ref(item, "m0.png", [], 900, "ab" * 32)
    assert ref.span == [] and ref.samples == 0 and ref.grid_thw == [1, 4, 4]


_ints = st.integers(0, 2**40)
_small = st.integers(0, 4096)
_grid = st.tuples(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
_span = st.one_of(st.none(), st.tuples(_small, _small))
_float = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False))
_name = st.text("abcdefghij0123456789._-", min_size=1, max_size=12)


@st.composite
def _items(draw: st.DrawFn) -> MediaItem:
    kind = draw(st.sampled_from(["image", "video", "audio"]))
    base = {"part": draw(_name), "item": None if kind == "audio" else draw(st.one_of(st.none(), _small)),
            "kind": kind, "ext": draw(_name), "offset": draw(_ints), "size": draw(_ints), "tokens": draw(_small),
            "token_offset": draw(_small), "span": draw(_span)}
    if kind == "audio":
        samples = draw(st.one_of(st.none(), _ints))
        return MediaItem(**base, width=0, height=0, samples=samples,
                         decoded=samples is not None and draw(st.booleans()))
    base |= {"width": draw(_small), "height": draw(_small), "grid_thw": draw(_grid)}
    if kind == "image":
        return MediaItem(**base)
    return MediaItem(**base, sha256=draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
                     frames=tuple(draw(st.lists(st.tuples(_name, _ints, _ints), max_size=4))),
                     total_frames=draw(_small), fps=draw(_float), duration=draw(_float),
                     frame_indices=tuple(draw(st.lists(_small, max_size=8))), second_per_grid_ts=draw(_float))


@given(st.lists(_items(), max_size=4))
def test_items_round_trip_through_the_store(items):
    text = dumps_media(items)
    assert loads_media(text) == items
    assert dumps_media(loads_media(text)) == text
    # Each item writes its layout's keys, less the optional ones it has no value for.
    for m, d in zip(items, json.loads(text)):
        assert list(d) == [k for k in m.keys if not (k in ("samples", "span") and getattr(m, k) is None)]
