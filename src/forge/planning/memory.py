"""The memory model of a run: peak bytes per rank from the layout, the model family's cost (forge.models.spec) and
the batch, what `--plan` prints and the layout search ranks by.

Peak memory per rank (bytes), with P the parameters this rank holds (its shards and stages):

    params 4P (fp32 master weights) + AdamW 8P (exp_avg, exp_avg_sq)
    + FSDP gather buffers in the compute dtype: 2 unsharded blocks (the one computing, the one prefetched) and the
      root unit's parameters (embedding, final norm, head), which FSDP keeps gathered from the forward to the end
      of the backward; so does DDP (dp_replicate > 1, dp_shard 1: FSDP2 over a shard group of one still copies the
      parameters into its gather buffers). Without FSDP, under bf16: 2P, the bf16 weights the step computes with
      (forge.train.compute_weights' copy in one process; autocast's casts, which the backward keeps, under tp or pp)
    + grads 4P + activations when the gradients exist at the start of a backward (gradient accumulation, or a
      1F1B pipeline); else the larger of the two (zero_grad sets them to None: they grow as the backward frees
      the activations)
    activations: in-flight micro-batch tokens T = micro_batch_size x seq_len (x the rank's in-flight share of the
      pipeline chunks: all under GPipe, min(chunks, pp - r) on 1F1B's rank r, and torch's warm-up plus one of its
      stage-chunks under interleaved 1F1B), one pipeline chunk's tokens T_c (T without a pipeline), the head's
      in-flight tokens T_h (T_c under a 1F1B schedule: the last stage runs each chunk's backward right after its
      forward; else T)
        no checkpointing:    T x L_r x block + T_h x head + T_c x head_grads
        full checkpointing:  T x L_r x d / tp + max(T_h x head + T_c x head_grads, T_c x block + (T_h - T_c) x head)
      where block = (7 d + 2 kv + 4 f) / tp (+ 2 d under tp: the all-gathered inputs of the attention and the MLP
      that their matmuls keep) times bytes, and on the last stage head = (2 d / tp (+ d under tp)) x bytes (final
      norm input and output) + what the loss keeps for its backward (+ V / tp x bytes: a pipeline stage keeps its
      output, the logits), and head_grads what lives only around one chunk's loss. Without tp the loss is forge's
      row-wise cross-entropy (forge.train.losses): it keeps the logits' gradient, V x bytes, made in its forward
      beside the logits (head_grads V x bytes), and frees the logits. Under tp, torch's vocabulary-parallel loss
      keeps the fp32 log-softmax, 4 V / tp, and its backward adds the fp32 gradients of the log-softmax and the
      logits and the exponentials, head_grads 12 V / tp. L_r are the
      rank's blocks, d the model width, kv the key/value width, f the MLP hidden width (in an MoE block the
      hidden width each token passes through: expert size x (top_k + shared experts), averaged over the
      blocks); a model.head_dim that sets the query width q apart from d counts 4 d + 3 q in place of 7 d;
      bytes = 2 under bf16 autocast, 4 in fp32. Under bf16 autocast a norm runs in fp32 and keeps an fp32 copy of
      its input: + 2 x 2 d / tp bytes per block and 2 d / tp before the head. Per block, autograd keeps: the two
      norms' inputs and outputs (4 d), q, k, v and the attention output for SDPA (2 d + 2 kv), the re-laid-out
      attention output fed to wo (d), and the SwiGLU's w1, w3, silu outputs and their product (4 f). An MoE block
      also keeps, whole on every tp rank (it routes the gathered sequence), the k token copies in expert order
      (k d x bytes), their expert outputs in fp32 (4 k d) and the router's fp32 logits, probabilities and scores
      (12 E bytes; the family's block_unsplit_bytes). Selective checkpointing is estimated as none.
    With parallel.ep > 1 a rank computes the rows routed to its experts, on average its own tokens' k copies.
    With context parallelism (cp > 1) T is the rank's seq_len / cp tokens, each block also keeps the other cp ranks'
    keys and values (+ 2 kv (cp - 1) per token). Under a dense mask (context parallelism, or document masking or
    a sliding window with SDPA) the boolean micro_batch_size x seq_len / cp x seq_len mask lives through the forward
    and each block's SDPA keeps a copy in the compute dtype (only the recomputed block's under full checkpointing).
    With deferred gradient sync under FSDP (parallel.defer_grad_sync=true, or null under a zero-bubble pipeline
    schedule: forge.config.degrees.defers_grad_sync) the gradients accumulate unsharded until the last micro-batch:
    grads 4P x dp_shard x cp (a rank's routed experts 4P x dp_shard / ep x cp under expert parallelism: their FSDP
    group); in a pipeline torch's stage then also keeps the stage's parameters gathered through the step, in place
    of the 2 gathered blocks (over replicas too, FSDP2's copies of them).
"""

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from forge.config.degrees import Degrees
from forge.config.schema import ZERO_BUBBLE, stages_per_rank
from forge.models.spec import spec_of


