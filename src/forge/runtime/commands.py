"""The console scripts (pyproject's [project.scripts]): each imports its command only when called, after
forge.runtime.exit registered the handler that ends a finished command without the interpreter's teardown."""

from forge.runtime.exit import run_command


def forge_train() -> None:
    """forge-train: compose, validate, train (forge.train.main)."""
    run_command("forge.train.main")


def forge_convert() -> None:
    """forge-convert: move a model between checkpoints, consolidated files and HF folders (forge.checkpoint.cli)."""
    run_command("forge.checkpoint.cli")


def forge_prepare_data() -> None:
    """forge-prepare-data: tokenize a corpus into shards (forge.data.cli)."""
    run_command("forge.data.cli")


def forge_generate() -> None:
    """forge-generate: sample from a trained model (forge.generate.cli)."""
    run_command("forge.generate.cli")


def forge_eval() -> None:
    """forge-eval: held-out loss and perplexity of a trained model (forge.generate.evaluate)."""
    run_command("forge.generate.evaluate")


def forge_sweep_report() -> None:
    """forge-sweep-report: a Hydra multirun, one row per point ranked by validation loss (forge.launch.sweep_report)."""
    run_command("forge.launch.sweep_report")
