"""Media: facts read from media bytes (:mod:`.image`, :mod:`.video`, :mod:`.audio`), the settings a model folder
gives its processors (:mod:`.folder`), and the token rules of each model family (:mod:`.qwen2_vl`,
:mod:`.nemotron_omni`)."""

from packtool.media.audio import AUDIO_EXTENSIONS, AudioFacts, decode_audio, probe_audio, resampled_length
from packtool.media.folder import FolderConfigs, read_folder
from packtool.media.image import IMAGE_EXTENSIONS, image_size
from packtool.media.nemotron_omni import (
    NemotronOmniSettings,
    NemotronVideoPlan,
    expand_placeholders,
    is_nemotron_omni,
)
from packtool.media.qwen2_vl import (
    ImageRule,
    Qwen2VLSettings,
    QwenVideoPlan,
    load_image_rule,
    qwen_resize,
)
from packtool.media.video import (
    VIDEO_EXTENSIONS,
    VideoFacts,
    decode_frames,
    decode_video,
    probe_frames,
    probe_video,
)

__all__ = [
    "AUDIO_EXTENSIONS",
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "AudioFacts",
    "FolderConfigs",
    "ImageRule",
    "NemotronOmniSettings",
    "NemotronVideoPlan",
    "Qwen2VLSettings",
    "QwenVideoPlan",
    "VideoFacts",
    "decode_audio",
    "decode_frames",
    "decode_video",
    "expand_placeholders",
    "image_size",
    "is_nemotron_omni",
    "load_image_rule",
    "probe_audio",
    "probe_frames",
    "probe_video",
    "qwen_resize",
    "read_folder",
    "resampled_length",
]
