#!/usr/bin/env bash
# Tokens/s and MFU on one GPU (prepared for an H200), a few minutes in all, one table at the end:
#   1. a ~1B dense Llama (conf/model/llama3_1b.yaml), bf16 + per-block torch.compile; the layout search's
#      predicted step time for it beside the measured one (benchmarks/search/predict_one_gpu.py)
#   2. (run last) the same with float8 linear layers (parallel.fp8=true, needs torchao; skipped without it)
#   3. a small DeepSeek-V3-style MoE (conf/model/deepseek_v3_small.yaml), bf16, eager, then benchmarks/moe/speed.py
#      (MoE against its dense twin, with the step's profile); before them, the default
#      model compiled by blocks and as one graph (parallel.compile_scope), each without and with CUDA graphs
#      (parallel.cuda_graphs), and the suite's GPU-only tests
#   4. (CHUNKED=1) row 1 with loss=chunked_cross_entropy: the 128k-vocab logits never held at once
#   5-10. with 2 or more GPUs: FSDP with the bf16 policy, async save on NCCL, fp8 + FSDP, the small MoE under
#      tp2 and ep2 x FSDP, a lost NCCL peer
# First, the trainer's GPU health check (forge.resilience.health.check_device) on the GPU; CUDA or it stops; then
# the host syncs of a default-model step (benchmarks/train/host_syncs.py: none between log steps). After row 1,
# forge against transformers, eager and compiled, side by side at dim 256 and 1024 (benchmarks/train/
# vs_transformers.py --device cuda --lean: the CPU table's settings, GPU-sized batches; VS_HF_SHAPES), and the
# loss alone (benchmarks/train/rowwise_ce.py: torch's, forge's eager row-wise, compiled; time and memory).
#
#   make install-dev            # then a CUDA build of torch, e.g. pip install torch --index-url <CUDA wheel index>
#   bash benchmarks/gpu.sh      # DRY_RUN=1 only composes each command (--cfg job): a CPU check of the script
#
# Environment: PYTHON (.venv/bin/python), OUT_DIR (outputs/gpu_bench/<time>), STEPS (40), PEAK_TFLOPS (989, the
# H200's dense bf16 peak; MFU of the fp8 run is against it too), SEQ (2048), MICRO (8 sequences per step),
# RUN_TIMEOUT (420 s per run), BUDGET_S (no limit; else the script's whole time: each run is cut to what is left,
# and one is skipped when less than RUN_TIMEOUT/2 is left), CHUNKED (0), VS_HF_SHAPES (dim:layers:seq:batch ...,
# "256:4:2048:16 1024:4:2048:8"; empty: that table is skipped), SKIP (names of steps not to run, e.g.
# "dense_bf16_compile rowwise_ce": host_syncs, dense_bf16_compile (and its prediction), vs_transformers,
# rowwise_ce, small_compile, small_cuda_graphs, small_compile_model, small_cuda_graphs_model, gpu_tests, moe_bf16, moe_speed,
# dense_fp8_compile: for a device budget that leaves time for part of the script; the multi-GPU checks run
# wherever there are 2 GPUs).
# Each run logs every 10 steps to <run dir>/metrics.jsonl; the table averages the records after the first (the
# first interval holds compilation and warm-up). MFU = FLOPs/token (forge.planning.flops) x tokens/s / peak; the
# table also gives it against the bf16 matmul rate measured here first (8192^3 products on random data), which is
# what the card really reaches.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
OUT=${OUT_DIR:-outputs/gpu_bench/$(date +%Y%m%d-%H%M%S)}
STEPS=${STEPS:-40}
PEAK=${PEAK_TFLOPS:-989}
SEQ=${SEQ:-2048}
MICRO=${MICRO:-8}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"

