#!/usr/bin/env bash
# Launch forge-train on this node with torchrun: launchers/torchrun.sh NPROC [overrides...]
# Example: launchers/torchrun.sh 4 parallel=fsdp train.steps=100
set -euo pipefail
nproc=${1:?usage: launchers/torchrun.sh NPROC [overrides...]}
shift
exec torchrun --standalone --nproc_per_node="$nproc" -m forge.train "$@"
