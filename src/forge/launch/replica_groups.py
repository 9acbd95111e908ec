"""Replica groups on one machine: torchft's lighthouse, then one torchrun job per group, each restarted in place
when one of its ranks dies (torchrun's --max-restarts), rejoining the others from a live group's state.

    python -m forge.launch.replica_groups --groups 2 --nproc-per-group 2 --run-dir runs/ft -- train.steps=100

Group k trains in RUN_DIR/replica_<k> with resilience.fault_tolerance=torchft, ft_replica_id=k, ft_replicas=groups.
The exit code is the largest of the groups'. On a cluster, start the lighthouse once and one job per group with the
same overrides (TORCHFT_LIGHTHOUSE pointing at it).
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def lighthouse_command(port: int, min_replicas: int, heartbeat_timeout_ms: int) -> list[str]:
    """torchft's lighthouse: a quorum each tick (quorum_tick_ms=100), joiners awaited a second (join_timeout_ms), a
    group silent for heartbeat_timeout_ms left out (the others' wait after a loss)."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    binary = str(binary) if binary.exists() else shutil.which("torchft_lighthouse")
    if binary is None:
        raise SystemExit("forge.launch.replica_groups: torchft_lighthouse not found (pip install 'forge-train[ft]')")
    return [binary, "--bind", f"0.0.0.0:{port}", "--min_replicas", str(min_replicas), "--quorum_tick_ms", "100",
            "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]  # fmt: skip


def group_overrides(group: int, args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """Group `group`'s forge-train overrides: the user's, then its place among the groups."""
    return [*overrides, "resilience.fault_tolerance=torchft", f"resilience.ft_replica_id={group}",
            f"resilience.ft_replicas={args.groups}", f"resilience.ft_min_replicas={args.min_replicas}"]  # fmt: skip


def group_command(group: int, args: argparse.Namespace, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc_per_group}",
            f"--max-restarts={args.max_restarts}", "-m", "forge.train", *group_overrides(group, args, overrides),
            f"hydra.run.dir={Path(args.run_dir) / f'replica_{group}'}"]  # fmt: skip


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m forge.launch.replica_groups", description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2, help="replica groups (torchrun jobs)")
    parser.add_argument("--nproc-per-group", type=int, default=1, help="ranks per group")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts of each group (torchrun's)")
    parser.add_argument("--min-replicas", type=int, default=1, help="groups a step needs to commit")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="when a silent group is left out")
    parser.add_argument("--run-dir", required=True, help="each group trains in RUN_DIR/replica_<k>")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def refusal(args: argparse.Namespace, overrides: list[str]) -> str | None:
    """Why group 0's config is refused (every group's differs only in its id and run dir), before anything starts."""
    from forge.config import ConfigError, compose, validate

    try:
        validate(compose(group_overrides(0, args, overrides)), world_size=args.nproc_per_group)
    except ConfigError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(argv)
    refused = refusal(args, overrides)
    if refused:
        print(f"forge.launch.replica_groups: invalid config: {refused}", file=sys.stderr)
        return 2
    port = free_port()
    quiet = {"RUST_LOG": "warn", **os.environ}  # torchft's lighthouse and managers log every quorum at INFO
    lighthouse = subprocess.Popen(lighthouse_command(port, args.min_replicas, args.heartbeat_timeout_ms), env=quiet)
    threads = max(1, (os.cpu_count() or 1) // (args.groups * args.nproc_per_group))  # the groups share the cores
    env = {"OMP_NUM_THREADS": str(threads), **quiet}
    env["TORCHFT_LIGHTHOUSE"] = f"http://localhost:{port}"
    groups = [subprocess.Popen(group_command(k, args, overrides), env=env) for k in range(args.groups)]
    try:
        return max(group.wait() for group in groups)
    finally:
        for group in groups:
            if group.poll() is None:
                group.terminate()
        lighthouse.terminate()
        lighthouse.wait()


if __name__ == "__main__":
    sys.exit(main())
