"""Pipeline parallelism of the decoder (dense or MoE) through torch.distributed.pipelining.

The meta-device model is cut into stages of consecutive blocks. Each stage is a copy of the model with the blocks
it does not own deleted and the embedding (all but the first stage), final norm and head (all but the last) set to
None; parameter names therefore stay those of the whole model. Every pp rank holds one stage, or two (interleaved
1F1B and interleaved_zb: stages rank and rank + pp, "looped"; zbv and dualpipev: rank and 2 pp - 1 - rank, a V).
The rest of the plan (tensor and context parallelism, activation checkpointing, compile, FSDP over dp_shard) then
applies to each stage module as it would to a whole model; under tp the stages pass the sequence-split residual
stream as DTensors and the schedule runs under `loss_parallel` (the logits are split over the vocabulary).

Every pp rank reads the same batch: the first stage feeds the tokens, the last computes the loss against the
labels, every stage builds its chunk's attention mask from the batch's document ids (and context-parallel
positions: ChunkMasks). The schedules split the batch into `parallel.microbatches` chunks; a chunk's loss is its
token sum weighted by the step's count (ChunkLoss), and a stage's MoE router losses join its chunk's output
(RouterLosses), so the gradients are one process's.

Tied embeddings (model.tie_embeddings, as Llama 3.2 1B): the first and the last stage each hold the embedding matrix,
under its one name `tok_embeddings.weight` (the last stage uses it only as its head). Both start from the same
values (initial values are a function of the name), and after backward each gets the sum of the two stages'
gradients (one all-reduce of this rank's shard between the two ranks), so both take the same optimizer steps and
stay equal, bit for bit, as Megatron-LM keeps its embedding group. The gradient norm counts the matrix once.
"""

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor

from forge.config.degrees import Degrees, pipeline_chunks
from forge.config.schema import V_SHAPED, ZERO_BUBBLE, ParallelConfig, PPSchedule, stages_per_rank
from forge.models.common.attention import DocumentMask
from forge.models.common.moe import moe_layers
from forge.models.common.moe.balance import router_losses
from forge.parallel.applied import Applied, logged
from forge.parallel.init import materialize_sharded
from forge.parallel.mesh import submesh
from forge.train.losses import IGNORE_INDEX, loss_context

SCHEDULES = dict(
    zip(
        map(str, PPSchedule),
        (
            ScheduleGPipe,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
            ScheduleDualPipeV,
        ),
        strict=True,
    )
)


class Stage(PipelineStage):
    """torch's stage, except that a forward-only pass (evaluation) keeps no chunk's output and inputs: torch's stage
    caches them for a backward that never comes, until the next step, so the last stage held every chunk's logits
    (the evaluated batch's tokens x vocab). The last stage drops them after its forward (it sends nothing), the
    others once their send is built (the send holds the output). A forward-only pass of a V schedule hands no
    gradients between a rank's two stages."""

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        self.submod.forge_chunk = True  # a chunk of the schedule, not torch's metadata inference: RouterLosses
        try:
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            self.submod.forge_chunk = False
        if self.is_last and not self.has_backward:
            self.fwd_cache.pop(fwd_chunk_id, None)
        return output

    # Under a V schedule the two stages of a rank hand gradients to each other directly, and torch's runtime does
    # so in a forward-only pass too, where there are none: nothing to hand over then.
    def get_local_bwd_output(self, mb_index: int):
        return super().get_local_bwd_output(mb_index) if self.has_backward else None

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.is_last and not self.has_backward:
            return []
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not self.has_backward:
            self.fwd_cache.pop(fwd_chunk_id, None)
        return ops