@dataclass
class MemoryEstimate:
    """Bytes per rank."""

    params: float
    grads: float
    optimizer: float
    gather_buffers: float
    activations: float
    activations_checkpointed: float
    grads_at_peak: bool = True
    """Gradients exist when the activations peak (at the start of a backward): from an earlier micro-batch or
    pipeline chunk. Without, the gradients (set to None each step) grow as the backward frees activations."""

    def peak(self, checkpointed: bool) -> float:
        acts = self.activations_checkpointed if checkpointed else self.activations
        live = self.grads + acts if self.grads_at_peak else max(self.grads, acts)
        return self.params + self.optimizer + self.gather_buffers + live


def pipeline_in_flight(pp: int, schedule: str, microbatches: int, pp_rank: int = 0, stages: int = 1) -> float:
    """Fraction of a micro-batch whose activations are alive at once on pipeline rank `pp_rank` (with `stages` per
    rank): all of it without a pipeline or under GPipe; torch's 1F1B runs pp - r forwards on rank r before its first
    backward, interleaved 1F1B interleaved_warmup's stage-chunks, and then one more (the steady state's forward comes
    before its backward); the zero-bubble schedules hold about pp chunks of the rank's blocks (their deferred weight
    gradients keep a chunk's inputs until they run: the peak of 1F1B's first rank, as ZB-H1 and ZB-V claim),
    DualPipeV one more (tests/planning/test_memory_measured.py checks zbv and interleaved_zb against the measured
    peak)."""
    if pp == 1 or schedule == "gpipe":
        return 1.0
    if stages == 1:
        return min(microbatches, pp - pp_rank) / microbatches
    if schedule in ZERO_BUBBLE:  # about pp chunks of the rank's blocks alive on every rank (ZB-H1, ZB-V, DualPipeV)
        return min(microbatches, pp + (schedule == "dualpipev")) / microbatches
    alive = interleaved_warmup(pp, microbatches, pp_rank, stages) + 1
    return min(stages * microbatches, alive) / (stages * microbatches)


def interleaved_warmup(pp: int, microbatches: int, pp_rank: int, stages: int) -> int:
    """The forwards torch's interleaved 1F1B runs on `pp_rank` before its first backward: (stages - 1) rounds of
    microbatches and two per hop from the last rank, at most every stage-chunk (ScheduleInterleaved1F1B)."""
    per_round = microbatches // max(1, microbatches // pp)
    return min((stages - 1) * per_round + 2 * (pp - 1 - pp_rank), stages * microbatches)


def bubble_fraction(pp: int, schedule: str, microbatches: int) -> float:
    """The pipeline bubble as a fraction of a rank's busy time: (pp - 1) / microbatches, divided by the stages per
    rank; the zero-bubble schedules fill two thirds of it with weight gradients (ZB-H1's (pp - 1)(F + B - 2W)
    against 1F1B's (pp - 1)(F + B + W), taking the forward, input-gradient and weight-gradient passes equal)."""
    if pp == 1:
        return 0.0
    fraction = (pp - 1) / microbatches / stages_per_rank(schedule)
    return fraction / 3 if schedule in ZERO_BUBBLE else fraction


