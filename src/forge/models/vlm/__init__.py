"""Vision-language models: a vision tower, a connector and the text decoder, combined by one of four strategies.

The folder holds the strategies' modules, their arguments (`args`, the vlm group's schema) and their parallel plan
(`parallelize`); their rules span groups (data, parallel, model) and live in forge.config.validate. The arguments
import without torch; the modules on first use."""

from forge.lazy import lazy_exports

__all__ = ["CrossAttentionVLM", "JointDecoderVLM", "MoMaVLM", "MoTVLM", "VisionLanguageModel"]

__getattr__ = lazy_exports(
    __name__,
    {
        "VisionLanguageModel": "forge.models.vlm.base",
        "CrossAttentionVLM": "forge.models.vlm.cross_attention",
        "JointDecoderVLM": "forge.models.vlm.joint",
        "MoMaVLM": "forge.models.vlm.moma",
        "MoTVLM": "forge.models.vlm.mot",
    },
)
