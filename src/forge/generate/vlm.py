"""Generation with a trained vision-language model: answer a prompt about an image or a video clip.

    forge-generate checkpoint=outputs/vlm-run image=photo.png prompt='what color is the shape?'
    forge-generate checkpoint=outputs/vlm-run video=clip.mp4 clip_end=2.0 prompt='what video is this?'

The media and the prompt are run once (prefill) and each new token then reads the keys and values of everything
before it from a KV cache. MoMa has no cache (expert choice routes over the whole sequence), so with it each new
token recomputes the sequence. The media are preprocessed by the run's own data code (the encoder's image
processor, the same frame sampling).
"""

from pathlib import Path

import torch
from omegaconf import DictConfig

from forge.checkpoint.errors import CheckpointError
from forge.checkpoint.layout import resolve_checkpoint
from forge.checkpoint.run_config import load_run_config
from forge.checkpoint.untrusted import load_dcp
from forge.data.vlm.dataset import MediaRecord
from forge.generate.sampling import next_token
from forge.models.vlm.base import VLMCache


def load_vlm(source: str | Path, device: torch.device):
    """(model, corpus, run config) of a VLM run directory or checkpoint folder, weights from its DCP checkpoint.
    The config is read (and a foreign `_target_` refused) before the training stack is even imported."""
    path = resolve_checkpoint(Path(source).expanduser())
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.yaml: a VLM checkpoint needs the run's config")
    cfg: DictConfig = load_run_config(config_file)
    if cfg.get("vlm") is None:
        raise CheckpointError(f"{path} is a text model's checkpoint (its config has no vlm)")

    from hydra.utils import instantiate
    from transformers import AutoImageProcessor

    from forge.train.vlm_trainer import build_vlm

    model = build_vlm(cfg, cfg.train.seed)
    state = {"model": model.state_dict()}
    load_dcp(state, path, action="load VLM checkpoint")
    model.load_state_dict(state["model"])
    processor = AutoImageProcessor.from_pretrained(model.encoder_path)
    corpus = instantiate(cfg.data, image_processor=processor, _convert_="all")
    return model.to(device).eval(), corpus, cfg


@torch.no_grad()
def generate_vlm(
    model,
    corpus,
    record: MediaRecord,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_at_eos: bool = True,
    seed: int = 0,
    use_cache: bool = True,
) -> list[int]:
    """Token ids generated after `record.prompt` given its image or clip. use_cache=False recomputes the whole
    sequence for every token (what the cache is tested against)."""
    device = next(model.parameters()).device
    example = corpus.example(record, 1)
    if example is None:
        raise ValueError(f"cannot read {record.path}")
    pixels, mask, times = (example[k][None].to(device) for k in ("pixels", "frame_mask", "frame_times"))
    ids = corpus.tokenizer.encode(record.prompt).ids
    if not ids:
        raise ValueError("the prompt is empty")
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = VLMCache() if use_cache and model.supports_kv_cache else None
    out: list[int] = []
    positions = model.decoder.rope_cos.shape[0]  # max_seq_len: the rotary table's length
    for _ in range(max_new_tokens):
        if cache is not None and cache.length >= positions:
            break  # the answer so far fills the text model's max_seq_len
        if cache is None:
            logits = model(torch.tensor([ids + out], device=device), pixels, mask, times)
        elif not out:
            logits = model.prefill(torch.tensor([ids], device=device), pixels, mask, times, cache)
        else:
            logits = model.decode(torch.tensor([out[-1:]], device=device), cache)
        token = int(next_token(logits[:, -1], temperature, top_k, top_p, generator))
        if stop_at_eos and token == corpus.eos_id:
            break
        out.append(token)
    return out
