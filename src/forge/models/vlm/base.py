"""The parts every vision-language strategy shares: vision tower, connector, text decoder, media masks, and the
freeze schedule.

A batch's media are frames: pixels (batch, frames, channels, height, width) with frame_mask (batch, frames), True
for real frames (an image is one frame; padded video frames are False), and frame_times (batch, frames) in seconds.
Each frame becomes `connector` tokens; tokens of padded frames are zeroed and never attended to.
"""

import contextlib
import math
from pathlib import Path

import torch
from torch import nn

from forge.models.common.init_spec import InitSpec, prefixed
from forge.models.common.kv_cache import KVCache
from forge.models.llama.args import TransformerArgs
from forge.models.llama.transformer import Transformer
from forge.models.vlm.connector import build_connector, connector_init_specs
from forge.models.vlm.encoder import VisionTower, build_tiny_encoder, load_vision_tower


def time_embedding(times: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of frame times in seconds: (...,) -> (..., dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=times.device, dtype=torch.float32) / half)
    angles = times.float()[..., None] * freqs * 10.0
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return torch.nn.functional.pad(emb, (0, dim - 2 * half))


def causal_key_mask(key_valid: torch.Tensor, queries: int | None = None) -> torch.Tensor:
    """(batch, keys) valid keys -> (batch, 1, queries, keys) causal attention mask of the last `queries` positions
    (all of them by default); every position sees itself, so a padded position's row is never empty (its output is
    discarded)."""
    keys = key_valid.shape[1]
    queries = keys if queries is None else queries
    key_pos = torch.arange(keys, device=key_valid.device)
    query_pos = torch.arange(keys - queries, keys, device=key_valid.device)
    causal = key_pos[None, :] <= query_pos[:, None]
    itself = key_pos[None, :] == query_pos[:, None]
    return ((causal[None] & key_valid[:, None, :]) | itself[None])[:, None]


class VLMCache(KVCache):
    """A KV cache for generation with a VLM, plus what the later steps need from the prefill: which cached keys
    are real (padded frames' visual tokens are not), and the visual tokens themselves (for cross-attention)."""

    def __init__(self):
        super().__init__()
        self.key_valid: torch.Tensor | None = None
        self.visual: torch.Tensor | None = None
        self.visual_valid: torch.Tensor | None = None

    def extend_keys(self, new: int) -> torch.Tensor:
        """Mark `new` text positions as valid keys; return the (batch, 1, new, keys) mask of those positions."""
        assert self.key_valid is not None, "prefill first"
        ones = torch.ones(self.key_valid.shape[0], new, dtype=torch.bool, device=self.key_valid.device)
        self.key_valid = torch.cat([self.key_valid, ones], dim=1)
        return causal_key_mask(self.key_valid, new)


