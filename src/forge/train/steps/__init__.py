"""Step bodies: one optimizer step's forward and backward, and an evaluation, for each kind of run (text, VLM,
pipeline stages), all with the shape of `Step`."""

from forge.train.steps.pipeline import PipelineStep
from forge.train.steps.step import Step, token_mean
from forge.train.steps.text import TextStep
from forge.train.steps.vlm import VLMStep

__all__ = ["PipelineStep", "Step", "TextStep", "VLMStep", "token_mean"]
