"""The trainer of vision-language models (`vlm=...`): the text trainer with a VLM, its media corpus, its freeze
schedule (forge.train.freeze) and the VLM step body (forge.train.steps.vlm)."""

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from forge.models.vlm.parallelize import parallelize_vlm
from forge.parallel import dist
from forge.parallel.init import materialize_sharded
from forge.parallel.plan import mixed_precision_policy
from forge.train import build
from forge.train.freeze import FreezeSchedule
from forge.train.steps import VLMStep
from forge.train.trainer import Trainer


def build_meta_vlm(cfg: DictConfig):
    """The strategy's model on the meta device (shapes only, nothing allocated), but for the vision tower, which
    is loaded with its pretrained weights."""
    with torch.device("meta"):
        return instantiate(cfg.vlm, _partial_=True)(text=build.model_args(cfg))


def build_vlm(cfg: DictConfig, seed: int):
    """The strategy's model whole on the CPU, everything but the tower initialised from `seed` (the weights every
    layout of training starts from)."""
    model = build_meta_vlm(cfg)
    materialize_sharded(model, model, seed, torch.device("cpu"))
    return model


class VLMTrainer(Trainer):
    """Trainer for `vlm=joint_decoder|cross_attention|mot|moma` on image or video data."""

    def build_model_and_data(self) -> None:
        cfg = self.cfg
        self.pipeline = None
        with dist.local_rank_zero_first():  # the first rank writes the embedded encoder and tokenizer caches
            self.model = build_meta_vlm(cfg)
            from transformers import AutoImageProcessor

            processor = AutoImageProcessor.from_pretrained(self.model.encoder_path)
            self.corpus = instantiate(cfg.data, image_processor=processor, _convert_="all")
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.model.encoder.to(self.device)
        self.freeze = FreezeSchedule(self.model)
        parallel = self.settings.parallel
        policy = mixed_precision_policy(parallel, self.dtype)
        parallelize_vlm(self.model, self.mesh, parallel.activation_checkpoint, policy)
        # Each rank allocates and fills only its shards: no rank holds the whole decoder.
        materialize_sharded(self.model, self.model, self.settings.train.seed, self.device)
        self.step_body = VLMStep(
            self.model,
            self.device,
            self.dtype,
            self.mesh,
            self.defer_grad_sync,
            hold_weight_casts=self.holds_weight_casts,
            compute_weights=self.build_compute_weights(),
        )
