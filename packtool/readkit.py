"""The reader kit: what every family's reader and the runtime's batches share, below both.

It imports only the format (:mod:`packtool.format`), the media decoders (:mod:`packtool.media`), the errors and a
batch's media part (:mod:`packtool.mediapart`), so a family's reader (``packtool.families.*.reader``) stands on it
and never on :mod:`packtool.runtime`, which stands on the families through its registry: the imports go one way,
runtime -> families -> this kit.

- :func:`vision_media`: the shared image/video fields of a reader batch, asked of a family's reader methods;
- :func:`decode_planned_videos`, :func:`check_video_grids`: a video's planned frames, its processed grid checked;
- :func:`open_stored_image`: a stored image decoded as its grid was computed;
- :func:`pad_frames`: audio features padded to a batch's longest clip;
- :class:`VisualInputs`: image and video tensors as Megatron-Bridge's VLM step takes them;
- :func:`layout_context`: the token ids and sizes a trainer layout needs beside the tensors, which every reader
  batch carries (``BATCH_CONTEXT``), and :func:`mm_token_type_ids`, :func:`text_positions` built from it;
- :func:`vision_fields`: Megatron-Bridge's shared Qwen-VL layout (``visual_inputs``);
- :class:`ReaderBatch`: the reader's batch, typed fields that read by key too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from packtool.errors import FormatError
from packtool.format import MediaRef, PackRecord
from packtool.mediapart import MediaPart

#: What :func:`layout_context` takes from a manifest (None where it has none).
CONTEXT_KEYS = ("image_token_id", "video_token_id", "spatial_merge_size")


def vision_media(reader: Any, record: PackRecord, image_processor, where: str, images: bool) -> dict:
    """The base layout (:attr:`packtool.families.reading.FamilyReader.batch_keys`) through a family's reader:
    image_grid_thw (+ pixel_values) for the pack's images and video_grid_thw, second_per_grid_ts (+
    pixel_values_videos) for its videos (where the family has a video processor)."""
    everything = record.media_refs
    for m in everything:
        if m.kind not in ("image", "video"):
            raise FormatError(f"{where}: media kind {m.kind!r} (member {m.member}) is not supported by the reader "
                              f"yet")
    out = reader.read_videos(record, where, images)
    if any(m.kind == "video" for m in everything) and not out:
        raise FormatError(f"{where}: the pack holds videos but the manifest describes no video processor")
    media = [m for m in everything if m.kind == "image"]
    stored = np.array([m.grid_thw for m in media], dtype=np.int64).reshape(-1, 3)
    out["image_grid_thw"] = torch.from_numpy(stored)
    if not images:
        return out
    proc = image_processor if image_processor is not None else reader.processor(None)
    if proc is None:
        if media:
            raise ValueError(f"{where} has media but no image processor: pass the model's image_processor= "
                             f"(dataset image rule: {reader.name}) or images=False")
        return out
    if not media:
        dim = reader.image_patch_dim(proc)  # a layout of patch rows: an empty [0, dim] beside no images
        if dim is not None:
            out["pixel_values"] = torch.zeros((0, dim), dtype=torch.float32)
        return out
    pil = reader.images([open_stored_image(record.media[m.member], f"{where}, member {m.member}")
                                for m in media])
    try:
        result = proc(images=pil, return_tensors="np")
    except (ValueError, TypeError, OSError) as exc:
        raise FormatError(f"{where}: the image processor refuses its media ({type(exc).__name__}: {exc})") from None
    if "image_grid_thw" in result:
        grid = np.asarray(result["image_grid_thw"], dtype=np.int64)
        if not np.array_equal(grid, stored):
            bad = next(i for i in range(len(media)) if not np.array_equal(grid[i], stored[i]))
            raise FormatError(f"{where}: {media[bad].member} processes to grid {grid[bad].tolist()}, "
                              f"stored {stored[bad].tolist()}")
    out["pixel_values"] = torch.from_numpy(np.ascontiguousarray(result["pixel_values"], dtype=np.float32))
    return out


def decode_planned_videos(record: PackRecord, videos: Sequence[MediaRef], where: str) -> tuple[list, list]:
    """The planned frames of each of ``videos`` (``(T, H, W, 3)`` arrays, only those frames decoded) and their
    transformers ``VideoMetadata``; :class:`FormatError` naming the member for a video that does not decode."""
    from transformers.video_utils import VideoMetadata

    from packtool.media import decode_frames, decode_video

    arrays, metadata = [], []
    for m in videos:
        try:
            if m.frames:
                arrays.append(decode_frames([record.media[f] for f in m.frames], m.frame_indices))
            else:
                arrays.append(decode_video(record.media[m.member], m.frame_indices))
        except (ValueError, OSError) as exc:
            raise FormatError(f"{where}, member {m.member}: video does not decode ({exc})") from None
        metadata.append(VideoMetadata(total_num_frames=m.total_frames, fps=m.fps, width=m.width, height=m.height,
                                      duration=m.duration, frames_indices=list(m.frame_indices)))
    return arrays, metadata


def check_video_grids(processed: torch.Tensor, stored: np.ndarray, videos: Sequence[MediaRef], where: str) -> None:
    """:class:`FormatError` naming the first video whose processed grid differs from the stored one."""
    grid = processed.numpy().astype(np.int64)
    if not np.array_equal(grid, stored):
        bad = next(i for i in range(len(videos)) if not np.array_equal(grid[i], stored[i]))
        raise FormatError(f"{where}: {videos[bad].member} processes to grid {grid[bad].tolist()}, "
                          f"stored {stored[bad].tolist()}")


def open_stored_image(data: bytes, where: str):
    """The decoded image (as stored: no EXIF rotation, the same pixels the grid was computed from)."""
    from PIL import Image

    from packtool.media.image import open_image

    try:
        image = open_image(data)
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise FormatError(f"{where}: media does not decode ({type(exc).__name__}: {exc})") from None
    return image


def pad_frames(features: torch.Tensor, width: int) -> torch.Tensor:
    """Audio features or their mask ``[clips, frames, ...]`` padded with zeros (False) to ``width`` frames, as the
    feature extractor pads the shorter clips of one call."""
    pad = features.new_zeros((features.shape[0], width - features.shape[1], *features.shape[2:]))
    return torch.cat([features, pad], dim=1)


@dataclass
class VisualInputs:
    """Image and video tensors of a batch, in the shape Megatron-Bridge's VLM step expects (the fields of its
    `GenericVisualInputs` that packtool fills): every attribute a tensor or None (the step moves them one by one),
    `normalized_for_model()` the model's keyword arguments."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None

    def normalized_for_model(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device) -> VisualInputs:
        return VisualInputs(**{f.name: None if getattr(self, f.name) is None
                               else getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


def vision_fields(batch: Mapping, temporal_patch_dim: int = 2) -> dict:
    """The shared Megatron-Bridge layout (Qwen-VL families): ``visual_inputs`` alone (the registered default,
    :class:`packtool.families.spec.TrainerLayouts`)."""
    return {"visual_inputs": vision_inputs(batch)}


def vision_inputs(batch: Mapping) -> VisualInputs | None:
    """The base layout's `visual_inputs`: Qwen-VL images and videos (each kind only when the batch has some);
    None without either."""
    fields_: dict[str, torch.Tensor] = {}
    if batch.get("pixel_values") is not None and len(batch["pixel_values"]):
        fields_.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    if batch.get("pixel_values_videos") is not None and len(batch["pixel_values_videos"]):
        fields_.update(pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"],
                       second_per_grid_ts=batch["second_per_grid_ts"])
    return VisualInputs(**fields_) if fields_ else None


def layout_context(manifest: Mapping) -> dict[str, int | None]:
    """The manifest's facts a trainer layout needs beside a batch's tensors: its image and video token ids and the
    image processor's merge size (None where the manifest has none). Every reader batch carries them, so a layout
    works on the batch alone."""
    processor = manifest.get("image_processor") if hasattr(manifest, "get") else None
    merge = processor.get("merge_size") if isinstance(processor, Mapping) else None
    return {"image_token_id": manifest.get("image_token_id"), "video_token_id": manifest.get("video_token_id"),
            "spatial_merge_size": None if merge is None else int(merge)}


def mm_token_type_ids(input_ids: torch.Tensor, context: Mapping) -> torch.Tensor:
    """transformers' Qwen-VL processors' ``mm_token_type_ids`` of ``input_ids`` (any shape): per token 0 text, 1 the
    image token, 2 the video token of ``context`` (:func:`layout_context`, or a manifest); int32."""
    kinds = torch.zeros_like(input_ids, dtype=torch.int32)
    if context.get("image_token_id") is not None:
        kinds += (input_ids == context["image_token_id"]).int()
    if context.get("video_token_id") is not None:
        kinds += 2 * (input_ids == context["video_token_id"]).int()
    return kinds


def text_positions(row: Mapping, context: Mapping, tokens_per_second: int | None) -> torch.Tensor:
    """The Hugging Face layout of text-only families: the row's per-segment positions as they are."""
    return row["position_ids"]


# -- the reader's batch -------------------------------------------------------------------------------------------
#: A reader batch's entry naming its loss mode (:data:`packtool.lossweights.LOSS_MODES`).
LOSS_MODE = "loss_mode"
#: A reader batch's entry saying whether every sample weight of its output is a whole number (the manifest's
#: ``loss_weights.whole``; True where no weight is given).
WHOLE_WEIGHTS = "whole_weights"


@dataclass(eq=False)
class ReaderBatch(MutableMapping[str, Any]):
    """One micro-batch of packtool's reader (one pack, or ``B`` packs stacked by ``collate_packs``): typed fields,
    read by attribute or, as every trainer layout and most training loops do, by key (``batch["tokens"]``; the
    keys are the field names, but ``keys`` for :attr:`segment_keys`). :attr:`media` is the family's typed media part
    (its reader's :class:`~packtool.mediapart.MediaPart`, ``FamilyReader.media_part``: ``batch.media.pixel_values``),
    whose entries read by key on the batch too (``batch["pixel_values"]``), with anything a caller adds; each
    trainer layout turns the batch into its trainer's dict at the edge (``hf_batch``, ``megatron_bridge_batch``);
    :meth:`to_dict` gives the plain dict. Shapes: ``[B, L]`` for the per-token fields (:data:`ROW_FIELDS`),
    boundaries ``[S + 1]`` int32 over the flattened rows."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    #: Each label position's weight under :attr:`loss_mode` (0 where the label is -100).
    loss_weights: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens_unpadded: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    padding_mask: torch.Tensor
    #: Each segment's source key (the batch's ``keys`` entry).
    segment_keys: list[str]
    #: The pack's key (a list of them for stacked rows).
    pack_key: str | list[str]
    #: float64 ``[B]``: each row's weights summed (a trainer adds them over the global batch to divide by).
    loss_weight_sum: torch.Tensor
    #: int64 ``[B]``: samples of each row.
    num_samples: torch.Tensor
    loss_mode: str
    whole_weights: bool
    #: The registered family whose trainer layouts the batch follows.
    family: str
    #: The manifest's media token ids and merge size (:func:`layout_context`).
    layout_context: dict[str, int | None]
    #: A mixture's: int64 ``[S]``, each segment's dataset as its place in the manifest's mixture (None: one dataset).
    dataset_index: torch.Tensor | None = None
    #: The family's media (``pixel_values``, ``image_grid_thw``, ...: its reader's typed part) and whatever a
    #: caller adds by key.
    media: MediaPart = field(default_factory=MediaPart)

    @classmethod
    def of(cls, entries: Mapping[str, Any], media_part: type[MediaPart] = MediaPart) -> ReaderBatch:
        """A batch from its entries by key (the fields' keys; every other entry goes to :attr:`media`, a
        ``media_part``: the family's part class, as a batch's ``type(batch.media)``)."""
        named = {_ATTR.get(k, k): v for k, v in entries.items() if _ATTR.get(k, k) in _FIELDS}
        return cls(**named, media=media_part.of({k: v for k, v in entries.items() if _ATTR.get(k, k) not in _FIELDS}))

    def to(self, device: Any) -> ReaderBatch:
        """The batch with every tensor on ``device`` (the rest as it is)."""
        return ReaderBatch.of({k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                               for k, v in self.items()}, type(self.media))

    def to_dict(self) -> dict[str, Any]:
        """The batch as a plain dict, key for key."""
        return dict(self.items())

    def __getitem__(self, key: str) -> Any:
        attr = _ATTR.get(key, key)
        if attr in _FIELDS:
            value = getattr(self, attr)
            if value is None and attr in _OPTIONAL:
                raise KeyError(key)
            return value
        return self.media[key]

    def __setitem__(self, key: str, value: Any) -> None:
        attr = _ATTR.get(key, key)
        if attr in _FIELDS:
            setattr(self, attr, value)
        else:
            self.media[key] = value

    def __delitem__(self, key: str) -> None:
        attr = _ATTR.get(key, key)
        if attr in _OPTIONAL and getattr(self, attr) is not None:
            setattr(self, attr, None)
        elif attr in _FIELDS:
            raise KeyError(f"{key!r} is an entry every reader batch has" if attr not in _OPTIONAL else key)
        else:
            del self.media[key]

    def __iter__(self) -> Iterator[str]:
        for attr in _FIELDS:
            if not (attr in _OPTIONAL and getattr(self, attr) is None):
                yield _KEY.get(attr, attr)
        yield from self.media

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"ReaderBatch({', '.join(self)})"


#: The field names of a reader batch (its entries but the media), and the two spelled otherwise as keys.
_FIELDS = tuple(f.name for f in fields(ReaderBatch) if f.name != "media")
_KEY = {"segment_keys": "keys"}
_ATTR = {v: k for k, v in _KEY.items()}
_OPTIONAL = frozenset({"dataset_index"})
#: Per-token fields, ``[B, L]``.
ROW_FIELDS = ("tokens", "labels", "loss_mask", "loss_weights", "position_ids", "padding_mask")
