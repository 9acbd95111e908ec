"""Vision-language models: a vision tower, a connector and the text decoder, combined by one of four strategies."""

from forge.model.vlm.base import VisionLanguageModel
from forge.model.vlm.cross_attention import CrossAttentionVLM
from forge.model.vlm.joint import JointDecoderVLM
from forge.model.vlm.moma import MoMaVLM
from forge.model.vlm.mot import MoTVLM

__all__ = ["CrossAttentionVLM", "JointDecoderVLM", "MoMaVLM", "MoTVLM", "VisionLanguageModel"]
