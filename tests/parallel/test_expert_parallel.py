"""Expert parallelism on 2 real gloo processes (forked) against the single-process MoE."""

import copy
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from forge.models.common.moe import router_losses
from forge.models.llama import MoEArgs, Transformer, TransformerArgs, build_transformer
from forge.parallel.expert import apply_expert_parallel

WORLD = 2
VOCAB = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, *args) -> list:
    """Run fn(rank, *args) on WORLD forked gloo ranks; return each rank's result, re-raising a rank's error."""
    ctx = torch.multiprocessing.get_context("fork")
    queue, port = ctx.Queue(), free_port()

    def entry(rank: int) -> None:
        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork: a parallel region would hang
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        try:
            queue.put((rank, fn(rank, *args), None))
        except Exception:
            queue.put((rank, None, traceback.format_exc()))
        finally:
            dist.destroy_process_group()

    procs = [ctx.Process(target=entry, args=(r,)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict()
    for _ in procs:
        rank, value, error = queue.get(timeout=120)
        if error:
            pytest.fail(f"rank {rank} failed:\n{error}")
        results[rank] = value
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    return [results[r] for r in range(WORLD)]


@pytest.fixture(autouse=True, scope="module")
def warm_parent():
    """Build once before forking: the first meta-device build pays torch's lazy setup, which forks then inherit."""
    build_transformer(tiny_args())


def tiny_args(**moe) -> TransformerArgs:
    settings = {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "num_shared_experts": 1, **moe}
    return TransformerArgs(dim=32, n_layers=2, n_heads=2, vocab_size=VOCAB, ffn_dim=64, moe=MoEArgs(**settings))


def loss_of(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + router_losses(model)


def ep_matches_single_process(rank: int, moe: dict, chunks: int) -> dict:
    torch.manual_seed(0)
    data = torch.randint(0, VOCAB, (WORLD, 4, 17))
    full = build_transformer(tiny_args(**moe), seed=1)
    sharded = apply_expert_parallel(copy.deepcopy(full), dist.group.WORLD, chunks)

    # Reference: one process, each rank's half on its own (the router losses are per micro-batch), summed.
    ref_losses = [loss_of(full, data[r]) for r in range(WORLD)]
    sum(ref_losses).backward()

    loss = loss_of(sharded, data[rank])
    loss.backward()
    torch.testing.assert_close(loss, ref_losses[rank], rtol=1e-5, atol=1e-6)
    local = 4 // WORLD
    ref_params = dict(full.named_parameters())
    checked = 0
    for name, param in sharded.named_parameters():
        grad = param.grad.clone()
        if ".experts." in name:
            assert param.shape[0] == local
            expected = ref_params[name].grad[rank * local : (rank + 1) * local]
            torch.testing.assert_close(param, ref_params[name][rank * local : (rank + 1) * local])
        else:
            dist.all_reduce(grad)  # what data parallelism does (summed: the reference sums the halves' losses)
            expected = ref_params[name].grad
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
        checked += 1
    return {"loss": loss.item(), "checked": checked}


@pytest.mark.parametrize(
    "moe, chunks",
    [
        ({"router": "softmax_topk"}, 1),
        ({"router": "softmax_topk", "grouped_mm": False}, 2),
        ({"router": "sigmoid_topk", "capacity_factor": 1.0}, 3),
    ],
    ids=["softmax-dropless", "loop-two-parts", "sigmoid-capacity-three-parts"],
)
def test_ep2_matches_single_process_loss_and_grads(moe, chunks):
    """The all-to-all dispatch, whole or in overlapped parts, gives one process's loss and gradients."""
    results = run_ranks(ep_matches_single_process, moe, chunks)
    assert all(r["checked"] > 10 for r in results)
    assert results[0]["loss"] != results[1]["loss"]  # different data per rank


def meta_init_matches_slice(rank: int) -> bool:
    args = tiny_args()
    with torch.device("meta"):
        model = Transformer(args)
    apply_expert_parallel(model, dist.group.WORLD)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    full = build_transformer(args, seed=5)
    reference = dict(full.named_parameters())
    for name, param in model.named_parameters():
        expected = reference[name][rank * 2 : rank * 2 + 2] if ".experts." in name else reference[name]
        assert torch.equal(param, expected), name
    return True


def test_meta_device_ep_initialises_each_slice_like_the_whole_model():
    assert run_ranks(meta_init_matches_slice) == [True, True]
