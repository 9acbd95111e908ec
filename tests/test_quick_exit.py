"""forge.quick_exit: a finished command's process ends without Python's teardown, but with what a normal exit
writes: the threads' work, the atexit handlers (logging's among them) and the buffered stdout."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, sys, threading, time
    from pathlib import Path
    from forge.quick_exit import quick_exit, run_then_quick_exit

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
    logging.basicConfig(filename=out / "log", level=logging.INFO)
    logging.info("the last line")
    sys.stdout.write("no newline yet")
    mode = sys.argv[2]
    if mode == "quick":
        quick_exit(3)
    elif mode == "returns":
        run_then_quick_exit(lambda: 5)
    elif mode == "raises":
        run_then_quick_exit(lambda: sys.exit(2))
    elif mode == "profiled":
        sys.setprofile(lambda *args: None)
        try:
            run_then_quick_exit(lambda: 4)
        finally:  # reached only when the exit unwinds the stack, as SystemExit does and os._exit does not
            (out / "unwound").write_text("yes")
    """
)


def run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    # a process that waits for ever (an idle pool's workers joined before the pool is told to stop) fails here
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True, timeout=60
    )


def test_quick_exit_keeps_what_a_normal_exit_writes_and_skips_the_teardown(tmp_path):
    done = run(tmp_path, "quick")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "no newline yet"
    assert (tmp_path / "thread").read_text() == "done"  # a non-daemon thread is waited for
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "the last line" in (tmp_path / "log").read_text()
    assert not (tmp_path / "teardown").exists()  # the modules were not torn down


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


def test_under_a_profiler_the_exit_is_pythons_so_the_profile_gets_written(tmp_path):
    done = run(tmp_path, "profiled")
    assert done.returncode == 4, done.stderr
    assert (tmp_path / "unwound").read_text() == "yes"
