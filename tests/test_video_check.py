"""The decode check (``--media-check decode``) refuses every damage that single-threaded decoding refuses, whatever
threads it is given: slice threading (PyAV's default) conceals damage inside an H.264 slice, so the check decodes
with frame threads only."""

from __future__ import annotations

import io

import pytest

import mediafixture as mf
from packtool.media import video

ERR_DETECT = {"err_detect": "crccheck+bitstream+buffer+explode"}


def _decodes(data: bytes, thread_type: str, threads: int) -> bool:
    """Whether every frame decodes with error detection on, with these threads."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            stream.codec_context.options = dict(ERR_DETECT)
            stream.thread_type = thread_type
            stream.codec_context.thread_count = threads
            for _ in container.decode(stream):
                pass
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def damaged() -> list[bytes]:
    """A 4-slice H.264 video damaged (3 bytes flipped) at points across three frames' packets."""
    import av

    data = mf.make_sliced_h264(320, 240, frames=24, slices=4)
    with av.open(io.BytesIO(data)) as container:
        packets = [(p.pos, p.size) for p in container.demux(container.streams.video[0]) if p.size]
    out = []
    for pos, size in (packets[0], packets[5], packets[10]):
        for frac in (0.2, 0.35, 0.5, 0.65, 0.8):
            b = bytearray(data)
            start = pos + int(size * frac)
            b[start:start + 3] = bytes(x ^ 0x5A for x in b[start:start + 3])
            out.append(bytes(b))
    return out


@pytest.fixture
def threads():
    yield
    video.set_decoder_threads(0)


@pytest.mark.parametrize("count", [0, 1, 2, 4])
def test_the_decode_check_refuses_what_one_thread_refuses(damaged, threads, count):
    video.set_decoder_threads(count)
    refused_by_one = [d for d in damaged if not _decodes(d, "SLICE", 1)]
    # control: slice threads let some of that damage through (the check would miss it with them)
    missed_by_slices = [d for d in refused_by_one if _decodes(d, "SLICE", 4)]
    assert missed_by_slices, "slice threading no longer conceals mid-slice damage; the control shows nothing"
    for data in refused_by_one:
        with pytest.raises(ValueError, match="undecodable video"):
            video.probe_video(data, max_pixels=10**7, decode=True)


def test_the_undamaged_video_passes_the_check_with_any_threads(threads):
    data = mf.make_sliced_h264(320, 240, frames=24, slices=4)
    for count in (0, 1, 2, 4):
        video.set_decoder_threads(count)
        facts = video.probe_video(data, max_pixels=10**7, decode=True)
        assert (facts.frames, facts.frame_count_source) == (24, "decode")


def test_decoder_threads_divide_the_cores():
    cores = video.decoder_threads_for(1)
    assert cores >= 1
    assert video.decoder_threads_for(cores) == 1
    assert video.decoder_threads_for(cores * 4) == 1
    assert video.decoder_threads_for(2) == max(1, cores // 2)
    with pytest.raises(ValueError, match="non-negative"):
        video.set_decoder_threads(-1)
