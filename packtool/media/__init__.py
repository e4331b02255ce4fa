"""Media: facts read from media bytes (:mod:`.image`, :mod:`.video`, :mod:`.audio`) and the settings a model folder
gives its processors (:mod:`.folder`), shared by every side; each model family's token rules are in
:mod:`packtool.families`."""

from packtool.media.audio import AUDIO_EXTENSIONS, AudioFacts, decode_audio, probe_audio, resampled_length
from packtool.media.folder import FolderConfigs, read_folder
from packtool.media.image import IMAGE_EXTENSIONS, image_size
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
    "VideoFacts",
    "decode_audio",
    "decode_frames",
    "decode_video",
    "image_size",
    "probe_audio",
    "probe_frames",
    "probe_video",
    "read_folder",
    "resampled_length",
]