def head_in_flight(pp: int, schedule: str, microbatches: int) -> float | None:
    """Fraction of a micro-batch whose head activations are alive at once: one chunk under a 1F1B schedule (the last
    stage runs each chunk's backward right after its forward), two under interleaved_zb (a chunk's deferred head
    weight gradient still holds its inputs when the next chunk's logits exist: 1.03 of the measured peak against
    0.84 with one; the V schedules measured 0.99 with one); None (as the blocks') otherwise."""
    if pp == 1 or schedule == "gpipe":
        return None
    return min(microbatches, 2 if schedule == "interleaved_zb" else 1) / microbatches


def estimate_memory(
    args,
    degrees: Degrees,
    local_params: int,
    rank_blocks: int,
    has_head: bool,
    micro_batch_size: int,
    seq_len: int,
    in_flight: float,
    act_bytes: int,
    deferred_sync: bool = False,
    dense_masks: bool = False,
    grads_at_peak: bool = True,
    chunks: int = 1,
    root_params: float = 0.0,
    local_experts: int = 0,
    head_share: float | None = None,
) -> MemoryEstimate:
    """The peak memory of the module docstring's formula. `dense_masks`: attention runs SDPA under a boolean mask
    (document masking, or a sliding window, without flex), which SDPA keeps converted to the compute dtype per
    block; context parallelism always does. `grads_at_peak`: see MemoryEstimate (forge.planning.memory's
    grads_at_peak tells it from the layout). `chunks`: the pipeline chunks of a micro-batch (a backward starts
    with one chunk's gradients of the logits). `root_params`: the parameters outside the blocks that this rank
    holds, per tp rank (embedding, final norm, head): FSDP's root unit, which stays gathered from the forward to the
    end of the backward. `local_experts`: the routed expert parameters among `local_params`; under deferred sync
    they accumulate unsharded over their own FSDP group, (dp_shard / ep_data) x cp ranks (Degrees.expert_shard).
    `head_share`: the fraction of a micro-batch whose head activations are alive (head_in_flight; None: `in_flight`)."""
    cp, tp = degrees.cp, degrees.tp
    tokens = micro_batch_size * seq_len * in_flight / cp
    head_tokens = tokens if head_share is None else micro_batch_size * seq_len * head_share / cp
    chunk_tokens = micro_batch_size * seq_len / cp / chunks
    gathered = 1 if tp > 1 else 0  # sequence parallel: each matmul keeps its all-gathered (whole) input
    # bytes per token: the final norm's input and output, and what the loss keeps for its backward (a pipeline
    # stage also keeps the logits, its output); a chunk's loss adds what lives only around it
    vocab = args.vocab_size / tp
    logits = vocab * act_bytes if degrees.pp > 1 else 0
    if tp > 1:  # torch's loss_parallel: the fp32 log-softmax; its backward's fp32 gradients and exponentials
        loss_kept, loss_around = 4 * vocab, 3 * 4 * vocab
    else:  # forge's row-wise cross-entropy: the logits' gradient, made in the forward beside the logits
        loss_kept, loss_around = vocab * act_bytes, vocab * act_bytes
    # under bf16 autocast a norm runs in fp32 and keeps an fp32 copy of its input: 2 per block, 1 before the head
    norm_upcast = args.dim / tp * (4 - act_bytes)
    head = ((2 * args.dim / tp + gathered * args.dim) * act_bytes + norm_upcast + loss_kept + logits) if has_head else 0
    head_grads = chunk_tokens * loss_around if has_head else 0
    # context parallel: SDPA keeps the whole sequence's keys and values (cp x the rank's own)
    cost = spec_of(args).cost
    block = (cost.block_activation_elems(args) + cost.saved_kv_width(args) * (cp - 1)) / tp + gathered * 2 * args.dim
    # a dense mask: the boolean (seq / cp x seq) mask per sample lives through the forward, and each block's SDPA
    # keeps a copy in the compute dtype (under full checkpointing only the recomputed block's)
    # one row per sample with documents or windows; without, the context-parallel mask is one row, broadcast
    rows = micro_batch_size * in_flight if dense_masks else 1
    sdpa = getattr(args, "attention", "sdpa") == "sdpa"  # flex's BlockMask is (seq / 128)^2 blocks: left out
    mask = rows * seq_len * seq_len / cp if sdpa and (dense_masks or cp > 1) else 0
    block_bytes = block * act_bytes + 2 * norm_upcast + cost.block_unsplit_bytes(args, act_bytes)
    full = tokens * rank_blocks * block_bytes + head_tokens * head + head_grads
    full += mask * (1 + rank_blocks * act_bytes)
    # full checkpointing: each block's input, then the head's backward, or one chunk's recomputed block beside
    # the other chunks' logits
    later = max(head_tokens * head + head_grads, chunk_tokens * block_bytes + (head_tokens - chunk_tokens) * head)
    ckpt = tokens * rank_blocks * args.dim / tp * act_bytes + later + mask * (1 + act_bytes)
    shard = degrees.fsdp_shard
    fsdp = fsdp_gathers(degrees)
    if fsdp:
        gather = (2 * cost.block_gather_params(args, degrees) / tp + root_params) * act_bytes
    else:  # the step computes with a bf16 copy of the weights it holds (forge.train.compute_weights in one process;
        # autocast's casts, which the backward keeps, under tp or pp alone); in fp32 with the weights themselves
        gather = local_params * act_bytes if act_bytes < 4 else 0
    grads = 4 * local_params
    if deferred_sync and fsdp:
        expert_shard = degrees.expert_shard if degrees.ep > 1 else shard
        unsharded = (local_params - local_experts) * shard + local_experts * expert_shard
        grads = 4 * unsharded
        if degrees.pp > 1:  # torch's stage keeps every block it gathered (over replicas too: FSDP2 copies them)
            gather = unsharded * act_bytes
    return MemoryEstimate(4 * local_params, grads, 8 * local_params, gather, full, ckpt, grads_at_peak)


