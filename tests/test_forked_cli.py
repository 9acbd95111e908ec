"""forge_cmd's fork of the warm server (tests/forked_cli.py) behaves as the command does in a fresh interpreter: the
same output and exit code, signals reach the command, and an environment the server's imports did not see gets a
fresh interpreter."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FORKED_CLI, ROOT, forge_cmd, one_line
from tests.faults.conftest import RUN
from tests.forked_cli import SERVER_ENV, SERVER_PID_ENV
from tests.tiny import losses


@pytest.fixture(autouse=True)
def server_runs() -> None:
    if not os.environ.get(SERVER_ENV):  # set by the session fixture fork_server
        pytest.skip("FORGE_TEST_FRESH=1: no fork server")


def cmdline(pid: int) -> list[str]:
    """The process's argv, once it has exec'd its program."""
    deadline = time.monotonic() + 30
    while not (argv := Path(f"/proc/{pid}/cmdline").read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.001)
    return argv.decode().split("\0")


def server_environment() -> dict[str, str]:
    """The environment the server started with (a test run in this worker before may have changed os.environ, and
    a command whose environment differs where the imports read it starts fresh)."""
    pid = os.environ[SERVER_PID_ENV]
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair) | {SERVER_ENV: os.environ[SERVER_ENV]}


def test_a_refused_config_prints_the_same_line_and_exit_code_as_a_fresh_interpreter(tmp_path):
    args = ["train.steps=-1", f"hydra.run.dir={tmp_path}"]
    forked = subprocess.run(forge_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=120)
    fresh = subprocess.run([sys.executable, "-m", "forge.train", *args], cwd=ROOT, capture_output=True, text=True)
    assert forge_cmd()[1] == str(FORKED_CLI)
    assert one_line(forked) == one_line(fresh)


def test_sigterm_reaches_the_command_which_checkpoints_and_exits_75(tmp_path):
    proc = subprocess.Popen(
        forge_cmd(*RUN, "train.steps=400", "checkpoint.interval=0", f"hydra.run.dir={tmp_path}"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=server_environment(),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while max(losses(tmp_path), default=0) < 3:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(proc.communicate()[0][-3000:])
        time.sleep(0.05)
    assert "forked_cli.py" in " ".join(cmdline(proc.pid))  # training, and still the client: forked, not fresh
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    assert max(losses(tmp_path)) < 400 and (tmp_path / "checkpoints").is_dir(), out[-3000:]


def test_an_environment_the_server_did_not_import_with_gets_a_fresh_interpreter(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2"}
    proc = subprocess.Popen(
        forge_cmd(*RUN, "train.steps=400", f"hydra.run.dir={tmp_path}"), cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "forked_cli.py" in " ".join(cmdline(proc.pid)):  # the client execs python -m forge.train
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        assert cmdline(proc.pid)[1:3] == ["-m", "forge.train"]
    finally:
        proc.kill()
        proc.wait()
