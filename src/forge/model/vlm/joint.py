"""Joint decoder (LLaVA-style): the visual tokens are prepended to the text and the decoder runs over both."""

import torch

from forge.model.vlm.base import VisionLanguageModel, causal_key_mask


class JointDecoderVLM(VisionLanguageModel):
    """Visual tokens, then text, through the decoder's blocks; logits (and so the loss) on the text only."""

    def forward(
        self,
        tokens: torch.Tensor,
        pixels: torch.Tensor,
        frame_mask: torch.Tensor,
        frame_times: torch.Tensor | None = None,
    ) -> torch.Tensor:
        visual, valid = self.encode_media(pixels, frame_mask, frame_times)
        text = self.decoder.tok_embeddings(tokens)
        h = torch.cat([visual.to(text.dtype), text], dim=1)
        text_valid = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        mask = causal_key_mask(torch.cat([valid, text_valid], dim=1))
        cos, sin = self.rope(h.shape[1])
        for block in self.decoder.layers.values():
            h = block(h, cos, sin, mask)
        return self.head(h[:, visual.shape[1] :])