if [ "$DRY_RUN" != 1 ]; then
    "$PY" - <<'EOF' || exit 1
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("benchmarks/gpu.sh needs a CUDA build of torch and a visible GPU")
props = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, {props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")

from forge.resilience.health import check_device  # the trainer's start-up check, on this GPU

check_device(torch.device("cuda", 0))
print("GPU health check passed (32 MiB read back, 256x256 matmul equal to the CPU's)")
EOF
    "$PY" - "$OUT/matmul_peak.txt" <<'EOF'
import sys

import torch

n, reps = 8192, 10
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
best = 0.0
for _ in range(5):
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    best = max(best, 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12)
open(sys.argv[1], "w").write(f"{best:.1f}\n")
print(f"measured bf16 matmul peak: {best:.0f} TFLOP/s ({n}^3, random data, best of 5 x {reps})")
EOF
    # A failed measurement only leaves that table column empty.
fi

COMMON=(
    train.device=cuda train.dtype=bf16 "train.steps=$STEPS" train.log_every=10 train.eval_every=0
    train.eval_batches=1 "train.seq_len=$SEQ" "train.micro_batch_size=$MICRO" "train.global_batch_size=$MICRO"
    scheduler.warmup_steps=5 checkpoint.interval=0 "metrics.peak_tflops=$PEAK" metrics.console=line
    optimizer.fused=true
    # timeout's SIGTERM must end an overlong run, not start a preemption checkpoint of a 1B model
    "resilience.preemption_signals=[]"
)
DENSE=(model=llama3_1b parallel.compile=true)
RUNS=()

# A step's time limit: RUN_TIMEOUT, cut to what BUDGET_S leaves; fails (printing what is left) under half of it.
time_limit() {
    local limit=${RUN_TIMEOUT:-420}
    if [ -n "${BUDGET_S:-}" ]; then
        local left=$((BUDGET_S - SECONDS))
        if [ "$left" -lt $((limit / 2)) ]; then
            echo "$left"
            return 1
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "$limit"
}

# Whether a step is wanted: not named in SKIP.
wanted() {
    case " ${SKIP:-} " in
    *" $1 "*)
        echo "=== $1: skipped (SKIP)"
        return 1
        ;;
    esac
    return 0
}

# A script step (not a training run): `bounded NAME CAP FILTER CMD...` runs CMD within the budget's time limit (at
# most CAP s) into $OUT/NAME.txt and prints the lines FILTER (an extended regex) keeps; nothing under DRY_RUN.
bounded() {
    local name=$1 cap=$2 filter=$3
    shift 3
    [ "$DRY_RUN" != 1 ] && wanted "$name" || return 0
    echo "=== $name: $PY $*"
    local limit
    if ! limit=$(time_limit); then
        echo "    skipped: $limit s of BUDGET_S left"
        return 0
    fi
    local code=0
    timeout -k 10 $((limit < cap ? limit : cap)) "$PY" "$@" >"$OUT/$name.txt" 2>&1 || code=$?
    grep -E "$filter" "$OUT/$name.txt" | sed 's/^/    /'
    return $code
}

run() {
    local name=$1
    shift
    wanted "$name" || return 0
    local args=("$@" "${COMMON[@]}" "hydra.run.dir=$OUT/$name")
    echo "=== $name: $PY -m forge.train ${args[*]}"
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" -m forge.train "${args[@]}" --cfg job >"$OUT/$name.cfg.yaml" 2>"$OUT/$name.log"
        local code=$?
        echo "    composed: exit $code ($OUT/$name.cfg.yaml)"
        return $code
    fi
    local limit
    if ! limit=$(time_limit); then
        echo "    skipped: $limit s of BUDGET_S left"
        echo skipped >"$OUT/$name.exit"
        RUNS+=("$name")
        return 0
    fi
    local start=$SECONDS
    timeout -k 10 "$limit" "$PY" -m forge.train "${args[@]}" >"$OUT/$name.log" 2>&1
    local code=$?
    echo "$code" >"$OUT/$name.exit"
    echo "    exit $code after $((SECONDS - start)) s (log: $OUT/$name.log)"
    tail -n 3 "$OUT/$name.log" | sed 's/^/    | /'
    RUNS+=("$name")
    return $code
}

failed=0
if [ "$DRY_RUN" != 1 ] && wanted host_syncs; then
    # Host syncs per step of the default model (issue 24): none between log steps, under CUDA's sync debug mode.
    echo "=== host_syncs: $PY benchmarks/train/host_syncs.py train.dtype=bf16 optimizer.fused=true"
    "$PY" benchmarks/train/host_syncs.py train.dtype=bf16 optimizer.fused=true >"$OUT/host_syncs.txt" 2>&1 || failed=1
    sed 's/^/    /' "$OUT/host_syncs.txt" | tail -n 20
fi
run dense_bf16_compile "${DENSE[@]}" || failed=1
# The layout search's prediction for this run (issue 23), beside its measured step time.
if [ -s "$OUT/dense_bf16_compile/metrics.jsonl" ] || [ "$DRY_RUN" = 1 ]; then
    "$PY" -m benchmarks.search.predict_one_gpu "$OUT/dense_bf16_compile/metrics.jsonl" "${DENSE[@]}" "${COMMON[@]}" \
        | tee "$OUT/search_prediction.txt" | sed 's/^/    /' || failed=1
