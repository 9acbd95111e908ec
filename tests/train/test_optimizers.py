"""Lion, Muon and schedule-free AdamW: one update equals the published formula written out here with plain torch
ops; each trains the tiny model through its conf/optimizer preset; Muon routes the right parameters to AdamW; a
run stopped and resumed from a checkpoint equals the uninterrupted one bit for bit."""

import pytest
import torch
from torch import nn

from forge.config import compose
from forge.config.schema import MuonOptimizerConfig, options
from forge.models.llama.transformer import build_transformer
from forge.train import build
from forge.train.optimizers.lion import Lion
from forge.train.optimizers.muon import Muon, muon_with_adamw
from forge.train.optimizers.schedule_free import AdamWScheduleFree
from forge.train.trainer import Trainer
from tests.tiny import TINY_MODEL, Crash, CrashingTrainer, losses

TINY = [
    *TINY_MODEL,
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=2",
    "scheduler.warmup_steps=2",
    "metrics.console=quiet",
]
PRESETS = {
    "lion": ["optimizer=lion", "optimizer.lr=1e-3"],
    "muon": ["optimizer=muon", "optimizer.ns_bf16=false"],  # bf16 matmuls are slow on CPUs without AVX512
    "schedule_free_adamw": ["optimizer=schedule_free_adamw", "scheduler=constant"],
}


