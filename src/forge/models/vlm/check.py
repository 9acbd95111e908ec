"""The vision-language strategies' rules between their fields and the other groups (forge.config.validate calls
`check` when `vlm` is set). Imports without torch: validation refuses a config before the model is built."""

from omegaconf import DictConfig

from forge.config.degrees import Degrees
from forge.config.errors import require
from forge.config.resolve import composed_from
from forge.config.schema import VLMDataConfig
from forge.models.spec import PARALLEL_DIMS
from forge.models.vlm.args import POOLING_CONNECTORS


def check(cfg: DictConfig, degrees: Degrees) -> None:
    """A VLM needs image/video data; it runs data-parallel (FSDP) only, eager, in bf16 or fp32, on a grouped-query
    attention decoder; a pooling connector needs its token count."""
    vlm = cfg.vlm
    require(
        composed_from(cfg.data, VLMDataConfig),
        "vlm is set but the data has no images: use data=vqa_embedded, video_embedded or image_text",
    )
    for name in PARALLEL_DIMS:
        value = getattr(degrees, name)
        require(value == 1, f"parallel.{name}={value} is not supported with a VLM (data parallelism and FSDP only)")
    for key in ("compile", "fp8"):
        require(not cfg.parallel[key], f"parallel.{key}=true is not supported with a VLM yet")
    require(
        cfg.model.get("attention_kind", "gqa") == "gqa",
        "model.attention_kind=mla is not supported with a VLM (its decoders build grouped-query attention)",
    )
    if vlm.connector in POOLING_CONNECTORS:
        require(vlm.connector_tokens is not None, f"vlm.connector={vlm.connector} needs vlm.connector_tokens >= 1")
    require(
        cfg.data.max_frames >= cfg.data.min_frames,
        f"data.max_frames={cfg.data.max_frames} >= data.min_frames={cfg.data.min_frames} >= 1 must hold",
    )
