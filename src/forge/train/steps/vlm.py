"""The step body of a vision-language model: TextStep on media batches (dicts of tokens, pixels, frame_mask,
frame_times and labels), the VLM called through MediaModel so that every conf/loss applies to it as to text."""

import torch
from torch import nn

from forge.data import Batch
from forge.data.loader import to_device
from forge.train.losses import Loss
from forge.train.precision import autocast
from forge.train.steps.text import TextStep


class MediaModel:
    """A VLM as the losses call a model: `model(media, head=...)` -> logits (or, without the head, the final-norm
    hidden states) of the text positions, and the head itself at `output` (for chunked cross-entropy)."""

    def __init__(self, vlm: nn.Module):
        self.vlm = vlm

    @property
    def output(self) -> nn.Linear:
        return self.vlm.decoder.output

    def __call__(self, media: dict, attn_mask: None = None, head: bool = True) -> torch.Tensor:
        """`attn_mask` is always None: a VLM builds its masks from the media's frame_mask."""
        return self.vlm(media["tokens"], media["pixels"], media["frame_mask"], media["frame_times"], head=head)


class VLMStep(TextStep):
    """TextStep of a VisionLanguageModel on media batches."""

    def labels(self, batch: Batch) -> torch.Tensor:
        return batch["labels"]

    def batch_loss(self, batch: Batch, loss: Loss) -> torch.Tensor:
        media = {key: to_device(value, self.device) for key, value in batch.items()}
        with autocast(self.device, self.dtype):
            return loss(MediaModel(self.model), media, media["labels"])
