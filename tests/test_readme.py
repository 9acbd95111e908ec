"""Every command of the README and of the docs pages runs as written, so neither can drift from the code.

The README's commands (its ```bash blocks) run first, then each docs page's in the order
of the site's nav; a command that appears twice runs once. They run in order, in one scratch directory (relative
paths such as outputs/ and shards/ land there), through bash with this venv first on PATH. Training commands get a
short run appended (`SHORT`, one validation batch for the runs that set their own short length, and `SMALLER`
batches for the 125M preset); nothing else is changed.
The inputs a user brings (their jsonl corpus, captions with images, a local vision tower, an image to ask about) are
written into the scratch directory first. A command that cannot run here is listed in NOT_RUN with the reason and
the test that covers it instead; any other command that is not run fails the listing test.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docs.pages import DOCS, nav_pages
from tests.launch.conftest import slurm  # noqa: F401 - the local cluster, for the local_slurm commands

pytestmark = [pytest.mark.slow, pytest.mark.dist]

SHORT = "train.steps=1 train.eval_batches=1"
"""Appended to each training command: one step and one validation batch."""

SMALLER = {"forge-train model=llama_125m": "train.seq_len=64 train.global_batch_size=2"}
"""Appended after SHORT where one step of the command's own batch takes long on 2 cores: its preset still
composes, and its whole model is still built, initialised and stepped."""

PROGRAMS = {
    "forge-train", "forge-generate", "forge-eval", "forge-lm-eval", "forge-prepare-data", "forge-convert",
    "forge-plot", "forge-sweep-report", "torchrun", "launchers/torchrun.sh", "python", "make", "bash", "mkdir",
    "sbatch", "ray",
}  # fmt: skip
"""A README block is a command block when its first line starts with one of these (after VAR=value words)."""

NOT_RUN = {
    "make test": "the suite itself (CI runs it through .ci/run)",
    "forge-train -m hydra/launcher=slurm ": "needs a GPU partition; the same sweep runs below with local_slurm",
    "FORGE_RUN_DIR=outputs/my-run sbatch --nodes=2": "needs two GPU nodes; tests/launch/test_sbatch.py submits "
    "launchers/slurm.sbatch to the local cluster",
    "bash launchers/local-slurm/start-slurm.sh": "run by the `slurm` fixture, which the local_slurm commands use",
    "forge-train debug=overfit": "tests/train/test_debug_presets.py runs it and checks the loss falls below 0.5",
    "torchrun --nproc_per_node=2 -m forge.train parallel=cp2 model.attention=flex": "tests/parallel/test_context_"
    "parallel.py runs cp2 with flex attention, document masking and a sliding window against one process",
    "forge-train debug=profile": "tests/train/test_debug_presets.py::test_profile_writes_a_trace runs it and reads "
    "the trace back",
}

EXPECT = {
    "forge-train train.steps=4": "warmup cut to 4 steps",
    "forge-train hydra.searchpath=": "warmup cut to 4 steps",  # the experiment's train.steps: 4 applied
    "forge-train experiment=llama3_8b_h100 --plan": ("plan for 8 ranks", "model 8.030B parameters"),
    "forge-train debug=fast": "done: 5 steps",
    "forge-train hparams_search=lr_optuna": "Best value: ",
    "forge-train -m hydra/launcher=ray_cluster": "Connected to Ray cluster",
    "forge-train -m hydra/launcher=torchrun": "Launching 2 jobs under torchrun, 2 processes each",
    "forge-sweep-report multirun/lr": ("optimizer.lr=0.003 debug=fast", "wrote multirun/lr/sweep_report.csv"),
    "forge-train --plan --search": "winner: parallel.dp_replicate=",  # before its prefix: the first match counts
    "torchrun --nproc_per_node=2 -m forge.train --calibrate": "device profile: ",
    "torchrun --nproc_per_node=2 -m forge.train parallel=cp2": "context parallel over 2 ranks",
    "forge-train --plan model=llama3_70b parallel=tp2_pp2_fsdp": (
        "plan for 512 ranks",
        "mesh: {'pp': 4, 'dp_shard': 16, 'tp': 8}",
    ),
    "forge-train --plan": "plan for 32 ranks",
    "forge-train --help": (
        "== Config groups",
        "model:",
        "parallel:",
        "data:",
        "optimizer:",
        "scheduler:",
        "train:",
        "checkpoint:",
        "metrics:",
        "llama_tiny",
        "tp2_fsdp",
        "train.steps = 250 [in [1, 99999999] (a checkpoint folder name, step-NNNNNNNN, holds 8 digits)]: "
        "Optimizer steps.",
        "optimizer.lr = 0.003 [> 0]: Peak learning rate.",
    ),
    "forge-train --cfg job model=moe parallel=tp4_fsdp": ("num_experts: 8", "tp: 4"),
    "python -c": "torch.Size([1, 3, ",
}
"""Output a command must print (one string or all of a tuple), besides exiting 0."""

EXPECT_NOT = {"forge-train --help": "model_schema"}
"""Output a command must not print: the help lists the config groups a user picks, not the schemas behind them."""

COMMENT = re.compile(r"\s{2,}#.*$")


def program(command: str) -> str:
    words = [w for w in command.split() if not re.match(r"^[A-Z_]+=", w)]
    return words[0] if words else ""


def fenced_bash_blocks(text: str) -> list[list[str]]:
    """A docs page's ```bash blocks, each a list of its non-empty lines."""
    blocks, current = [], None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None and stripped in ("```bash", "```sh"):
            current = []
        elif current is not None and stripped.startswith("```"):
            blocks.append(current)
            current = None
        elif current is not None and stripped:
            current.append(stripped)
    return blocks


