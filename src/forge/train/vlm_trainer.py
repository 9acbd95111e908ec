"""The training loop for vision-language models (`vlm=...`): the text trainer with a VLM model, media batches,
and the freeze schedule applied before every step (its state is saved with the model and checked on resume)."""

import logging

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

import forge.config  # noqa: F401  (first: forge.parallel.degrees and forge.config import each other)
from forge.parallel import dist
from forge.parallel.mesh import sum_over_dp
from forge.parallel.vlm import parallelize_vlm
from forge.train import build
from forge.train.precision import autocast
from forge.train.trainer import Trainer, cross_entropy

log = logging.getLogger("forge")


def build_vlm(cfg: DictConfig, seed: int):
    """The strategy's model on the CPU: decoder and connector seeded from `seed`, the vision tower as loaded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = instantiate(cfg.vlm, _partial_=True)(text=build.model_args(cfg))
        model.init_weights()
    return model


def media_to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def fill_empty_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter Adam's initial state (step 0, zero moments) now, as Adam would lazily on its first
    step. Parameters the freeze schedule trains later then have a state in every checkpoint, so a checkpoint
    written before they start training loads into a fresh optimizer (DCP needs the same keys on both sides)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


class VLMTrainer(Trainer):
    """Trainer for `vlm=joint_decoder|cross_attention|mot|moma` on image or video data."""

    def build_model_and_data(self) -> None:
        cfg = self.cfg
        self.pipeline = None
        with dist.local_rank_zero_first():  # the first rank writes the embedded encoder and tokenizer caches
            self.model = build_vlm(cfg, cfg.train.seed)
            from transformers import AutoImageProcessor

            processor = AutoImageProcessor.from_pretrained(self.model.encoder_path)
            self.corpus = instantiate(cfg.data, image_processor=processor, _convert_="all")
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.model.to(self.device)
        # Everything the schedule ever trains goes into the optimizer; set_step then freezes what waits.
        for param in self.model.parameters():
            param.requires_grad_(True)
        if self.model.train_encoder_from_step is None:
            for param in self.model.encoder.parameters():
                param.requires_grad_(False)
        parallelize_vlm(self.model, self.mesh, cfg.parallel.activation_checkpoint)

    def restore(self):
        fill_empty_adam_state(self.optimizer)
        state = super().restore()
        if state.step:
            self.model.check_freeze_state(state.step)
        return state

    def train_step(self):
        if self.model.set_step(self.state.step):
            enc, dec = self.model.schedule_at(self.state.step)
            log.info(
                "step %d: vision tower %s, decoder %s",
                self.state.step + 1,
                "trained" if enc else "frozen",
                "trained" if dec else "frozen",
            )
        return super().train_step()

    def batch_loss(self, batch: dict) -> torch.Tensor:
        batch = media_to_device(batch, self.device)
        with autocast(self.device, self.dtype):
            logits = self.model(batch["tokens"], batch["pixels"], batch["frame_mask"], batch["frame_times"])
        return cross_entropy(logits, batch["labels"])

    @torch.no_grad()
    def evaluate(self) -> float:
        train = self.cfg.train
        was_training = self.model.training
        self.model.eval()
        total, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for batch in self.corpus.eval_batches(
            train.seq_len, train.micro_batch_size, self.eval_micro_batches, self.dp_rank, self.dp_size
        ):
            count = self.labelled_tokens(batch).to(self.device)
            total += self.batch_loss(batch) * count
            tokens += count
        self.model.train(was_training)
        return (sum_over_dp(total, self.mesh) / sum_over_dp(tokens, self.mesh).clamp(min=1)).item()

    def labelled_tokens(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != -100).sum()
