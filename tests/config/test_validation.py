"""Every validation rule has a failing case whose message names the keys."""

import pytest

from forge.config import ConfigError, compose, validate

CASES = [
    (["+train.stpes=5"], 1, ["unknown config key(s) train.stpes"]),
    (["model=moe_tiny", "+model.moe.expert_count=4"], 1, ["unknown config key(s) model.moe.expert_count"]),
    (["+foo=bar"], 1, ["unknown top-level config key(s) foo"]),
    (["data=vqa_embedded"], 1, ["needs a vision-language model", "vlm=joint_decoder"]),
    (["vlm=mot"], 1, ["vlm is set but the data has no images"]),
    (["vlm=moma", "data=vqa_embedded", "parallel=tp2"], 2, ["parallel.tp=2 is not supported with a VLM"]),
    (["vlm=moma", "data=vqa_embedded", "parallel.compile=true"], 1, ["parallel.compile=true"]),
    (["vlm=joint_decoder", "data=vqa_embedded", "vlm.connector=avgpool"], 1, ["vlm.connector_tokens >= 1"]),
    (["vlm=joint_decoder", "data=vqa_embedded", "vlm.connector=conv"], 1, ["vlm.connector='conv'"]),
    (["vlm=joint_decoder", "data=video_embedded", "data.min_frames=8"], 1, ["data.max_frames=6"]),
    (["vlm=joint_decoder", "data=vqa_embedded", "data.on_bad_media=ignore"], 1, ["data.on_bad_media='ignore'"]),
    (["model.n_heads=5"], 1, ["model.dim=256", "model.n_heads=5"]),
    (["model.n_kv_heads=3"], 1, ["model.n_heads=8", "model.n_kv_heads=3"]),
    (["model.dim=264", "model.n_heads=8", "model.n_kv_heads=8"], 1, ["must be even for RoPE"]),
    (["model.n_layers=0"], 1, ["model.n_layers=0"]),
    (["train.seq_len=2048"], 1, ["train.seq_len=2048", "model.max_seq_len=1024"]),
    (["train.global_batch_size=12", "train.micro_batch_size=8"], 1, ["train.global_batch_size=12"]),
    (["train.global_batch_size=8", "train.micro_batch_size=8", "parallel=fsdp"], 2, ["data-parallel ranks=2"]),
    (["scheduler.warmup_steps=500", "train.steps=100"], 1, ["scheduler.warmup_steps=500", "train.steps=100"]),
    (["scheduler.warmup_steps=-1"], 1, ["scheduler.warmup_steps=-1"]),
    (["train.dtype=fp16"], 1, ["train.dtype='fp16'"]),
    (["train.device=tpu"], 1, ["train.device='tpu'"]),
    (["train.steps=0"], 1, ["train.steps=0"]),
    (["train.eval_every=-1"], 1, ["train.eval_every=-1"]),
    (["optimizer.lr=0"], 1, ["optimizer.lr=0"]),
    (["optimizer.betas=[1.5,0.9]"], 1, ["optimizer.betas=[1.5, 0.9]"]),
    (["optimizer.weight_decay=-0.1"], 1, ["optimizer.weight_decay=-0.1"]),
    (["optimizer.eps=0"], 1, ["optimizer.eps=0"]),
    (["optimizer=muon", "optimizer.momentum=1.0"], 1, ["optimizer.momentum=1.0"]),
    (["scheduler=warmup_cosine", "scheduler.min_lr_ratio=-1"], 1, ["scheduler.min_lr_ratio=-1"]),
    (["scheduler=warmup_cosine", "scheduler.min_lr_ratio=5"], 1, ["scheduler.min_lr_ratio=5"]),
    (["scheduler=wsd", "scheduler.decay_fraction=0"], 1, ["scheduler.decay_fraction=0"]),
    (["metrics.trackers=[tensorbord]"], 1, ["metrics.trackers='tensorbord'", "tensorboard"]),
    (["metrics.console=fancy"], 1, ["metrics.console='fancy'"]),
    (
        ["+metrics.tracker_configs.mine={_target_:no.such.Tracker}", "metrics.trackers=[mine]"],
        1,
        ["metrics.tracker_configs.mine._target_='no.such.Tracker' cannot be imported: No module named 'no'"],
    ),
    (
        ["+metrics.tracker_configs.mine={_target_:forge.metrics.logger.MetricsLogger}", "metrics.trackers=[mine]"],
        1,
        ["does not take the tracker keyword(s) run_id, config, project, run_name"],
    ),
    (["data=memmap"], 1, ["not set: data.path (the folder forge-prepare-data wrote), data.vocab_size"]),
    (["data=memmap", "data.path=/x"], 1, ["data.vocab_size is not set and cannot be read from data.path=/x"]),
    (["data=hf"], 1, ["not set: data.dataset, data.vocab_size (the tokenizer's vocabulary size)"]),
    (["model.vocab_size=1000"], 1, ["model.vocab_size=1000", "data.vocab_size=8192"]),
    (["parallel=tp2_fsdp"], 3, ["world size 3", "parallel.tp=2"]),
    (["parallel.dp_shard=2", "parallel.tp=2"], 2, ["= 4 does not equal the world size 2"]),
    (["parallel.dp_shard=-1", "parallel.tp=-1"], 4, ["only one parallel degree"]),
    (["parallel.dp_shard=0"], 1, ["parallel.dp_shard=0"]),
    (["parallel=tp2", "model.n_kv_heads=1"], 2, ["model.n_kv_heads=1", "parallel.tp=2"]),
    (["parallel=ep2_fsdp", "train.micro_batch_size=4"], 2, ["parallel.ep=2 needs an MoE model"]),
    (
        ["parallel=ep2_fsdp", "model=moe", "model.moe.num_experts=3", "model.moe.top_k=1", "train.micro_batch_size=4"],
        2,
        ["model.moe.num_experts=3", "parallel.ep=2"],
    ),
    (["parallel=fsdp", "parallel.ep=3", "model=moe", "train.micro_batch_size=4"], 2, ["parallel.ep=3 must divide"]),
    (
        ["parallel=hsdp", "parallel.ep=4", "model=moe", "train.micro_batch_size=2"],
        4,
        ["parallel.ep=4 must divide parallel.dp_shard=2", "data-parallel world size 4"],
    ),
    (["parallel=ep2_fsdp", "model=llama_tiny", "train.micro_batch_size=4"], 2, ["the model is dense"]),
    (["parallel.async_tp=true"], 1, ["parallel.async_tp=true with parallel.tp=1"]),
    (["parallel=tp2", "parallel.async_tp=true"], 2, ["parallel.async_tp=true with parallel.compile=false"]),
    (
        ["parallel=tp2", "parallel.async_tp=true", "parallel.compile=true", "train.device=cpu"],
        2,
        ["parallel.async_tp=true with train.device=cpu (symmetric memory needs CUDA GPUs"],
    ),
    (
        ["parallel=ep2_fsdp", "model=moe", "parallel.ep_spans_tp=true", "train.micro_batch_size=4"],
        2,
        [
            "parallel.ep_spans_tp=true needs parallel.tp > 1 and parallel.ep a multiple of it (got parallel.tp=1, "
            "parallel.ep=2"
        ],
    ),
    (
        ["parallel=tp2_fsdp", "model=moe", "parallel.ep=3", "parallel.ep_spans_tp=true", "model.moe.num_experts=6"],
        4,
        ["(got parallel.tp=2, parallel.ep=3;"],
    ),
    (
        ["parallel=tp2_fsdp", "model=moe", "parallel.ep=8", "parallel.ep_spans_tp=true"],
        4,
        ["parallel.ep=8 / parallel.tp=2 must divide parallel.dp_shard=2"],
    ),
    (["model=moe", "model.moe.aux_loss_scope=batch"], 1, ["model.moe.aux_loss_scope='batch'"]),
    (["model=moe", "model.moe.top_k=9"], 1, ["model.moe.top_k=9"]),
    (["model=moe", "model.moe.router=hash"], 1, ["model.moe.router='hash'"]),
    (["model=moe", "model.moe.num_experts=0"], 1, ["model.moe.num_experts=0"]),
    (["model=moe", "model.moe.every=0"], 1, ["model.moe.every=0"]),
    (["model=moe", "model.moe.first_dense=-1"], 1, ["model.moe.first_dense=-1"]),
    (["model=moe", "model.moe.first_dense=4", "model.n_layers=4"], 1, ["model.moe.first_dense=4 must be in 0..model"]),
    (["model=moe", "model.moe.route_scale=0"], 1, ["model.moe.route_scale=0"]),
    (["model=moe", "model.moe.expert_groups=8", "model.moe.groups_per_token=8"], 1, ["fewer than 2 experts"]),
    (["model=moe", "model.moe.expert_groups=3"], 1, ["model.moe.expert_groups=3 must divide"]),
    (["model=moe", "model.moe.expert_groups=2", "model.moe.groups_per_token=3"], 1, ["groups_per_token=3"]),
    (
        [
            "model=moe",
            "model.moe.expert_groups=8",
            "model.moe.groups_per_token=1",
            "model.moe.balanced_selection=false",
        ],
        1,
        ["fewer than 2 experts"],
    ),
    (
        ["model=moe", "model.moe.expert_groups=4", "model.moe.top_k=3", "model.moe.balanced_selection=false"],
        1,
        ["top_k=3 is more than the 2 experts"],
    ),
    (
        ["model=moe", "model.moe.expert_groups=4", "model.moe.groups_per_token=2"],
        1,
        ["balanced_selection with model.moe.expert_groups=4", "not the groups a token keeps"],
    ),
    (["model=moe", "model.moe.capacity_factor=-1"], 1, ["model.moe.capacity_factor=-1"]),
    (
        ["parallel=pp2", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=3", "train.micro_batch_size=4"],
        2,
        ["model.n_layers=3 cannot be split over the 4 pipeline stages", "parallel.pp=2", "each needs a block"],
    ),
    (["parallel=pp2", "model.n_layers=1", "train.micro_batch_size=4"], 2, ["cannot be split"]),
    (
        ["parallel=pp2_fsdp", "parallel.pp_schedule=zbv", "model.n_layers=4", "parallel.defer_grad_sync=false"],
        4,
        ["parallel.pp_schedule=zbv with parallel.defer_grad_sync=false under FSDP or DDP", "x dp_shard x cp = 2)"],
    ),
    (
        ["parallel=pp2", "parallel.pp_schedule=interleaved_zb", "model.n_layers=4", "parallel.compile=true"],
        2,
        ["parallel.pp_schedule=interleaved_zb with parallel.compile=true"],
    ),
    (
        ["parallel=pp2", "parallel.pp_schedule=dualpipev", "model.n_layers=4", "model.tie_embeddings=true"],
        2,
        ["parallel.pp_schedule=dualpipev with model.tie_embeddings=true"],
    ),
    (
        ["parallel=pp2", "train.micro_batch_size=6", "train.global_batch_size=6"],
        2,
        ["train.micro_batch_size=6", "parallel.microbatches=4"],
    ),
    (["parallel.activation_checkpoint=some"], 1, ["parallel.activation_checkpoint='some'"]),
    (["parallel.pp_schedule=zigzag"], 1, ["parallel.pp_schedule='zigzag'"]),
    (["checkpoint.async_mode=later"], 1, ["checkpoint.async_mode='later'"]),
    (["checkpoint.interval=-5"], 1, ["checkpoint.interval=-5"]),
    (["checkpoint.keep_last_n=0"], 1, ["checkpoint.keep_last_n=0"]),
    (["resilience.liveness_every_steps=-1"], 1, ["resilience.liveness_every_steps=-1"]),
    (["resilience.liveness_timeout_s=0"], 1, ["resilience.liveness_timeout_s=0"]),
    (["resilience.collective_timeout_s=-1"], 1, ["resilience.collective_timeout_s=-1"]),
    (
        ["resilience.inject_stall_rank=2", "parallel=fsdp", "train.micro_batch_size=4"],
        2,
        ["resilience.inject_stall_rank=2", "world size 2"],
    ),
    (
        ["resilience.fault_tolerance=torchft", "resilience.ft_replica_id=2", "resilience.ft_replicas=2"],
        1,
        ["resilience.ft_replica_id=2 is not a group of resilience.ft_replicas=2"],
    ),
    (
        ["resilience.fault_tolerance=torchft", "resilience.ft_replicas=2", "resilience.ft_min_replicas=3"],
        1,
        ["resilience.ft_min_replicas=3 exceeds resilience.ft_replicas=2"],
    ),
    (
        [
            "resilience.fault_tolerance=torchft",
            "resilience.ft_replicas=3",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
        ],
        1,
        [
            "train.global_batch_size=8 is not divisible by train.micro_batch_size=2 x data-parallel ranks=1 x "
            "resilience.ft_replicas=3"
        ],
    ),  # fmt: skip
    (
        ["resilience.fault_tolerance=torchft", "parallel=pp2", "train.micro_batch_size=4"],
        2,
        ["resilience.fault_tolerance=torchft with parallel.pp=2"],
    ),
    (["resilience.fault_tolerance=maybe"], 1, ["resilience.fault_tolerance='maybe'"]),
    (
        ["resilience.fault_tolerance=torchft", "resilience.nonfinite_policy=rollback", "checkpoint.interval=5"],
        1,
        ["resilience.fault_tolerance=torchft with resilience.nonfinite_policy=rollback"],
    ),
    (["resilience.fault_tolerance=torchft", "model=moe_tiny"], 1, ["resilience.fault_tolerance=torchft with an MoE"]),
    (["resilience.straggler_factor=0.5"], 1, ["resilience.straggler_factor=0.5 must be 0 (off) or > 1"]),
    (["loss=chunked_cross_entropy", "loss.chunk_size=0"], 1, ["loss.chunk_size=0"]),
    (["loss=chunked_cross_entropy", "parallel=tp2"], 2, ["loss=chunked_cross_entropy", "parallel.tp=2"]),
    (["loss=z_loss", "parallel=pp2", "train.micro_batch_size=4"], 2, ["loss.z_loss_weight=0.0001", "parallel.pp=2"]),
    (["train.steps=100000000"], 1, ["train.steps=100000000 must be in [1, 99999999]", "step-NNNNNNNN"]),
    (["train.threads=-3"], 1, ["train.threads=-3 must be >= 0"]),
    (["train.cpu_mmap_threshold_mib=64"], 1, ["train.cpu_mmap_threshold_mib=64 must be in [0, 32]"]),
    (["checkpoint.milestones=[50,500]", "train.steps=100"], 1, ["checkpoint.milestones has 500,", "train.steps=100"]),
    (["checkpoint.milestones=[0]"], 1, ["checkpoint.milestones=[0] has 0, which must be >= 1"]),
    (
        ["checkpoint.save_hf=true", "model=moe_tiny", "model.qk_norm=true", "model.moe.num_shared_experts=1"],
        1,
        ["checkpoint.save_hf=true: model.moe.num_shared_experts=1", "no Qwen3MoeForCausalLM equivalent"],
    ),
    (["model.head_dim=15"], 1, ["model.head_dim=15 must be even for RoPE"]),
    (["checkpoint.save_hf=true", "vlm=joint_decoder", "data=vqa_embedded"], 1, ["save_hf=true exports text"]),
    (["checkpoint.run_lock=maybe"], 1, ["checkpoint.run_lock"]),
    (["parallel.world_size=0"], 1, ["parallel.world_size=0 must be >= 1"]),
    (["data.val_every=0"], 1, ["data.val_every=0 must be >= 1"]),
    (["data.vocab_size=1"], 1, ["data.vocab_size=1 is too small", "data.tokenizer=bpe8k", "at least 257"]),
    (["data=embedded_gpt2", "data.vocab_size=50000"], 1, ["data.vocab_size=50000", "gpt2 has 50257"]),
    (["train.steps=${nope}"], 1, ["train.steps='${nope}' cannot be resolved", "'nope' not found"]),
    (["data.cache_dir=${oc.env:FORGE_NO_SUCH_VAR}"], 1, ["data.cache_dir='${oc.env:FORGE_NO_SUCH_VAR}'"]),
]


@pytest.mark.parametrize("overrides,world_size,fragments", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_rule_rejects(overrides, world_size, fragments):
    """Refused by the validation pass, or already at composition (a choice its Enum field does not have)."""
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=world_size)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_memmap_vocab_size_comes_from_the_folders_meta_json(tmp_path):
    (tmp_path / "meta.json").write_text('{"vocab_size": 300}')
    cfg = compose(["data=memmap", f"data.path={tmp_path}"])
    validate(cfg, 1)
    assert cfg.data.vocab_size == 300 and cfg.model.vocab_size == 300
    given = compose(["data=memmap", f"data.path={tmp_path}", "data.vocab_size=299"])
    validate(given, 1)
    assert given.data.vocab_size == 299  # a given value is kept (the corpus then refuses the mismatch, naming both)


def test_default_config_is_valid():
    degrees = validate(compose([]), world_size=1)
    assert degrees.dp == 1


def test_cuda_requested_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device=cuda"):
        validate(compose(["train.device=cuda"]), world_size=1)


def test_warm_start_from_a_weights_file_is_refused_before_the_model(tmp_path):
    """checkpoint.load_weights reads folders; a file used to be refused only once the model was built."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=f"checkpoint.load_weights={weights} is a file: .*forge-convert --to dcp"):
        validate(compose([f"checkpoint.load_weights={weights}"]), world_size=1)
