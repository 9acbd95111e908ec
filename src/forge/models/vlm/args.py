"""The arguments of the vision-language strategies (the conf/vlm group's schema): the vision tower, the connector,
the freeze schedule and each strategy's own fields. The text decoder's come from the `model` group. Imports without
torch: the config schemas extend these."""

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING

from forge.domain import domain


class Connector(StrEnum):
    """VLMConfig.connector's choices (forge.models.vlm.connector builds them)."""

    linear = "linear"
    mlp = "mlp"
    avgpool = "avgpool"
    attnpool = "attnpool"


@dataclass
class VLMConfig:
    """A vision-language strategy around the text decoder (conf/vlm): joint_decoder, cross_attention, mot, moma."""

    _target_: str = domain(MISSING, non_empty=True)
    encoder_path: Optional[str] = domain(None, non_empty=True)
    """Folder of a transformers vision tower (CLIPVisionModel, SiglipVisionModel, any from_pretrained folder with
    an image processor); None builds a small random encoder of encoder_kind under cache_dir (no hub)."""
    encoder_kind: str = domain("clip", allowed=("clip", "siglip"))
    """clip or siglip: the small local encoder built when encoder_path is None."""
    cache_dir: str = domain("${oc.env:FORGE_CACHE_DIR,${oc.env:HOME}/.cache/forge}", non_empty=True)
    """Where the small local encoder is written."""
    connector: Connector = Connector.mlp
    """Vision-to-text connector: linear, mlp (2 layers), avgpool or attnpool (the last two reduce tokens)."""
    connector_tokens: Optional[int] = domain(None, ge=1)
    """Tokens per image (frame) after avgpool or attnpool."""
    train_encoder_from_step: Optional[int] = domain(None, ge=0, means="null: frozen for the whole run")
    """The vision tower is frozen until this step (None: frozen for the whole run; 0: trained from the start)."""
    train_decoder_from_step: int = domain(0, ge=0)
    """The text decoder is frozen until this step (e.g. 100: first train only the connector and new layers)."""
    time_embedding: bool = False
    """Add a sinusoidal embedding of each frame's time (seconds from the clip start) to its visual tokens."""


@dataclass
class CrossAttentionVLMConfig(VLMConfig):
    """Text-only residual stream plus zero-gated cross-attention blocks reading the visual tokens."""

    cross_attention_every: int = domain(2, ge=1)
    """A cross-attention block after every k-th decoder block."""


@dataclass
class MoMaVLMConfig(VLMConfig):
    """Modality-aware experts with expert-choice routing inside each modality."""

    text_experts: int = domain(2, ge=1)
    """Experts of the text group (the first is the decoder block's own FFN)."""
    image_experts: int = domain(2, ge=1)
    """Experts of the image group."""
    capacity_factor: float = domain(1.0, gt=0)
    """Each expert takes capacity_factor x tokens / experts tokens of a sequence."""


POOLING_CONNECTORS = (Connector.avgpool, Connector.attnpool)
"""Connectors that reduce an image's tokens to vlm.connector_tokens."""