class VisionLanguageModel(nn.Module):
    """Base of the strategies: subclasses define `forward(tokens, pixels, frame_mask, frame_times) -> logits` over
    the text positions (with `head=False`, the final-norm hidden states: a chunked loss applies the head) and may
    add parameters in `__init__` and their initialisation in `extra_init_specs`.

    Every strategy runs its layers through a method `run_block(key, block, h, ...)`, which the parallel plan wraps
    for activation checkpointing. Strategies with `supports_kv_cache` also define `prefill` (forward that fills a
    VLMCache) and `decode` (logits of new text tokens from the cache alone), so generation feeds only the new token
    at each step.
    """

    supports_kv_cache = True

    def __init__(
        self,
        text: TransformerArgs,
        *,
        encoder_path: str | None,
        encoder_kind: str,
        cache_dir: str,
        connector: str,
        connector_tokens: int | None,
        train_encoder_from_step: int | None,
        train_decoder_from_step: int,
        time_embedding: bool,
        **strategy_options,
    ):
        super().__init__()
        if strategy_options:
            raise TypeError(f"{type(self).__name__} takes no option(s) {', '.join(sorted(strategy_options))}")
        # The tower is pretrained: it is loaded with its weights even when the rest is built on the meta device.
        on_meta = torch.get_default_device().type == "meta"
        with torch.device("cpu") if on_meta else contextlib.nullcontext():
            if encoder_path is None:
                encoder_path = str(build_tiny_encoder(Path(cache_dir).expanduser() / "vlm" / f"{encoder_kind}-tiny"))
            self.encoder = VisionTower(load_vision_tower(encoder_path))
        self.encoder_path = encoder_path
        self.text_args = text
        self.decoder = Transformer(text)
        self.connector = build_connector(connector, self.encoder.width, text.dim, connector_tokens)
        self.use_time_embedding = time_embedding
        self.train_encoder_from_step = train_encoder_from_step
        self.train_decoder_from_step = train_decoder_from_step
        # The freeze state travels in the checkpoint (checked on resume against the schedule).
        self.register_buffer("encoder_trainable", torch.zeros((), dtype=torch.bool))
        self.register_buffer("decoder_trainable", torch.ones((), dtype=torch.bool))
        self.apply_freeze(*self.schedule_at(0))

    # -- initialisation and freezing --------------------------------------------------------------------------

    def init_specs(self) -> dict[str, InitSpec]:
        """How each parameter (and initialised buffer) outside the pretrained vision tower starts, by plain name:
        the decoder's, the connector's and the strategy's own. Each value is then a function of (seed, name, row
        block) (forge.models.common.init_spec), so one process and every FSDP shard start from the same weights, and a
        rank built on the meta device fills only its shards (forge.parallel.init.materialize_sharded)."""
        return (
            prefixed("decoder", self.decoder.init_specs())
            | prefixed("connector", connector_init_specs(self.connector))
            | self.extra_init_specs()
        )

    def extra_init_specs(self) -> dict[str, InitSpec]:
        """The strategy's own parameters' specs (none here)."""
        return {}

    def tie_weights(self) -> bool:
        """Tie the decoder's head to its embedding (after anything that re-creates parameters); see Transformer."""
        return self.decoder.tie_weights()

    def init_buffers(self) -> None:
        """The decoder's rotary tables and the freeze state at step 0."""
        self.decoder.init_buffers()
        self.record_freeze(*self.schedule_at(0))

    def fsdp_units(self) -> list[nn.Module]:
        """Modules to shard as FSDP units (their forward is called directly): blocks and the connector."""
        return [*self.decoder.layers.values(), self.connector]

    def decoder_parameters(self) -> list[nn.Parameter]:
        """Parameters of the text model that the decoder freeze applies to (strategies may add theirs)."""
        return list(self.decoder.parameters())

    def schedule_at(self, step: int) -> tuple[bool, bool]:
        """(encoder trainable, decoder trainable) for the optimizer step after `step` steps."""
        enc = self.train_encoder_from_step is not None and step >= self.train_encoder_from_step
        return enc, step >= self.train_decoder_from_step

    def set_step(self, step: int) -> bool:
        """Apply the freeze schedule for training step `step` + 1; True when something changed."""
        enc, dec = self.schedule_at(step)
        changed = bool(self.encoder_trainable) != enc or bool(self.decoder_trainable) != dec
        self.apply_freeze(enc, dec)
        return changed

    def apply_freeze(self, enc: bool, dec: bool) -> None:
        """Make the tower (`enc`) and the decoder (`dec`) trainable or frozen, and record it in the buffers."""
        for p in self.encoder.parameters():
            p.requires_grad_(enc)
        for p in self.decoder_parameters():
            p.requires_grad_(dec)
        self.record_freeze(enc, dec)
        self.encoder.train(self.training and enc)

    def record_freeze(self, enc: bool, dec: bool) -> None:
        """The freeze state in the buffers that travel in the checkpoint."""
        self.encoder_trainable.fill_(enc)
        self.decoder_trainable.fill_(dec)

    def check_freeze_state(self, step: int) -> None:
        """After a resume: the saved freeze state must be the schedule's at `step` (else the config changed)."""
        expected = self.schedule_at(max(step - 1, 0)) if step else self.schedule_at(0)
        saved = (bool(self.encoder_trainable), bool(self.decoder_trainable))
        if saved != expected:
            raise ValueError(
                f"the checkpoint at step {step} has (encoder, decoder) trainable = {saved}, but this config's "
                f"schedule (vlm.train_encoder_from_step={self.train_encoder_from_step}, "
                f"vlm.train_decoder_from_step={self.train_decoder_from_step}) gives {expected}"
            )

    def train(self, mode: bool = True):
        super().train(mode)
        self.encoder.train(mode and bool(self.encoder_trainable))  # a frozen tower stays in eval mode
        return self

    # -- shared forward pieces --------------------------------------------------------------------------------

    def encode_media(
        self, pixels: torch.Tensor, frame_mask: torch.Tensor, frame_times: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Visual tokens (batch, frames * n, dim), zero on padded frames, and their validity (batch, frames * n)."""
        batch, frames = pixels.shape[:2]
        flat = pixels.flatten(0, 1)
        if bool(self.encoder_trainable):
            features = self.encoder(flat)
        else:
            with torch.no_grad():
                features = self.encoder(flat)
        tokens = self.connector(features)
        per_frame = tokens.shape[1]
        if self.use_time_embedding and frame_times is not None:
            tokens = tokens + time_embedding(frame_times.flatten(), tokens.shape[-1])[:, None].to(tokens.dtype)
        tokens = tokens.view(batch, frames * per_frame, -1)
        valid = frame_mask.repeat_interleave(per_frame, dim=1)
        return tokens * valid[..., None].to(tokens.dtype), valid

    def init_stds(self) -> tuple[float, float]:
        """(std, out_std) of the decoder's init, for strategy layers shaped like its blocks."""
        args = self.text_args
        out_std = args.init_std / math.sqrt(2 * args.n_layers) if args.depth_init else args.init_std
        return args.init_std, out_std

    def rope_at(self, start: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables of positions start .. start + seq - 1."""
        end = start + seq
        if end > self.decoder.rope_cos.shape[0]:
            raise ValueError(f"{end} positions exceed the text model's max_seq_len={self.decoder.rope_cos.shape[0]}")
        return self.decoder.rope_cos[start:end], self.decoder.rope_sin[start:end]

    def head(self, h: torch.Tensor, logits: bool = True) -> torch.Tensor:
        """The decoder's final norm, then (with `logits`) its output projection."""
        h = self.decoder.norm(h)
        return self.decoder.output(h) if logits else h

    def prefill(
        self,
        tokens: torch.Tensor,
        pixels: torch.Tensor,
        frame_mask: torch.Tensor,
        frame_times: torch.Tensor | None,
        cache: VLMCache,
    ) -> torch.Tensor:
        """forward(), filling an empty `cache` for `decode`."""
        raise NotImplementedError(f"{type(self).__name__} has no KV cache")

    def decode(self, tokens: torch.Tensor, cache: VLMCache) -> torch.Tensor:
        """Logits (batch, seq, vocab) of text tokens that follow everything in `cache`, which they are appended to."""
        raise NotImplementedError(f"{type(self).__name__} has no KV cache")


class PrefixVLM(VisionLanguageModel):
    """Strategies that run [visual tokens; text] as one sequence through the layers (joint decoder, MoT, MoMa):
    subclasses give `run_block`; logits come from the text positions only. `run_block` sees the first n_visual
    positions of h as visual tokens (0 when decoding text from a cache)."""

    def run_block(
        self, key: str, block, h, n_visual: int, valid, cos, sin, mask, cache: KVCache | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        tokens: torch.Tensor,
        pixels: torch.Tensor,
        frame_mask: torch.Tensor,
        frame_times: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        return self._prefix_forward(tokens, pixels, frame_mask, frame_times, None, head)

    def prefill(self, tokens, pixels, frame_mask, frame_times, cache: VLMCache) -> torch.Tensor:
        return self._prefix_forward(tokens, pixels, frame_mask, frame_times, cache)

    def _prefix_forward(
        self, tokens, pixels, frame_mask, frame_times, cache: VLMCache | None, head: bool = True
    ) -> torch.Tensor:
        visual, valid = self.encode_media(pixels, frame_mask, frame_times)
        text = self.decoder.tok_embeddings(tokens)
        n_visual = visual.shape[1]
        h = torch.cat([visual.to(text.dtype), text], dim=1)
        key_valid = torch.cat([valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
        mask = causal_key_mask(key_valid)
        cos, sin = self.rope_at(0, h.shape[1])
        for key, block in self.decoder.layers.items():
            h = self.run_block(key, block, h, n_visual, valid, cos, sin, mask, cache)
        if cache is not None:
            cache.key_valid = key_valid
        return self.head(h[:, n_visual:], head)

    def decode(self, tokens: torch.Tensor, cache: VLMCache) -> torch.Tensor:
        h = self.decoder.tok_embeddings(tokens)
        cos, sin = self.rope_at(cache.length, tokens.shape[1])
        mask = cache.extend_keys(tokens.shape[1])
        no_visual = mask.new_zeros(tokens.shape[0], 0)
        for key, block in self.decoder.layers.items():
            h = self.run_block(key, block, h, 0, no_visual, cos, sin, mask, cache)
        return self.head(h)