class ReducingStage(Stage):
    """A stage whose FSDP gradients are reduce-scattered after each chunk's backward, as FSDP does outside a
    pipeline (parallel.defer_grad_sync=false, the default when dp_shard x cp > 1 outside the zero-bubble schedules).

    torch's PipelineStage turns gradient sync and resharding off for every chunk and reduces once when the
    schedule's step ends, so the stage's unsharded parameters and unsharded fp32 gradients stay alive until then:
    a whole stage of each on every rank (llama3_70b on pp 4: about 18B parameters, 70 GB of gradients). Reducing each
    chunk keeps them sharded for (microbatches - 1) more reduce-scatters and block gathers per step. The schedule's
    final reduction then finds nothing left to reduce (FSDP's post-backward is a no-op without gradients)."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


class ChunkLoss:
    """The schedule's loss of one chunk on the last stage: the chunk's cross-entropy summed over its labelled
    tokens, times `weight` (token ranks / the step's labelled tokens over them, set for each step; 1 to evaluate).
    The summed gradients of every chunk of every micro-batch, averaged by FSDP over the token ranks, are then those
    of the step's token mean, whatever the chunks' counts of ignored labels (document masking ignores each EOS's
    label); a mean of chunk means would weigh a chunk's tokens by its count."""

    def __init__(self, mean_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.mean_loss = mean_loss
        self.weight: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.mean_loss(logits, target) * (target != IGNORE_INDEX).sum() * self.weight

    def token_sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The token sum of the chunks whose losses the schedule returned."""
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self.weight


class _WithRouterLosses(torch.autograd.Function):
    """The identity on a stage's output, whose backward also starts the backward of `losses` with gradient
    `scale` (as Megatron's MoEAuxLossAutoScaler): the chunk's router losses reach the gradients from the stage
    that computed them, with no loss sent between stages and no host sync."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, losses: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(losses)
        ctx.scale = scale
        return output.clone()  # not a view: the zero-bubble schedules detach the stage output in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (losses,) = ctx.saved_tensors
        return grad, torch.full_like(losses, ctx.scale), None


class RouterLosses:
    """Forward hook of a stage with MoE layers: after each chunk's forward, the layers' router losses (aux and z,
    weighted by their coefficients) join the stage's output with weight `scale` = 1 / the step's chunks, as one
    process adds them per micro-batch / micro-batches; the expert loads are tallied per chunk for the bias update
    and the metrics. Forwards outside the schedule's chunks (torch's metadata inference) and without grad
    (evaluation) are left alone."""

    def __init__(self) -> None:
        self.scale = 1.0

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not getattr(module, "forge_chunk", False) or not torch.is_grad_enabled():
            return None
        losses = router_losses(module)
        if not losses.requires_grad:
            return None
        return _WithRouterLosses.apply(output, losses, self.scale)


class ChunkMasks:
    """Forward pre-hook of a stage: the chunk's document ids (a `doc_ids` tensor, which the schedule splits with
    the batch and hands to every stage) become the model's attention mask, placed in the whole sequences by the
    step's `queries` and `keys` positions under context parallelism (forge.parallel.context_parallel)."""

    def __init__(self) -> None:
        self.queries: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        doc_ids = kwargs.pop("doc_ids", None)
        if doc_ids is not None:
            kwargs["attn_mask"] = DocumentMask(doc_ids, queries=self.queries, keys=self.keys)
        return args, kwargs


def rank_stages(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds, in order: looped (r, r + pp) or, for V_SHAPED, (r, 2 pp - 1 - r)."""
    if stages_per_rank(schedule) == 1:
        return [pp_rank]
    return [pp_rank, 2 * pp - 1 - pp_rank] if schedule in V_SHAPED else [pp_rank, pp_rank + pp]


def stage_sizes(n_layers: int, n_stages: int, v_shaped: bool = False) -> list[int]:
    """Blocks per stage: n_layers // n_stages each, and the rest one more each on the middle stages first (the first
    stage also embeds, the last one runs the head and the loss), then on the first and the last: 126 blocks on 8
    stages are 15, 16 x 6, 15. `v_shaped` (rank r holds stages r and n_stages - 1 - r): the split is even per
    rank first (rank 0, which embeds and runs the head, takes an extra block last), then each rank's blocks go
    to its two stages, the returning one (nearer the head) taking the smaller half: 24 blocks on V pp 8 are 3 per
    rank, where an even split of the 16 stages would leave rank 7 four."""
    if not v_shaped:
        sizes = [n_layers // n_stages] * n_stages
        middle = list(range(1, n_stages - 1))
        for stage in (middle + [0, n_stages - 1])[: n_layers % n_stages]:
            sizes[stage] += 1
        return sizes
    pp = n_stages // 2
    per_rank = [n_layers // pp] * pp
    for rank in [*range(1, pp), 0][: n_layers % pp]:
        per_rank[rank] += 1
    sizes = [0] * n_stages
    for rank, count in enumerate(per_rank):
        sizes[rank], sizes[n_stages - 1 - rank] = count - count // 2, count // 2
    return sizes


def stage_layers(n_layers: int, n_stages: int, v_shaped: bool = False) -> list[list[str]]:
    """Block keys of each stage: runs of consecutive blocks, as even as the count allows (`stage_sizes`)."""
    bounds = list(itertools.accumulate(stage_sizes(n_layers, n_stages, v_shaped), initial=0))
    return [[str(i) for i in range(bounds[s], bounds[s + 1])] for s in range(n_stages)]


def build_stage_module(model: nn.Module, stage: int, n_stages: int, v_shaped: bool = False) -> nn.Module:
    """A copy of `model` (meta device) that keeps only stage `stage` of `n_stages` (`v_shaped`: as a V schedule
    splits the blocks, `stage_sizes`). With tied embeddings the last stage keeps the embedding module as its head's
    matrix (not to embed: its input is the previous stage's)."""
    part = copy.deepcopy(model)
    keep = set(stage_layers(len(model.layers), n_stages, v_shaped)[stage])
    for key in list(part.layers.keys()):
        if key not in keep:
            del part.layers[key]
    last = stage == n_stages - 1
    if stage != 0:
        part.embeds_tokens = False
        if not (last and model.args.tie_embeddings):
            part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


@dataclass
class Pipeline:
    """This rank's share of the pipeline and the schedule that drives it."""

    parts: list[nn.Module]
    """Stage modules held by this rank, in stage order."""
    schedule: object
    group: dist.ProcessGroup
    has_first: bool
    has_last: bool
    size: int
    """Pipeline ranks (pp degree)."""
    microbatches: int
    applied: list[Applied] = field(default_factory=list)
    """What the plan applied on this rank, in order: each stage's split and then its own plan, then the schedule."""
    loss: ChunkLoss | None = None
    """The schedule's loss (on the last stage)."""
    routers: RouterLosses | None = None
    """The stages' router losses (MoE), weighted per chunk."""
    masks: ChunkMasks | None = None
    """The stages' attention masks of packed documents or context-parallel positions."""
    last_rank: int = -1
    """The pp rank of the last stage (0 under a V schedule, else pp - 1)."""
    stages: list[Stage] = field(default_factory=list)
    """torch's stage objects of `parts`."""
    tied_group: dist.ProcessGroup | None = None
    """With tied embeddings, on the ranks of the first and the last stage: the two of them."""
    vocab_split: bool = False
    """The last stage's logits are split over the vocabulary (tensor-parallel stages): the schedule runs under
    `loss_parallel`, which the loss's forward and backward (both inside the schedule) need."""

    @property
    def tied(self) -> list[torch.Tensor]:
        """The tied embedding matrix on this rank's first or last stage (empty without tied embeddings)."""
        if self.tied_group is None:
            return []
        return [part.tok_embeddings.weight for part in self.parts if part.tok_embeddings is not None]

    @property
    def counted_elsewhere(self) -> list[torch.Tensor]:
        """Parameters whose gradient another pp rank counts in the global norm: the last stage's tied matrix."""
        return [
            part.tok_embeddings.weight
            for part in self.parts
            if part.tok_embeddings is not None and not part.embeds_tokens
        ]

    @property
    def model(self) -> nn.Module:
        """What the optimizer, checkpointing and counting see: the stage, or a ModuleList of two stages."""
        return self.parts[0] if len(self.parts) == 1 else nn.ModuleList(self.parts)

    def _run(
        self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor, mask: DocumentMask | None, **kwargs
    ) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        extra = {"target": labels, "losses": losses} if self.has_last else {}
        if mask is not None:  # every pp rank reads the batch: the schedule splits the ids into each stage's chunks
            extra["doc_ids"] = mask.doc_ids.expand(inputs.shape[0], -1)
            self.masks.queries, self.masks.keys = mask.queries, mask.keys
        with loss_context(self.vocab_split):
            run(*args, **extra, **kwargs)
        return self.loss.token_sum(losses) if self.has_last else torch.zeros((), device=inputs.device)

    def step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        weight: torch.Tensor,
        mask: DocumentMask | None = None,
        accumulated: int = 1,
    ) -> torch.Tensor:
        """Forward and backward of one of `accumulated` batches of a step (packed documents: `mask`), each chunk's
        token-summed loss weighted by `weight` (ChunkLoss), its router losses by 1 / the step's chunks
        (RouterLosses); the batch's token-summed loss on the last stage, 0 elsewhere."""
        self.loss.weight = weight
        self.routers.scale = 1.0 / (accumulated * self.microbatches)
        return self._run(self.schedule.step, inputs, labels, mask, return_outputs=False)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        """Forward only; the token-summed loss on the last stage, 0 elsewhere. No outputs are asked for (torch's
        schedule would concatenate the chunks' logits), and the stages keep none (Stage; a V schedule's stage that
        hands its output to the rank's other stage keeps them to the end of the pass)."""
        self.loss.weight = 1.0
        total = self._run(self.schedule.eval, inputs, labels, mask, return_outputs=False)
        for stage in self.stages:
            stage.fwd_cache.clear()
        return total

    @torch.no_grad()
    def sum_tied_grads(self) -> None:
        """Give the tied embedding on the first and on the last stage the sum of both stages' gradients (this
        rank's shard of it: the two stages shard it alike)."""
        for param in self.tied:
            if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                # under tp the embedding's gradient comes out replicated: take this rank's rows, as the head's are
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=self.tied_group)

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """The last stage's value of a scalar, on every pp rank."""
        value = value.detach().clone()
        dist.broadcast(value, group=self.group, group_src=self.last_rank)
        return value


def build_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    degrees: Degrees,
    parallel_cfg: ParallelConfig,
    device: torch.device,
    loss_fn: Callable,
    parallelize: Callable[[nn.Module], list[Applied] | None],
    seed: int,
    defer_grad_sync: bool = False,
) -> Pipeline:
    """Split `model` (meta device) into this rank's stages, apply `parallelize` to each, materialise them with the
    weights one process would give the whole model from `seed`, and build the schedule. The pipeline's `applied`
    lists the splits, what `parallelize` returned for each stage, and the schedule. `defer_grad_sync`: reduce the
    gradients once per schedule step (Stage, as torch's PipelineStage), else after each chunk (ReducingStage)."""
    pp_mesh = mesh["pp"]
    pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    per_rank = stages_per_rank(parallel_cfg.pp_schedule)
    n_stages = pp * per_rank
    stage_ids = rank_stages(parallel_cfg.pp_schedule, pp, pp_rank)
    v_shaped = parallel_cfg.pp_schedule in V_SHAPED
    parts = [build_stage_module(model, s, n_stages, v_shaped) for s in stage_ids]
    applied = []
    for s, part in zip(stage_ids, parts):
        detail = f"pipeline stage {s}/{n_stages} on pp rank {pp_rank}: blocks {','.join(part.layers.keys())}"
        applied.append(logged(Applied("pp", detail, {"pp": pp})))
        applied += parallelize(part) or []
    materialize_stages(parts, model, seed, device)
    routers, masks = RouterLosses(), ChunkMasks()
    for part in parts:
        part.register_forward_pre_hook(masks, with_kwargs=True)
        if moe_layers(part):
            part.register_forward_hook(routers)
    group = pp_mesh.get_group()
    if parallel_cfg.pp_schedule in ZERO_BUBBLE:
        # torch's split backward finds a chunk's weights among the stage's parameters: under FSDP these must be the
        # unsharded ones the forward used, so the stage stays gathered from its first forward to the step's end
        for part in parts:
            if isinstance(part, FSDPModule):
                part.set_reshard_after_forward(False)
    stage_cls = Stage if defer_grad_sync else ReducingStage

    # Under tp the stages pass DTensors (the sequence-split residual stream); a receiving stage finds their mesh by
    # its dimension names
    def get_mesh(names: tuple[str, ...], layout) -> DeviceMesh:
        return submesh(mesh, *names)

    stages = [stage_cls(p, s, n_stages, device, group=group, get_mesh=get_mesh) for s, p in zip(stage_ids, parts)]
    microbatches = pipeline_chunks(pp, parallel_cfg.microbatches)
    cls = SCHEDULES[parallel_cfg.pp_schedule]
    loss = ChunkLoss(loss_fn)
    schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
    reduced = "once per step" if defer_grad_sync else "after each microbatch"
    detail = (
        f"pipeline: {n_stages} stages on {pp} ranks, {cls.__name__} schedule, {microbatches} microbatches, "
        f"gradients reduced {reduced}"
    )
    applied.append(logged(Applied("pp", detail, {"pp": pp})))
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
    tied_group = None
    if model.args.tie_embeddings:
        tied_group = first_and_last_group(mesh, pp_mesh)  # every rank takes part in creating it
        detail = f"tied embeddings: stages 0 and {n_stages - 1} each hold the matrix; gradients summed between them"
        applied.append(logged(Applied("pp", detail, {"pp": pp})))
    pipeline = Pipeline(parts, schedule, group, has_first, has_last, pp, microbatches, applied, loss, routers, masks)
    pipeline.vocab_split = degrees.tp > 1
    pipeline.last_rank = 0 if parallel_cfg.pp_schedule in V_SHAPED else pp - 1
    pipeline.stages = stages
    pipeline.tied_group = tied_group if has_first or has_last else None
    return pipeline


def first_and_last_group(mesh: DeviceMesh, pp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group of this pipeline's first and last pp rank (the pp group itself when pp = 2). Every rank creates
    the group of every pipeline, in the same order, as new_group requires."""
    if pp_mesh.size() == 2:
        return pp_mesh.get_group()
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, pp_mesh.size()).tolist()
    mine = None
    for row in ranks:
        group = dist.new_group([row[0], row[-1]])
        if dist.get_rank() in row:
            mine = group
    return mine


def materialize_stages(parts: list[nn.Module], plain: nn.Module, seed: int, device) -> None:
    """Allocate each stage and fill the parameters it holds with the weights one process gives the whole model from
    `seed` (plain or DTensor parameters alike; see forge.parallel.init.materialize_sharded)."""
    for part in parts:
        materialize_sharded(part, plain, seed, device)
