"""forge.runtime.exit: a finished command's process ends without Python's teardown, but with what a normal exit
writes: the stack unwound, the threads' work, the atexit handlers (logging's, a temporary directory's) and the
buffered stdout."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    atexit.register(lambda: open(sys.argv[1] + "/early", "w").write("ran"))  # before the exit handler: runs after it
    from forge.runtime.exit import exit_without_teardown, run_command, run_then_exit  # first, as a console script
    import logging, tempfile, threading, time
    from pathlib import Path

    out = Path(sys.argv[1])

    class Finalized:
        def __del__(self):
            (out / "teardown").write_text("ran")

    KEPT = Finalized()  # freed only by the interpreter's teardown

    def late():
        time.sleep(0.3)
        (out / "thread").write_text("done")

    threading.Thread(target=late).start()
    from concurrent.futures import ThreadPoolExecutor
    POOL = ThreadPoolExecutor(2)  # never shut down, as torch.compile leaves its pool: its idle workers wait for work
    POOL.submit(time.sleep, 0.01).result()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    SCRATCH = tempfile.TemporaryDirectory()  # removed by weakref.finalize's atexit hook
    (out / "scratch").write_text(SCRATCH.name)
    logging.basicConfig(filename=out / "log", level=logging.INFO)
    logging.info("the last line")
    sys.stdout.write("no newline yet")

    def unwinding(code):
        try:
            exit_without_teardown(code)
        finally:  # reached only when the exit unwinds the stack, as SystemExit does and os._exit does not
            (out / "unwound").write_text("yes")

    mode = sys.argv[2]
    if mode == "quick":
        unwinding(3)
    elif mode == "returns":
        run_then_exit(lambda: 5)
    elif mode == "raises":
        run_then_exit(lambda: sys.exit(2))
    elif mode == "command":
        run_command("json", "dumps")  # an importable callable returning a truthy non-int is not a command's code
    elif mode == "traced":
        sys.settrace(lambda *args: None)
        unwinding(4)
    """
)


def run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    # a process that waits for ever (an idle pool's workers joined before the pool is told to stop) fails here
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True, timeout=60
    )


def test_a_finished_command_keeps_what_a_normal_exit_writes_and_skips_the_teardown(tmp_path):
    done = run(tmp_path, "quick")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "no newline yet"
    assert (tmp_path / "unwound").read_text() == "yes"
    assert (tmp_path / "thread").read_text() == "done"  # a non-daemon thread is waited for
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "the last line" in (tmp_path / "log").read_text()
    scratch = (tmp_path / "scratch").read_text()
    assert not __import__("os").path.exists(scratch)  # registered after the exit handler: ran before it
    assert not (tmp_path / "teardown").exists()  # the modules were not torn down
    assert not (tmp_path / "early").exists()  # why the console scripts import forge.runtime.exit before the command


def test_a_normal_exit_tears_down(tmp_path):
    """The control: the same script ending normally frees the module's object (so the check above can fail)."""
    done = run(tmp_path, "normal")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "teardown").read_text() == "ran"


def test_the_entry_point_exits_with_mains_code_and_leaves_an_error_to_python(tmp_path):
    assert run(tmp_path, "returns").returncode == 5
    assert not (tmp_path / "teardown").exists()
    raised = run(tmp_path, "raises")
    assert raised.returncode == 2
    assert (tmp_path / "teardown").read_text() == "ran"  # SystemExit went through Python's own exit


def test_under_a_profiler_or_a_tracer_the_exit_is_pythons(tmp_path):
    """cProfile writes its file after the script returns, a debugger keeps control to the end: both get Python's
    whole exit, teardown included."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    profile = tmp_path / "profile.out"
    done = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(profile), str(script), str(tmp_path), "returns"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # cProfile takes the SystemExit and writes its file
    assert profile.stat().st_size > 0
    traced = run(tmp_path, "traced")
    assert traced.returncode == 4, traced.stderr
    assert (tmp_path / "unwound").read_text() == "yes"
    assert (tmp_path / "early").read_text() == "ran"  # the process was not ended by the exit handler


def test_the_console_scripts_run_through_it_and_use_no_private_interface():
    """pyproject's commands are forge.runtime.commands' functions, and the runtime calls no private function of the
    standard library (atexit._run_exitfuncs, threading._shutdown)."""
    import re
    import tomllib
    from pathlib import Path

    import forge.runtime

    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("forge-train", "forge-convert", "forge-prepare-data", "forge-generate", "forge-eval"):
        assert scripts[name].startswith("forge.runtime.commands:"), name
    for source in Path(forge.runtime.__file__).parent.glob("*.py"):
        assert not re.search(r"\b(atexit|threading|sys|os)\._[a-z]", source.read_text().replace("os._exit", "")), source
