"""Vision-language models: a vision tower, a connector and the text decoder, combined by one of four strategies."""

from forge.models.vlm.base import VisionLanguageModel
from forge.models.vlm.cross_attention import CrossAttentionVLM
from forge.models.vlm.joint import JointDecoderVLM
from forge.models.vlm.moma import MoMaVLM
from forge.models.vlm.mot import MoTVLM

__all__ = ["CrossAttentionVLM", "JointDecoderVLM", "MoMaVLM", "MoTVLM", "VisionLanguageModel"]
