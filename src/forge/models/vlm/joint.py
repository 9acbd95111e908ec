"""Joint decoder (LLaVA-style): the visual tokens are prepended to the text and the decoder runs over both."""

import torch

from forge.models.vlm.base import PrefixVLM


class JointDecoderVLM(PrefixVLM):
    """Visual tokens, then text, through the decoder's blocks; logits (and so the loss) on the text only."""

    def run_block(self, key: str, block, h, n_visual: int, valid, cos, sin, mask, cache=None) -> torch.Tensor:
        return block(h, cos, sin, mask, cache)
