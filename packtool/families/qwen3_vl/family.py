"""The Qwen3-VL family: detection, settings, plans, manifest entries and the reader's hooks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packtool.errors import ConfigError
from packtool.families.base import ExpandsInText, ItemPlan, MediaTokens, knows_exactly, manifest_tokens
from packtool.families.conventions import Convention
from packtool.families.qwen2_vl.family import QWEN2_VL_IMAGE_PROCESSORS, ImageRule, _image_rule, _json_file
from packtool.families.qwen3_vl.rule import Qwen3VLVideoRule
from packtool.media.folder import read_folder
from packtool.media.video import VideoFacts

if TYPE_CHECKING:
    from packtool.settings import EncodeSettings

#: ``processor_class`` of a Qwen3-VL folder.
QWEN3_VL_PROCESSORS = frozenset({"Qwen3VLProcessor"})
#: ``video_processor_type`` of a Qwen3-VL folder.
QWEN3_VL_VIDEO_PROCESSORS = frozenset({"Qwen3VLVideoProcessor"})
#: ``model_type`` of a Qwen3-VL folder's ``config.json``.
QWEN3_VL_MODEL_TYPES = frozenset({"qwen3_vl", "qwen3_vl_moe"})
#: Every name a Qwen3-VL folder states, checked exactly (its image processor is Qwen2-VL's).
QWEN3_VL_NAMES: dict[str, frozenset[str]] = {
    "processor class": QWEN3_VL_PROCESSORS, "video processor": QWEN3_VL_VIDEO_PROCESSORS,
    "model type": QWEN3_VL_MODEL_TYPES, "image processor": QWEN2_VL_IMAGE_PROCESSORS,
}


def is_qwen3_vl(folder: Path) -> bool:
    """Whether a model folder names Qwen3-VL: its processor class (wherever the folder states it), its video
    processor or its model type."""
    configs = read_folder(folder)
    for entry in (configs.processor, configs.image, configs.video, _json_file(folder / "tokenizer_config.json")):
        if entry.get("processor_class") in QWEN3_VL_PROCESSORS:
            return True
    if configs.video.get("video_processor_type") in QWEN3_VL_VIDEO_PROCESSORS:
        return True
    return _json_file(folder / "config.json").get("model_type") in QWEN3_VL_MODEL_TYPES


class Qwen3VL(ExpandsInText):
    """Qwen3-VL: images and videos by their exact rules, each expansion written into the text as transformers'
    ``Qwen3VLProcessor`` writes it (a video's ``<t seconds>`` labels are text the tokenizer reads in context)."""

    name = "qwen3_vl"
    kinds = ("image", "video")
    #: Settings of other families' rules: an error with a Qwen3-VL folder.
    FOREIGN_SETTINGS = ("image_tokens", "video_keep_frames")

    def __init__(self, tokens: MediaTokens, convention: Convention, folder: str, image: ImageRule,
                 video: Qwen3VLVideoRule | None, video_config: dict | None = None) -> None:
        super().__init__(tokens, convention, folder)
        self.image = image
        self.video = video
        self.video_config = video_config

    @classmethod
    def detect(cls, folder: Path, settings: EncodeSettings) -> bool:
        """A folder that names Qwen3-VL with every name this rule knows (:data:`QWEN3_VL_NAMES`); one that names it
        with another is a :class:`ConfigError` naming the processor mode (nothing in that mode)."""
        return is_qwen3_vl(folder) and knows_exactly(folder, settings, QWEN3_VL_NAMES, "Qwen3-VL")

    @classmethod
    def load(cls, settings: EncodeSettings, tok: Any, convention: Convention) -> Qwen3VL:
        st = settings
        given = [n for n in cls.FOREIGN_SETTINGS if getattr(st, n, None) is not None]
        if st.image_resize != "processor":
            given.append("image_resize")
        if given:
            raise ConfigError(f"{st.tokenizer}: {', '.join(given)} do not apply to a Qwen3-VL model folder")
        configs = read_folder(st.tokenizer)
        kind = configs.image.get("image_processor_type")
        if kind is not None and kind not in QWEN2_VL_IMAGE_PROCESSORS:
            raise ConfigError(f"{st.tokenizer}: image processor {kind!r} is not the one Qwen3-VL ships (Qwen2-VL's), "
                              f"so packtool has no exact rule for its images; use --media-tokens processor")
        vocab = tok.get_vocab()
        missing = [t for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
                   if t not in vocab]
        if missing:
            raise ConfigError(f"{st.tokenizer}: the tokenizer lacks the Qwen3-VL media tokens {missing}")
        tokens = MediaTokens.from_vocab(vocab)
        try:
            image = _image_rule(configs.image, st.min_pixels, st.max_pixels)
            video = Qwen3VLVideoRule.from_config(
                configs.video, fps=st.video_fps, num_frames=st.video_frames, min_frames=st.video_min_frames,
                max_frames=st.video_max_frames, min_pixels=st.video_min_pixels, max_pixels=st.video_max_pixels)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{st.tokenizer}: unreadable Qwen3-VL processor settings ({exc})") from None
        return cls(tokens, convention, str(st.tokenizer), image, video, dict(configs.video))

    @classmethod
    def owns(cls, manifest: Mapping) -> bool:
        entry = manifest.get("image_processor")
        return isinstance(entry, Mapping) and entry.get("family") == cls.name

    @classmethod
    def from_manifest(cls, manifest: Mapping, convention: Convention) -> Qwen3VL:
        video = manifest.get("video_processor")
        return cls(manifest_tokens(manifest), convention, "", ImageRule.from_manifest(manifest["image_processor"]),
                   None if video is None else Qwen3VLVideoRule.from_manifest(video),
                   None if video is None else video.get("config"))

    # -- plans ------------------------------------------------------------------------------------------------
    def plan_image(self, width: int, height: int, n_images: int) -> ItemPlan:
        tokens = self.image.tokens(width, height)
        return ItemPlan(tokens, self.image.grid(width, height), text="<|image_pad|>" * tokens)

    def plan_video(self, facts: VideoFacts, part: str) -> ItemPlan:
        if self.video is None:
            return super().plan_video(facts, part)
        plan = self.video.video(facts)
        return ItemPlan(plan.tokens, plan.grid_thw, plan.indices, None,
                        text=self.video.text(plan, "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))

    def placeholders(self) -> dict[str, tuple[str, str]]:
        return {"image": ("<|image_pad|>", "<|image_pad|>"), "video": ("<|video_pad|>", "<|video_pad|>")}

    def processor_kwargs(self, facts: VideoFacts) -> dict:
        """Video keyword arguments that make the processor see a video's frames as this rule does: the planned
        frames as they are, with their metadata."""
        if self.video is None:
            raise ValueError("the model folder has no video settings")
        plan = self.video.video(facts)
        return {"do_sample_frames": False, "video_metadata": {**facts.metadata(), "frames_indices": list(plan.indices)}}

    # -- the manifest ---------------------------------------------------------------------------------------------
    def manifest_entries(self) -> dict[str, Any]:
        t = self.tokens
        return {"image_token_id": t.image_token_id, "vision_start_token_id": t.vision_start_id,
                "vision_end_token_id": t.vision_end_id,
                "image_processor": {**self.image.manifest(), "family": self.name},
                "video_token_id": t.video_token_id if self.video else None,
                "video_processor": {**self.video.manifest(), "config": self.video_config} if self.video else None,
                "audio_token_id": None, "audio_start_token_id": None, "audio_end_token_id": None}