def two_grads(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def run_steps(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()


def test_lion_matches_the_paper():
    w0, g1, g2 = two_grads((5, 3))
    b0 = w0[0].clone()
    lr, beta1, beta2, wd = 0.1, 0.9, 0.99, 0.5
    w, b = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
    opt = Lion([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=lr, betas=(beta1, beta2), weight_decay=wd)
    run_steps(opt, [w, b], [(g1, g1[0]), (g2, g2[0])])

    def by_hand(x, grads, decay):
        m = torch.zeros_like(x)
        for g in grads:
            c = beta1 * m + (1 - beta1) * g
            x = x - lr * (torch.sign(c) + decay * x)
            m = beta2 * m + (1 - beta2) * g
        return x

    torch.testing.assert_close(w.detach(), by_hand(w0, [g1, g2], wd), rtol=0, atol=1e-6)
    torch.testing.assert_close(b.detach(), by_hand(b0, [g1[0], g2[0]], 0.0), rtol=0, atol=1e-6)


def newton_schulz_by_hand(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration X <- aX + bAX + cA^2X, A = XX^T, on the wide orientation of g / ||g||_F."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / (torch.sqrt((x * x).sum()) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)])
def test_muon_matches_the_published_update(shape):
    w0, g1, g2 = two_grads(shape, seed=1)
    lr, mu, wd = 0.05, 0.95, 0.1
    w = nn.Parameter(w0.clone())
    opt = Muon([w], lr=lr, momentum=mu, weight_decay=wd, ns_bf16=False)
    run_steps(opt, [w], [(g1,), (g2,)])
    x, buf = w0, torch.zeros_like(w0)
    scale = max(1.0, shape[0] / shape[1]) ** 0.5
    for g in (g1, g2):
        buf = mu * buf + (1 - mu) * g
        nesterov = (1 - mu) * g + mu * buf
        x = x * (1 - lr * wd) - lr * scale * newton_schulz_by_hand(nesterov)
    torch.testing.assert_close(w.detach(), x, rtol=0, atol=2e-5)
    # The default bf16 iteration is the same map, rounded.
    w_bf16 = nn.Parameter(w0.clone())
    run_steps(Muon([w_bf16], lr=lr, momentum=mu, weight_decay=wd), [w_bf16], [(g1,), (g2,)])
    torch.testing.assert_close(w_bf16.detach(), x, rtol=0, atol=lr * 0.1)  # a wrong map is off by ~lr


def test_muon_orthogonalises_stacked_experts_one_by_one():
    g = two_grads((3, 5, 4), seed=5)[0]
    w = nn.Parameter(torch.zeros(3, 5, 4))
    w.grad = g
    Muon([w], lr=1.0, momentum=0.0, nesterov=False, ns_bf16=False).step()
    for expert in range(3):
        want = -((5 / 4) ** 0.5) * newton_schulz_by_hand(g[expert])
        torch.testing.assert_close(w.detach()[expert], want, rtol=0, atol=2e-5)


def test_newton_schulz_orthogonalises():
    g = two_grads((32, 16), seed=2)[0]
    w = nn.Parameter(torch.zeros(32, 16))
    w.grad = g
    Muon([w], lr=1.0, momentum=0.0, nesterov=False, ns_bf16=False).step()
    update = -w.detach() / (32 / 16) ** 0.5
    singular = torch.linalg.svdvals(update)
    assert singular.min() > 0.6 and singular.max() < 1.25  # the quintic's band around 1, not g's spread
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(update.flatten(), (u @ vh).flatten(), dim=0) > 0.95


def test_muon_adamw_groups_match_adamw():
    w0, g1, g2 = two_grads((4, 3), seed=3)
    lr, betas, eps, wd = 0.01, (0.9, 0.95), 1e-8, 0.1
    w = nn.Parameter(w0.clone())
    opt = Muon([{"params": [w], "use_muon": False, "lr": lr, "betas": betas, "eps": eps, "weight_decay": wd}])
    run_steps(opt, [w], [(g1,), (g2,)])
    x, m, v = w0, torch.zeros_like(w0), torch.zeros_like(w0)
    for t, g in enumerate((g1, g2), start=1):
        x = x * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        x = x - lr * (m / (1 - betas[0] ** t)) / (torch.sqrt(v / (1 - betas[1] ** t)) + eps)
    torch.testing.assert_close(w.detach(), x, rtol=0, atol=1e-6)


def test_schedule_free_adamw_matches_the_paper():
    """Defazio et al. 2024, Alg. 1 (AdamW variant, warmup weights c_t = lr_t^2 / sum lr_i^2, here lr constant).

    y_t = (1 - beta1) z_t + beta1 x_t is where gradients are taken (the parameters in train mode),
    z_{t+1} = z_t - lr (g / (sqrt(v_hat) + eps) + wd y_t), x_{t+1} = (1 - c) x_t + c z_{t+1} (eval mode).
    """
    p0, g1, g2 = two_grads((3, 4), seed=4)
    lr, beta1, beta2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.1
    p = nn.Parameter(p0.clone())
    opt = AdamWScheduleFree([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    opt.train()
    x = z = p0
    v = torch.zeros_like(p0)
    weights = 0.0
    for t, g in enumerate((g1, g2), start=1):
        p.grad = g.clone()
        opt.step()
        y = (1 - beta1) * z + beta1 * x
        v = beta2 * v + (1 - beta2) * g * g
        z = z - lr * (g / (torch.sqrt(v / (1 - beta2**t)) + eps) + wd * y)
        weights += lr**2
        c = lr**2 / weights
        x = (1 - c) * x + c * z
        torch.testing.assert_close(p.detach(), (1 - beta1) * z + beta1 * x, rtol=0, atol=1e-6)
    opt.eval()
    torch.testing.assert_close(p.detach(), x, rtol=0, atol=1e-6)


def test_muon_routes_embeddings_head_and_vectors_to_adamw():
    cfg = compose([*TINY, "optimizer=muon"])
    model = build_transformer(build.model_args(cfg))
    optimizer, _ = build.build_optimizer(cfg, model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, head, rest = ({names[id(p)] for p in g["params"]} for g in optimizer.param_groups)
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False, False]
    assert [g["initial_lr"] for g in optimizer.param_groups] == [0.02, 3e-3, 3e-3]  # before the warmup
    assert head == {"output.weight"}
    assert rest == {n for n, p in model.named_parameters() if p.ndim == 1} | {"tok_embeddings.weight"}
    assert muon == {n for n, p in model.named_parameters() if p.ndim == 2} - {"output.weight", "tok_embeddings.weight"}
    assert all(
        ".layers." in f".{n}"
        and n.endswith(("wq.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight", "wk.weight", "wv.weight"))
        for n in muon
    )


def test_muon_sends_a_tied_head_to_adamw():
    cfg = compose([*TINY, "model.tie_embeddings=true"])
    model = build_transformer(build.model_args(cfg))
    optimizer = muon_with_adamw(model, **options(MuonOptimizerConfig))
    muon_params = {id(p) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    assert id(model.output.weight) not in muon_params and id(model.tok_embeddings.weight) not in muon_params
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_lion_trains(tmp_path):
    summary = Trainer(compose([*TINY, *PRESETS["lion"], "train.steps=8"]), tmp_path).fit()
    curve = losses(tmp_path)
    assert curve[8] < curve[1] - 0.3
    assert summary["final_val_loss"] < summary["first_val_loss"] - 0.3


class CrashAfter4(CrashingTrainer):
    crash_after = 4


@pytest.mark.parametrize("name", ["muon", "schedule_free_adamw"])
def test_trains_and_resumes_bitwise(tmp_path, name):
    overrides = [*TINY, *PRESETS[name], "train.steps=6", "checkpoint.interval=3"]
    summary = Trainer(compose(overrides), tmp_path / "whole").fit()
    whole = losses(tmp_path / "whole")
    assert whole[6] < whole[1] - 0.3
    assert summary["final_val_loss"] < summary["first_val_loss"] - 0.3
    with pytest.raises(Crash):
        CrashAfter4(compose(overrides), tmp_path / "cut").fit()
    resumed = Trainer(compose(overrides), tmp_path / "cut")
    assert resumed.state.step == 3
    resumed_summary = resumed.fit()
    cut = losses(tmp_path / "cut")
    assert [cut[s] for s in range(1, 7)] == [whole[s] for s in range(1, 7)]
    assert resumed_summary["final_val_loss"] == summary["final_val_loss"]
