"""The four strategies, the connectors, the vision towers and the freeze schedule, against direct computations."""

import pytest
import torch

from forge.config.schema import options
from forge.models.llama.transformer import Transformer
from forge.models.vlm import CrossAttentionVLM, JointDecoderVLM, MoMaVLM, MoTVLM
from forge.models.vlm.args import CrossAttentionVLMConfig, MoMaVLMConfig, VLMConfig
from forge.models.vlm.base import VLMCache
from forge.models.vlm.connector import build_connector
from forge.models.vlm.encoder import VisionTower, build_tiny_encoder, load_vision_tower
from forge.parallel.init import materialize_sharded
from tests.vlm.conftest import media

STRATEGIES = {"joint_decoder": JointDecoderVLM, "cross_attention": CrossAttentionVLM, "mot": MoTVLM, "moma": MoMaVLM}


SCHEMAS = {
    JointDecoderVLM: VLMConfig,
    CrossAttentionVLM: CrossAttentionVLMConfig,
    MoTVLM: VLMConfig,
    MoMaVLM: MoMaVLMConfig,
}


def build(cls, text_args, encoder: str, seed: int = 0, **kwargs):
    """The strategy as training builds it: on the meta device but for the loaded tower, then filled from `seed`."""
    with torch.device("meta"):
        model = cls(text_args, **options(SCHEMAS[cls], encoder_path=encoder, **kwargs))
    materialize_sharded(model, model, seed, torch.device("cpu"))
    return model.eval()


def test_cross_attention_at_step_zero_is_exactly_the_text_model(text_args, encoders):
    model = build(CrossAttentionVLM, text_args, encoders["clip"], cross_attention_every=2)
    assert len(model.cross_layers) == 2
    tokens, pixels, mask, times = media()
    with torch.no_grad():
        assert torch.equal(model(tokens, pixels, mask, times), model.decoder(tokens))
        for block in model.cross_layers.values():  # once the gates open, the image matters
            block.attn_gate.fill_(0.5)
        other = pixels + 1.0
        assert not torch.allclose(model(tokens, pixels, mask, times), model(tokens, other, mask, times))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("connector", ["mlp", "attnpool"])
def test_masked_frames_do_not_change_outputs(strategy, connector, text_args, encoders):
    tokens_per_frame = 4 if connector == "attnpool" else None
    model = build(
        STRATEGIES[strategy],
        text_args,
        encoders["clip"],
        connector=connector,
        connector_tokens=tokens_per_frame,
        time_embedding=True,
    )
    if strategy == "cross_attention":
        for block in model.cross_layers.values():
            block.attn_gate.data.fill_(1.0)
            block.ffn_gate.data.fill_(1.0)
    tokens, pixels, mask, times = media(frames=3, valid=2)
    changed = pixels.clone()
    changed[:, 2] = torch.rand_like(changed[:, 2]) * 5  # only the padded frame differs
    real_changed = pixels.clone()
    real_changed[:, 1] += 1.0
    with torch.no_grad():
        base = model(tokens, pixels, mask, times)
        assert torch.equal(base, model(tokens, changed, mask, times))
        assert not torch.allclose(base, model(tokens, real_changed, mask, times))
    assert base.shape == (2, 12, 97)


def test_mot_with_shared_weights_equals_the_joint_decoder(text_args, encoders):
    joint = build(JointDecoderVLM, text_args, encoders["clip"])
    mot = build(MoTVLM, text_args, encoders["clip"])
    mot.load_state_dict(joint.state_dict(), strict=False)
    for key, block in mot.decoder.layers.items():
        mot.image_layers[key].load_state_dict(block.state_dict())
    tokens, pixels, mask, times = media()
    with torch.no_grad():
        torch.testing.assert_close(mot(tokens, pixels, mask, times), joint(tokens, pixels, mask, times))
        mot.image_layers["0"].attention.wq.weight.mul_(2)  # the visual tokens now take another path
        assert not torch.allclose(mot(tokens, pixels, mask, times), joint(tokens, pixels, mask, times))