fi
# forge (eager; blocks and loss compiled) against transformers (eager; whole model compiled), issue 24's table.
read -r -a VS_HF <<<"${VS_HF_SHAPES-256:4:2048:16 1024:4:2048:8}"
if [ "${#VS_HF[@]}" -gt 0 ]; then
    vs_args=(benchmarks/train/vs_transformers.py --device cuda --lean --steps 5 --peak-seconds 0.2 --profile 12)
    for shape in "${VS_HF[@]}"; do vs_args+=(--shape "$shape"); done
    bounded vs_transformers "${RUN_TIMEOUT:-420}" '^(\||dim|cpu flags)' "${vs_args[@]}" || failed=1
fi
# The loss alone: torch's, forge's eager row-wise and the compiled cross-entropy, time and memory.
bounded rowwise_ce 120 '^(\||[0-9]+ tokens)' benchmarks/train/rowwise_ce.py --device cuda --shape 32768:8192 \
    --shape 16384:128256 --repeats 10 || failed=1
# The default model (dim 256, 4 layers) compiled by blocks and as one graph (parallel.compile_scope=model), each
# without and with CUDA graphs (parallel.cuda_graphs): a step the host's kernel launches bound.
SMALL=(model.max_seq_len="$SEQ" parallel.compile=true)
run small_compile "${SMALL[@]}" || failed=1
run small_cuda_graphs "${SMALL[@]}" parallel.cuda_graphs=true || failed=1
# The suite's GPU-only tests (skipped on CPU machines, CI included): CUDA graphs, by blocks and as one graph,
# follow the launched run. Before the one-graph runs, so that a short budget keeps the correctness check.
bounded gpu_tests 300 '(passed|failed|error)' -m pytest -q -p no:cacheprovider tests/parallel/test_cuda_graphs.py \
    -k gpu || failed=1
run small_compile_model "${SMALL[@]}" parallel.compile_scope=model || failed=1
run small_cuda_graphs_model "${SMALL[@]}" parallel.compile_scope=model parallel.cuda_graphs=true || failed=1
run moe_bf16 model=deepseek_v3_small || failed=1
# MoE against its dense twin (same active FLOPs), grouped GEMMs against the per-expert loop, and the step's profile.
bounded moe_speed 300 '^(\||[0-9]\. |CPU flags)' benchmarks/moe/speed.py --device cuda --skip-ep --rounds 2 || failed=1
if [ "$DRY_RUN" = 1 ] || "$PY" -c "import torchao" 2>/dev/null; then
    run dense_fp8_compile "${DENSE[@]}" parallel.fp8=true || failed=1
else
    echo "=== dense_fp8_compile: skipped, torchao is not installed (pip install torchao)"
fi
if [ "${CHUNKED:-0}" = 1 ]; then
    run dense_bf16_compile_chunked_ce "${DENSE[@]}" loss=chunked_cross_entropy loss.chunk_size=4096 || failed=1
fi
if [ "$DRY_RUN" = 1 ]; then
    exit $failed
fi

