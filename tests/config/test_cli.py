"""forge-train as a user runs it: bad input exits non-zero within seconds and writes no checkpoint."""

import subprocess
import sys

from tests.conftest import ROOT, forge_cmd


def run_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        forge_cmd(*args, f"hydra.run.dir={tmp_path / 'run'}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_nothing_written(tmp_path):
    run_dir = tmp_path / "run"
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "metrics.jsonl").exists()


def test_unknown_model_lists_options(tmp_path):
    result = run_cli(tmp_path, "model=nope")
    assert result.returncode != 0
    assert "Could not find 'model/nope'" in result.stderr
    for option in ("llama_tiny", "llama_125m", "llama3_8b", "moe"):
        assert option in result.stderr
    assert_nothing_written(tmp_path)


def test_wrong_type_names_key_and_type(tmp_path):
    result = run_cli(tmp_path, "train.steps=abc")
    assert result.returncode != 0
    assert "train.steps" in result.stderr and "Integer" in result.stderr
    assert_nothing_written(tmp_path)


def test_misspelled_key_is_named(tmp_path):
    result = run_cli(tmp_path, "train.stepz=3")
    assert result.returncode != 0
    assert "stepz" in result.stderr
    assert_nothing_written(tmp_path)


def test_invalid_combination_exits_2_with_one_line(tmp_path):
    result = run_cli(tmp_path, "model.n_heads=5")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "model.dim=256" in lines[0] and "model.n_heads=5" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert_nothing_written(tmp_path)
    assert not (tmp_path / "run").exists()  # the run directory Hydra made held nothing of ours: removed


def test_a_data_error_is_one_line_naming_the_folder(tmp_path):
    missing = tmp_path / "no-such-data"
    result = run_cli(tmp_path, "data=memmap", f"data.path={missing}", "data.vocab_size=300", "model.vocab_size=300")
    assert result.returncode == 1
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"forge-train: {missing} is not a prepared output (no meta.json); run forge-prepare-data"
    )
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr
    assert_nothing_written(tmp_path)


def test_a_warmup_set_longer_than_the_run_is_refused(tmp_path):
    """A preset's warmup is cut to a short run (README test); one the user sets with train.steps is an error."""
    result = run_cli(tmp_path, "scheduler.warmup_steps=10", "train.steps=4")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "scheduler.warmup_steps=10" in lines[0] and "train.steps=4" in lines[0], lines


def test_an_unknown_top_level_key_is_refused(tmp_path):
    """`+foo=bar` (or `+recipe=x` for a group not on the search path) used to be ignored."""
    result = run_cli(tmp_path, "+recipe=smoke")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip() and "warn" not in line.lower()]
    assert len(lines) == 1 and "unknown top-level config key(s) recipe" in lines[0], result.stderr


def test_a_sweep_of_bad_points_runs_none(tmp_path):
    """Every point is validated before the first runs: a sweep whose every point is refused runs nothing."""
    result = subprocess.run(
        forge_cmd("-m", "optimizer.lr=-1,-2", "train.steps=2", f"hydra.sweep.dir={tmp_path / 'sweep'}"),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("forge-train: invalid sweep: sweep point optimizer.lr=-1 "), lines
    assert "optimizer.lr=-1.0 must be > 0" in lines[0]
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").iterdir())


def test_an_unresolvable_interpolation_is_one_line_naming_its_key(tmp_path):
    """OmegaConf's error used to surface as a traceback from the first function that read the value."""
    result = run_cli(tmp_path, "train.steps=${nope}")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "train.steps='${nope}' cannot be resolved" in lines[0], lines
    assert "Traceback" not in result.stderr + result.stdout


def test_plan_refuses_a_world_size_of_zero(tmp_path):
    """`--plan parallel.world_size=0` used to plan for one rank as if the world size were unset."""
    result = run_cli(tmp_path, "--plan", "parallel.world_size=0")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallel.world_size=0 must be >= 1" in lines[0], lines
    assert "Traceback" not in result.stderr and "plan for" not in result.stdout


def test_a_world_size_other_than_the_launched_one_is_one_line(tmp_path):
    """`forge-train parallel.world_size=2` on one process used to reach the mesh and end in a traceback."""
    result = run_cli(tmp_path, "parallel.world_size=2", "train.steps=1")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallel.world_size=2, but 1 process was launched" in lines[0], lines
    assert "Traceback" not in result.stderr + result.stdout


def test_values_for_a_section_the_preset_leaves_null_are_one_line(tmp_path):
    """OmegaConf cannot merge into a typed section that is null (llama_tiny's rope_scaling); both forms of the
    override ended in its traceback. An experiment's YAML sets the section."""
    for override, key in (("model.rope_scaling={factor: 4.0}", "model.rope_scaling"),
                          ("model.rope_scaling.factor=4.0", "model.rope_scaling.factor")):  # fmt: skip
        result = run_cli(tmp_path, "--cfg", "job", override)  # run_cli adds hydra.run.dir, not named
        assert result.returncode == 2, result.stdout + result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"forge-train: invalid config: {key}: "), lines
        assert "YAML file" in lines[0]
        assert "Traceback" not in result.stderr + result.stdout
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "rope.yaml").write_text(
        "# @package _global_\nmodel:\n  rope_scaling:\n    factor: 4.0\n"
    )
    result = run_cli(tmp_path, "--cfg", "job", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=rope")
    assert result.returncode == 0 and "factor: 4.0" in result.stdout, result.stderr


def test_a_choice_its_enum_does_not_have_is_one_line_and_exit_2(tmp_path):
    """Refused at composition (an Enum field), printed like the validation pass's refusals, not as Hydra's four
    lines and exit 1; a wrong type the same way."""
    for override, expected in (
        ("parallel.activation_checkpoint=some", "parallel.activation_checkpoint='some' is not one of none, full"),
        ("train.steps=abc", "train.steps='abc': Value 'abc' of type 'str' could not be converted to Integer"),
    ):
        result = run_cli(tmp_path, override)
        assert result.returncode == 2, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("forge-train: invalid config: ") and expected in lines[0], lines
        assert not (tmp_path / "run").exists()


def imported_modules(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """forge-train's exit, and the modules it imported (Python's -X importtime lists each on stderr): a fresh
    interpreter, not forge_cmd's fork of one that imported torch already."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "forge.train", *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    names = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, names


def test_a_config_error_and_cfg_job_are_answered_without_importing_torch(tmp_path):
    """Composing and checking a config needs no torch (~2 s of a 2-core start-up): a typo is refused, and `--cfg
    job` prints, before it loads; a training run then imports it (the control, so the listing can fail)."""
    for args, code in ((["train.steps=-1"], 2), (["nonsense=1"], 2), (["--cfg", "job"], 0)):
        done, names = imported_modules(tmp_path, *args)
        assert done.returncode == code, done.stderr[-2000:]
        assert "hydra" in names and "forge.config.validate" in names
        assert not {n for n in names if n == "torch" or n.startswith("torch.")}, args
    done, names = imported_modules(tmp_path, "train.steps=1", "train.eval_batches=1", "model.n_layers=1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch" in names