def test_joint_decoder_text_logits_match_a_manual_prefix_run(text_args, encoders):
    """Independent computation: embed [visual; text] by hand and run the plain decoder with its own loop."""
    model = build(JointDecoderVLM, text_args, encoders["clip"])
    tokens, pixels, _, times = media(frames=1, valid=1)
    mask = torch.ones(2, 1, dtype=torch.bool)
    with torch.no_grad():
        features = model.encoder.model(pixel_values=pixels[:, 0]).last_hidden_state
        visual = model.connector(features)
        decoder: Transformer = model.decoder
        embedded = torch.cat([visual, decoder.tok_embeddings(tokens)], dim=1)
        decoder.tok_embeddings, saved = None, decoder.tok_embeddings
        expected = decoder(embedded)[:, visual.shape[1] :]  # plain causal SDPA path
        decoder.tok_embeddings = saved
        torch.testing.assert_close(model(tokens, pixels, mask, times), expected)


def test_moma_routes_by_modality_with_expert_choice(text_args, encoders):
    model = build(MoMaVLM, text_args, encoders["clip"], text_experts=2, image_experts=3, capacity_factor=1.0)
    layer = model.moma_layers["0"]
    assert len(layer.text.experts) == 1 and len(layer.image.experts) == 3  # + the block's own FFN for text
    tokens, pixels, mask, times = media(batch=3, valid=3)
    with torch.no_grad():
        batched = model(tokens, pixels, mask, times)
        singles = torch.cat(
            [model(tokens[i : i + 1], pixels[i : i + 1], mask[i : i + 1], times[i : i + 1]) for i in range(3)]
        )
    torch.testing.assert_close(batched, singles)  # routing is per sequence: no batch coupling
    x = torch.randn(2, 10, 64)
    valid = torch.ones(2, 10, dtype=torch.bool)
    calls = []
    for expert in layer.image.experts:
        expert.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    layer.image(x, valid, [])
    assert calls == [4, 4, 4]  # ceil(1.0 * 10 / 3) tokens per expert


@pytest.mark.parametrize("kind", ["linear", "mlp", "avgpool", "attnpool"])
def test_connectors(kind):
    connector = build_connector(kind, 32, 48, 4 if "pool" in kind else None)
    out = connector(torch.randn(3, 16, 32))
    assert out.shape == (3, 16 if "pool" not in kind else 4, 48)
    if kind == "avgpool":
        x = torch.randn(1, 16, 32)
        manual = connector.proj(x.view(1, 4, 4, 32).mean(2))
        torch.testing.assert_close(connector(x), manual)
    with pytest.raises(ValueError, match="vlm.connector"):
        build_connector("conv", 32, 48, None)


def test_vision_towers_load_from_local_folders(encoders, tmp_path):
    from transformers import CLIPConfig, CLIPModel

    for kind, folder in encoders.items():
        tower = VisionTower(load_vision_tower(folder))
        assert tower(torch.randn(2, 3, 64, 64)).shape[-1] == 64
        assert type(tower.model).__name__.lower().startswith(kind)
    full = CLIPModel(
        CLIPConfig(
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=32,
                patch_size=16,
            ),
            text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        )
    )
    full.save_pretrained(tmp_path / "full")
    vision_half = VisionTower(load_vision_tower(tmp_path / "full"))
    assert "Text" not in type(vision_half.model).__name__
    assert vision_half(torch.randn(1, 3, 32, 32)).shape == (1, 5, 32)
    with pytest.raises(FileNotFoundError, match="vlm.encoder_path='/nowhere'"):
        load_vision_tower("/nowhere")
    assert str(build_tiny_encoder(encoders["clip"])) == encoders["clip"]  # an existing folder is reused