def fsdp_gathers(degrees: Degrees) -> bool:
    """Whether FSDP gathers the parameters: over shards, and over replicas too (FSDP2 over (dp_replicate, 1) copies
    the parameters into its gather buffers all the same)."""
    return degrees.fsdp_shard > 1 or degrees.dp_replicate > 1


def grads_at_peak(
    micro_batches: int, pp: int, pp_schedule: str, chunks: int = 1, pp_rank: int = 0, stages: int = 1
) -> bool:
    """Whether gradients exist when the activations peak: an earlier micro-batch made them (gradient
    accumulation), or a pipeline chunk's backward did before a later chunk's forward. GPipe runs every forward
    first; torch's 1F1B runs pp - rank warm-up forwards on pipeline rank `pp_rank` (interleaved, with `stages` per
    rank: interleaved_warmup of its stages x chunks), so with chunks = pp the first rank too runs every forward
    before its first backward."""
    if micro_batches > 1:
        return True
    if pp == 1 or pp_schedule == "gpipe":
        return False
    forwards = stages * chunks
    if pp_schedule in ZERO_BUBBLE:  # each rank runs about pp forwards before its first backward
        return forwards > pp
    warmup = pp - pp_rank if stages == 1 else interleaved_warmup(pp, chunks, pp_rank, stages)
    return forwards > warmup


def uses_dense_masks(cfg: DictConfig) -> bool:
    """SDPA runs under a boolean mask: documents or a sliding window without flex (forge.models.common.attention)."""
    window = cfg.model.get("sliding_window")
    windowed = any(w is not None for w in (list(window) if OmegaConf.is_list(window) else [window]))
    documents = bool(cfg.data.get("document_masking", False))
    return cfg.model.get("attention", "sdpa") == "sdpa" and (documents or windowed)
