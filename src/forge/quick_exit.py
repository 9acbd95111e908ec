"""Leaving a finished command without the interpreter's teardown.

Once torch, DTensor and dynamo are imported, Python's finalization (clearing every module and freeing its objects)
takes ~0.9 s of CPU per process on a 2-core EPYC (`python -c "import forge.train.trainer"`: 4.0 s; the same
ending in os._exit: 3.1 s). Every rank of every job pays it after its work is done, and on a shared node the ranks'
teardowns compete for the cores. `quick_exit` does what a normal exit does that matters, then ends the process:
it stops thread pools and waits for the non-daemon threads (as interpreter shutdown does), runs the atexit
handlers (logging's flush and close, multiprocessing's cleanup, the process group's destroy, trackers' finish),
flushes stdout and stderr, and calls os._exit.

Only a command-line entry point calls it, after its work returned normally: an error, a profiler or a debugger
keeps Python's own exit.
"""

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def quick_exit(code: int = 0) -> NoReturn:
    """End the process with `code` after the parts of a normal exit that write or release something."""
    wait_for_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream takes nothing more
            stream.flush()
    os._exit(code)


def wait_for_threads() -> None:
    """What interpreter shutdown does first: run threading's own exit hooks, which tell thread pools to stop
    (concurrent.futures' workers wait for work until then: torch.compile leaves such a pool), then join the
    non-daemon threads."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    current = threading.current_thread()  # an interpreter without the hook: join, as before
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread.is_alive():
            thread.join()


def run_then_quick_exit(main: Callable[[], int | None]) -> NoReturn:
    """A console script's body: `main()`, then quick_exit with the code it returned (None: 0); a SystemExit or an
    error raised by main leaves through Python's normal exit, with its code and traceback. Under a profiler or a
    tracer (`python -m cProfile`, a debugger) the exit is Python's too: cProfile writes its file after the module
    returns, which os._exit would skip."""
    code = main() or 0
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    quick_exit(code)


def command(main: Callable[[], int | None]) -> Callable[[], NoReturn]:
    """The console-script entry point (pyproject's [project.scripts]) of a `main`: run_then_quick_exit(main)."""
    return lambda: run_then_quick_exit(main)