def block_commands(blocks: list[list[str]]) -> list[str]:
    """Every line of every command block, trailing comments removed."""
    commands = []
    for block in blocks:
        if program(block[0]) not in PROGRAMS:
            continue  # a file's contents (YAML) or a table
        for line in block:
            command = COMMENT.sub("", line).strip()
            if command and not line.lstrip().startswith("#"):
                commands.append(command)
    return commands


def page_commands(text: str) -> list[str]:
    """A page's commands; every line of a ```bash block must be one (else it reads `<not a command> ...`)."""
    commands = []
    for block in fenced_bash_blocks(text):
        commands += block_commands([block]) or [f"<not a command> {block[0]}"]
    return commands


def readme_commands() -> list[str]:
    return page_commands((ROOT / "README.md").read_text())


def docs_commands() -> list[str]:
    """Each docs page's commands, in the nav's order; every line of a ```bash block must be a command."""
    commands = []
    for page in nav_pages():
        if not (DOCS / page).exists():
            continue  # tests/docs/test_site.py names it
        commands += page_commands((DOCS / page).read_text())
    return commands


COMMANDS = list(dict.fromkeys(readme_commands() + docs_commands()))


def not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


def as_run(command: str) -> str:
    """The command with a short run appended where it trains."""
    if command == "make train":
        return f'make train ARGS="{SHORT}"'
    trains = program(command) in ("forge-train", "torchrun", "launchers/torchrun.sh")
    if not trains or any(flag in command for flag in ("--cfg", "--help", "--plan", "--calibrate")):
        return command  # nothing to shorten
    steps = re.search(r"train\.steps=(\d+)", command)
    if "experiment=smoke" in command or "debug=" in command or (steps and int(steps.group(1)) <= 4):
        return f"{command} train.eval_batches=1"  # a run that sets its own (short) length: a smoke or debug run
    smaller = next((extra for prefix, extra in SMALLER.items() if command.startswith(prefix)), "")
    return f"{command} {SHORT} {smaller}".rstrip()


def write_user_inputs(scratch: Path) -> None:
    """What a user brings: a jsonl corpus, captions with images, a local SigLIP folder, an image to ask about."""
    from forge.data.embedded import read_scenes
    from forge.data.tokenizer import package_dir
    from forge.models.vlm.encoder import build_tiny_encoder

    (scratch / "corpus").mkdir()
    scenes = read_scenes()[:120]
    (scratch / "corpus" / "plays.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in scenes))
    images = package_dir("easy_vqa") / "data" / "train" / "images"
    rows = []
    for i in range(24):
        shutil.copy(images / f"{i}.png", scratch / f"photo{i}.png")
        rows.append(json.dumps({"image": f"photo{i}.png", "text": f"a picture of shape {i % 3}"}))
    (scratch / "captions.jsonl").write_text("\n".join(rows) + "\n")
    shutil.copy(images / "0.png", scratch / "shape.png")
    build_tiny_encoder(scratch / "siglip", "siglip")
    for name in ("launchers", "Makefile", "pyproject.toml", "README.md"):  # make reinstalls from a newer pyproject
        (scratch / name).symlink_to(ROOT / name)
    (scratch / ".venv").symlink_to(Path(sys.executable).parent.parent)


@pytest.fixture(scope="module")
def ray_stopped_after() -> Iterator[None]:
    """The Ray cluster a README command starts is stopped at the end of the module, whether its `ray stop` ran."""
    yield
    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("readme")
    write_user_inputs(path)
    return path


def test_every_command_is_run_or_says_why_not():
    assert len(readme_commands()) >= 2 and len(COMMANDS) > 20, COMMANDS  # the parsers found the blocks
    for command in COMMANDS:
        assert program(command) in PROGRAMS, f"a command with an unknown program: {command}"
    for prefix in [*NOT_RUN, *EXPECT]:
        assert any(c.startswith(prefix) for c in COMMANDS), f"{prefix!r} is in no command of the README or the docs"


@pytest.mark.parametrize("command", COMMANDS)
def test_command_runs(command, scratch, request):
    reason = not_run_reason(command)
    if reason:
        pytest.skip(reason)
    if "hydra/launcher=local_slurm" in command:
        request.getfixturevalue("slurm")
    if command.startswith("ray start"):
        request.getfixturevalue("ray_stopped_after")
    if command == "make train" and not (scratch / ".venv" / ".installed").exists():
        pytest.skip("this venv was not made by `make install`")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    proc = subprocess.run(
        ["bash", "-c", as_run(command)], cwd=scratch, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{as_run(command)}\nexit {proc.returncode}\n{out[-4000:]}"
    expected = next((text for prefix, text in EXPECT.items() if command.startswith(prefix)), ())
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in out, f"{command}: {text!r} not in the output\n{out[-3000:]}"
    unexpected = next((text for prefix, text in EXPECT_NOT.items() if command.startswith(prefix)), None)
    assert unexpected is None or unexpected not in out, f"{command}: {unexpected!r} in the output"
