"""Shell completion (Hydra's, through forge-train's own entry point): the install script, and the candidates a
bash completion query gets for a group, an option and a key."""

import os
import subprocess
import sys


def complete(line: str) -> list[str]:
    env = {**os.environ, "COMP_LINE": line, "COMP_POINT": str(len(line))}
    done = subprocess.run([sys.executable, "-m", "forge.train", "-sc", "query=bash"], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_bash_script_installs_a_completion_function():
    done = subprocess.run([sys.executable, "-m", "forge.train", "--shell-completion", "install=bash"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "hydra_bash_completion()" in done.stdout and "complete -o nospace -o default -F" in done.stdout


def test_groups_options_and_keys_complete():
    assert "model=llama3_8b" in complete("forge-train model=ll")
    assert "experiment=llama3_8b_h100" in complete("forge-train experiment=")
    assert "debug=overfit" in complete("forge-train debug=o")
    assert any(word.startswith("train.steps=") for word in complete("forge-train train.st"))