def test_freeze_schedule_and_its_saved_state(text_args, encoders):
    model = build(JointDecoderVLM, text_args, encoders["clip"], train_encoder_from_step=5, train_decoder_from_step=2)
    model.train()
    assert model.set_step(0) is False
    assert not any(p.requires_grad for p in model.encoder.parameters())
    assert not any(p.requires_grad for p in model.decoder.parameters())
    assert all(p.requires_grad for p in model.connector.parameters())
    assert not model.encoder.training
    assert model.set_step(2) is True and all(p.requires_grad for p in model.decoder.parameters())
    model.set_step(5)
    assert all(p.requires_grad for p in model.encoder.parameters()) and model.encoder.training
    assert model.state_dict()["encoder_trainable"].item() is True
    model.check_freeze_state(6)
    with pytest.raises(ValueError, match="vlm.train_encoder_from_step=5"):
        model.check_freeze_state(3)


@pytest.mark.parametrize("strategy", ["joint_decoder", "cross_attention", "mot"])
def test_prefill_then_cached_decode_equals_the_full_forward(strategy, text_args, encoders):
    """Generation's KV cache: the prompt's logits from prefill, then 2 tokens and 1 token at a time from the cache,
    equal one forward pass over the whole sequence (with a padded video frame among the cached keys)."""
    model = build(STRATEGIES[strategy], text_args, encoders["clip"], time_embedding=True)
    if strategy == "cross_attention":
        for block in model.cross_layers.values():
            block.attn_gate.data.fill_(1.0)
            block.ffn_gate.data.fill_(1.0)
    tokens, pixels, mask, times = media(frames=3, valid=2)
    cache = VLMCache()
    with torch.no_grad():
        full = model(tokens, pixels, mask, times)
        pieces = [model.prefill(tokens[:, :8], pixels, mask, times, cache), model.decode(tokens[:, 8:10], cache)]
        pieces += [model.decode(tokens[:, i : i + 1], cache) for i in range(10, 12)]
        visual_tokens = model.encode_media(pixels, mask, times)[0].shape[1]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == (12 if strategy == "cross_attention" else visual_tokens + 12)


def test_moma_has_no_kv_cache_and_says_so(text_args, encoders):
    """Expert choice routes over the whole sequence, so a cache would change the outputs: generation recomputes."""
    model = build(MoMaVLM, text_args, encoders["clip"])
    assert not model.supports_kv_cache
    tokens, pixels, mask, times = media()
    with pytest.raises(NotImplementedError, match="MoMaVLM has no KV cache"):
        model.prefill(tokens, pixels, mask, times, VLMCache())


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_activation_checkpointing_recomputes_each_layer_and_keeps_the_gradients(strategy, mode, text_args, encoders):
    """parallel.activation_checkpoint for a VLM wraps the strategy's run_block: the layers run again in backward
    (MoT and MoMa never call a block's own forward, so wrapping blocks would recompute nothing) and the gradients
    equal those of the plain model."""
    import copy

    from forge.models.vlm.parallelize import parallelize_vlm

    plain = build(STRATEGIES[strategy], text_args, encoders["clip"]).train()
    if strategy == "cross_attention":
        for block in plain.cross_layers.values():
            block.attn_gate.data.fill_(0.5)
    wrapped = parallelize_vlm(copy.deepcopy(plain), None, mode)
    tokens, pixels, mask, times = media(frames=3, valid=2)
    targets = torch.randint(0, 97, tokens.shape, generator=torch.Generator().manual_seed(1))
    grads, calls = {}, {}
    for name, model in (("plain", plain), ("wrapped", wrapped)):
        count = [0]
        # A pre-hook: recomputation stops as soon as it has every saved tensor back, before the FFN's end.
        ffn = model.decoder.layers["1"].feed_forward
        ffn.register_forward_pre_hook(lambda *_, count=count: count.__setitem__(0, count[0] + 1))
        logits = model(tokens, pixels, mask, times)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        calls[name] = count[0]
    assert calls == {"plain": 1, "wrapped": 2}
    assert sorted(grads["plain"]) == sorted(grads["wrapped"]) and len(grads["plain"]) > 10
    for name, grad in grads["plain"].items():
        torch.testing.assert_close(grads["wrapped"][name], grad, rtol=1e-6, atol=1e-7, msg=name)