# Multi-GPU checks (NCCL needs one GPU per rank; skipped with fewer than 2):
#   5. fsdp2_bf16_policy: the 1B model, FSDP over 2 GPUs, bf16 all-gathers and fp32 reduce-scatters (the policy)
#   6. fsdp2_async_save: the same, async checkpoint every 10 steps on its gloo group while NCCL trains; every
#      checkpoint must be sealed
#   7. fsdp2_fp8: float8 linears with float8 all-gathers under FSDP
#   8-9. moe_tp2, moe_ep2_fsdp: deepseek_v3_small with its latent attention heads and each expert's width split over
#      2 GPUs (the product's MoE TP path), and with its experts split over them (the all-to-all on NCCL);
#      tp2_async: the 1B model under tp2 with async TP (compiled, micro-pipelined over symmetric memory); with 4 or
#      8 GPUs, tp2_pp2_fsdp: the 3-D layout (tp 2 in each of 2 stages, x FSDP over the rest)
#   10. nccl_peer_lost: rank 1 is SIGKILLed mid-run; rank 0 must exit 77 naming it (NCCL async error handling) and
#      write its flight recorder of NCCL collectives to the run directory
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
COMMON2=("${COMMON[@]/#train.global_batch_size=*/train.global_batch_size=$((2 * MICRO))}")  # MICRO per rank
torchrun2() { NPROC=2 torchrun_n "$@"; }
torchrun_n() {
    local name=$1 nproc=${NPROC:-2}
    shift
    local args=("$@" "${COMMON2[@]/#train.global_batch_size=*/train.global_batch_size=$((nproc * MICRO))}"
                "hydra.run.dir=$OUT/$name")
    echo "=== $name: torchrun --nproc_per_node=$nproc -m forge.train ${args[*]}"
    timeout -k 10 "${RUN_TIMEOUT:-420}" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
        -m forge.train "${args[@]}" >"$OUT/$name.log" 2>&1
    local code=$?
    echo "$code" >"$OUT/$name.exit"
    echo "    exit $code (log: $OUT/$name.log)"
    RUNS+=("$name")
    return $code
}
if [ "$GPUS" -ge 2 ]; then
    torchrun2 fsdp2_bf16_policy model=llama3_1b parallel=fsdp || failed=1
    torchrun2 fsdp2_async_save model=llama3_1b parallel=fsdp checkpoint.async_mode=async checkpoint.interval=10 \
        || failed=1
    sealed=$(find "$OUT/fsdp2_async_save/checkpoints" -name COMPLETE 2>/dev/null | wc -l)
    echo "    sealed checkpoints: $sealed (want $((STEPS / 10)))"
    [ "$sealed" -eq $((STEPS / 10)) ] || failed=1
    if "$PY" -c "import torchao" 2>/dev/null; then
        torchrun2 fsdp2_fp8 model=llama3_1b parallel=fsdp parallel.fp8=true || failed=1
    fi
    torchrun2 moe_tp2 model=deepseek_v3_small parallel=tp2 || failed=1
    torchrun2 moe_ep2_fsdp model=deepseek_v3_small parallel=ep2_fsdp || failed=1
    torchrun2 tp2_async model=llama3_1b parallel=tp2 parallel.compile=true parallel.async_tp=true || failed=1
    if [ "$GPUS" -ge 4 ]; then  # 3-D: tp 2 inside each of 2 pipeline stages (x FSDP 2 on 8)
        NPROC=$((GPUS >= 8 ? 8 : 4)) torchrun_n tp2_pp2_fsdp model=llama3_1b parallel=tp2_pp2_fsdp || failed=1
    fi
    "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m forge.train model=llama3_1b parallel=fsdp \
        "${COMMON2[@]/#train.steps=*/train.steps=1000}" resilience.collective_timeout_s=60 "hydra.run.dir=$OUT/nccl_peer_lost" \
        >"$OUT/nccl_peer_lost.log" 2>&1 &
    launcher=$!
    sleep 90
    kill -9 "$(pgrep -P "$launcher" | sort -n | tail -n 1)"  # the second worker torchrun started: rank 1
    wait "$launcher"
    if grep -q "rank 1 did not answer a liveness check" "$OUT/nccl_peer_lost.log" \
        && "$PY" -c "import pickle, sys; e = pickle.load(open(sys.argv[1], 'rb'))['entries']; \
assert e and all(x['profiling_name'].startswith('nccl:') for x in e)" "$OUT/nccl_peer_lost/flight_recorder/rank_0"; then
        echo "=== nccl_peer_lost: rank 0 named the lost rank and wrote its NCCL flight recorder"
    else
        echo "=== nccl_peer_lost: FAILED, see $OUT/nccl_peer_lost.log"
        failed=1
    fi
else
    echo "=== multi-GPU checks (FSDP policy, async save on NCCL, fp8 + FSDP, MoE tp2 and ep2, NCCL peer lost): skipped, $GPUS GPU(s)"
fi

"$PY" - "$OUT" "${RUNS[@]}" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
peak_file = out / "matmul_peak.txt"
measured = float(peak_file.read_text()) if peak_file.exists() else float("nan")
print(f"\n| run | exit | params | tokens/s | TFLOP/s | MFU (datasheet) | MFU (measured {measured:.0f}) | peak mem (GiB) |")
print("|---|---|---|---|---|---|---|---|")
for name in names:
    code = (out / f"{name}.exit").read_text().strip()
    path = out / name / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steps = [r for r in records if "tokens_per_s" in r][1:]
    log = out / f"{name}.log"
    lines = log.read_text().splitlines() if log.exists() else []
    params = next((line.split("model ")[1].split(" parameters")[0] for line in lines if " parameters |" in line), "?")
    if not steps:
        print(f"| {name} | {code} | {params} | - | - | - | - | - |")
        continue
    mean = lambda key: statistics.mean(r[key] for r in steps if key in r) if any(key in r for r in steps) else float("nan")  # noqa: E731
    print(
        f"| {name} | {code} | {params} | {mean('tokens_per_s'):,.0f} | {mean('tflops_per_device'):.0f} | "
        f"{100 * mean('mfu'):.1f}% | {100 * mean('tflops_per_device') / measured:.1f}% | "
        f"{max(r.get('mem_peak_gib', 0.0) for r in steps):.1f} |"
    )
EOF
exit $failed
