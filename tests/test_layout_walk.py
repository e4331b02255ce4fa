"""The shard layout's header walk reads exactly what ``tarfile`` reads, on plain shards and on unusual ones."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from packtool.packer.sources.energon import _plain_members, _tar_members, _Unusual, shard_layout


def _tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT, dirs: tuple = ()) -> Path:
    with tarfile.open(path, "w", format=fmt) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


_PLAIN = [("a.json", b"{}"), ("a.jpg", b"x" * 513), ("b.json", b"[]"), ("dir/c.txt", b""), ("a.json", b"1"),
          ("p" * 120 + "/d.json", b"long name, in the ustar prefix"), ("é.json", b"utf-8 name")]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT])
def test_plain_walk_equals_tarfile(tmp_path: Path, fmt: int) -> None:
    members = _PLAIN if fmt == tarfile.USTAR_FORMAT else [m for m in _PLAIN if len(m[0]) < 100]  # GNU: 'L' header
    path = _tar(tmp_path / "s.tar", members, fmt, dirs=("dir",))
    assert _plain_members(path) == _tar_members(path)
    assert len(_plain_members(path)) == len(members)
    layout = shard_layout(tmp_path, "s.tar", frozenset({"s.tar/b"}))
    assert layout.duplicates == {3} and layout.excluded == {1} and len(layout.starts) == len(members) - 1


def test_extended_headers_go_to_tarfile(tmp_path: Path) -> None:
    path = _tar(tmp_path / "s.tar", [("k" * 200 + ".json", b"{}"), ("b.json", b"{}")], tarfile.PAX_FORMAT)
    with pytest.raises(_Unusual):
        _plain_members(path)
    assert shard_layout(tmp_path, "s.tar").starts == (0, 2048)  # pax header + member, then b


@pytest.mark.parametrize("damage", ["checksum", "size", "truncated", "garbage-tail", "empty"])
def test_damaged_shards_walk_like_tarfile(tmp_path: Path, damage: str) -> None:
    path = _tar(tmp_path / "s.tar", [("a.json", b"{}"), ("b.json", b"x" * 700), ("c.json", b"{}")])
    data = bytearray(path.read_bytes())
    second = 1024  # header of b.json
    if damage == "checksum":
        data[second + 148: second + 156] = b"0000000\0"
    elif damage == "size":
        data[second + 124: second + 136] = b"99x99999999\0"
    elif damage == "truncated":
        data = data[: second + 600]
    elif damage == "garbage-tail":
        data[second + 2048:] = b"\x01" * (len(data) - second - 2048)
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    try:
        fast = _plain_members(path)
    except _Unusual:
        fast = None
    assert fast is None or fast == _tar_members(path)
    assert [n for n, _ in _tar_members(path)] == {"checksum": ["a.json"], "size": ["a.json"],
                                                   "truncated": ["a.json", "b.json"], "garbage-tail":
                                                   ["a.json", "b.json", "c.json"], "empty": []}[damage]
    assert len(shard_layout(tmp_path, "s.tar").starts) == len(_tar_members(path))
