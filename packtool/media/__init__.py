"""Media: facts read from media bytes (:mod:`.image`) and the token rules of each model family
(:mod:`.qwen2_vl`)."""

from packtool.media.image import IMAGE_EXTENSIONS, image_size
from packtool.media.qwen2_vl import ImageRule, load_image_rule, qwen_resize

__all__ = ["IMAGE_EXTENSIONS", "ImageRule", "image_size", "load_image_rule", "qwen_resize"]
