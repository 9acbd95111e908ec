import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.forked_cli import SERVER_ENV, SERVER_PID_ENV

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("FORGE_CACHE_DIR", str(Path.home() / ".cache" / "forge"))
# Inductor compiles in this process (and in the runs it starts) instead of a pool of workers that each import
# torch again: on 2 cores the pool costs more than it saves, and a forked rank's pool could hang.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# OpenMP threads that wait for work sleep instead of spinning. The two pytest workers and the ranks they start
# share 2 cores: a spinning thread burns the core another process needs (two runs side by side are several times
# slower spinning, one run alone is not: benchmarks/train/omp_wait.py). Read once, when torch loads OpenMP: set
# here before any test imports torch, and inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def corpus():
    """The embedded corpus with the default 8k BPE (prepared once, cached)."""
    from forge.config.schema import EmbeddedDataConfig, options
    from forge.data.embedded import EmbeddedCorpus

    return EmbeddedCorpus(**options(EmbeddedDataConfig, cache_dir=os.environ["FORGE_CACHE_DIR"]))


FORKED_CLI = ROOT / "tests" / "forked_cli.py"


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory) -> Iterator[None]:
    """The warm process that forge_cmd's commands are forked from (tests/forked_cli.py); FORGE_TEST_FRESH=1 runs
    each in a fresh interpreter instead."""
    if os.environ.get("FORGE_TEST_FRESH") == "1":
        yield
        return
    path = tmp_path_factory.mktemp("fork_server") / "socket"
    log = path.with_name("server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.forked_cli", "--serve", str(path)], cwd=ROOT, stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not path.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the server binds first, then imports; clients wait in its queue
    if not path.exists() or server.poll() is not None:
        server.kill()
        pytest.fail(f"the fork server did not start: {path.with_name('server.log').read_text()[-3000:]}")
    os.environ[SERVER_ENV] = str(path)
    os.environ[SERVER_PID_ENV] = str(server.pid)
    try:
        yield
    finally:
        del os.environ[SERVER_ENV], os.environ[SERVER_PID_ENV]
        server.kill()
        server.wait()
        log.close()


def forge_cmd(*args: str) -> list[str]:
    """The forge-train command line: forked from the warm server when it runs (the command's own process, output
    and exit code; see tests/forked_cli.py), else `python -m forge.train` with this interpreter."""
    if os.environ.get(SERVER_ENV):
        return [sys.executable, str(FORKED_CLI), *args]
    return [sys.executable, "-m", "forge.train", *args]


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed, after checking it exited 2 with that line alone, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


SLURM_MODULES = {
    "tests/test_readme.py",
    "tests/launch/test_ray_launcher.py",
    "tests/launch/test_slurm.py",
    "tests/launch/test_sbatch.py",
    "tests/parallel/test_any_world.py",
}
"""Modules that use the one local SLURM cluster (the `slurm` session fixture starts and stops it), or start and stop
a Ray cluster (the README's `ray stop` stops every Ray on the machine): under pytest-xdist they run in one worker, one
after another, so two never start, stop or fill a cluster at once."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test` runs 2 workers): each module runs in one worker, in order (module fixtures are
    built once and the README's commands build on each other), and the SLURM modules share one worker. (xdist's
    own `--dist loadgroup` marks do not group under pytest 9: it renames node ids, which pytest 9 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "slurm" if module in SLURM_MODULES else module

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A module that uses the one cluster must be in SLURM_MODULES, or two workers could use it at once."""
    for item in items:
        module = item.nodeid.split("::")[0]
        if "slurm" in item.fixturenames and module not in SLURM_MODULES:
            raise pytest.UsageError(f"{module} uses the slurm fixture: add it to SLURM_MODULES in tests/conftest.py")
