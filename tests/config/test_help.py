"""`forge-train --help` prints each field's value for this command beside a short description;
docs/reference/config.md, the whole reference, is generated from the same docstrings and is current."""

import subprocess
import sys

from forge.config import compose
from forge.config.help import field_help, page_path, reference_page, summary


def test_the_reference_page_is_current():
    """Regenerate with `python -m forge.config.help` when this fails."""
    assert page_path().read_text() == reference_page()


def test_the_help_shows_the_values_this_command_composes():
    default = field_help(_root_=compose([])).splitlines()
    assert "  optimizer.lr = 0.003 [> 0]: Peak learning rate." in default
    assert any(line.startswith("  model.max_seq_len = 1024 ") for line in default)  # the preset's, not the class's
    chosen = field_help(_root_=compose(["optimizer=lion", "model=gpt2_tiny", "train.steps=7"])).splitlines()
    assert any(line.startswith("  optimizer.lr = 0.0003 ") for line in chosen)  # Lion's schema
    assert any(line.startswith("  model.n_heads = 4 ") and "(HF n_head)" in line for line in chosen)  # GPT-2's docs
    assert any(line.startswith("  train.steps = 7 ") for line in chosen)


def test_a_long_description_is_cut_to_about_two_lines():
    long = "Pipeline schedule: " + ", ".join(f"kind {i}" for i in range(60)) + ". More."
    assert len(summary(long)) <= 170 and summary(long).endswith(" ...")
    assert summary("Peak learning rate (1e-3 or so). More detail.") == "Peak learning rate (1e-3 or so)."
    for line in field_help(_root_=compose([])).splitlines():
        assert len(line) <= 2 * 120 + 100, line  # name, value and domain, then the cut description


def test_the_help_command_prints_the_fields_not_the_composed_config():
    done = subprocess.run([sys.executable, "-m", "forge.train", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "train.steps = 250 " in done.stdout
    assert "== Composed config" not in done.stdout and "docs/reference/config.md" in done.stdout
    assert len(done.stdout.splitlines()) < 200
