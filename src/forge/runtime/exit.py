"""Leaving a finished command without the interpreter's teardown.

Once torch, DTensor and dynamo are imported, Python's finalization (clearing every module and freeing its objects)
costs every rank of every job a second or so of CPU after its work is done, and on a shared node the ranks'
teardowns compete for the cores (benchmarks/train/exit_cost.py measures it). A command run through `run_command` ends
with `sys.exit`, so Python does everything a normal exit does that writes or releases something: it unwinds the
stack (`finally` blocks, context managers), stops the thread pools and joins the non-daemon threads, then runs the
atexit handlers (logging's, multiprocessing's, temporary directories', the trackers'). The handler registered here,
before the command's imports register theirs, runs last of them (atexit runs handlers last in, first out); it
flushes logging and the standard streams and ends the process with the command's code before the modules are torn
down. Only public interfaces are used: atexit.register, sys.exit, logging.shutdown and os._exit.

An error raised by the command, and a run under a profiler or a debugger, keep Python's own exit.
"""

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from importlib import import_module
from typing import NoReturn

_finished_with: int | None = None
"""The code of a command that returned normally; None leaves the end of the process to Python."""


def _end_before_teardown() -> None:
    """The last atexit handler: after threads and every other handler, end the process with the command's code."""
    if _finished_with is None:
        return
    logging.shutdown()  # handlers registered before this one's would not run: flush and close logging's here
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream takes nothing more
            stream.flush()
    os._exit(_finished_with)


atexit.register(_end_before_teardown)


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Leave through Python's normal exit (stack unwound, threads joined, atexit handlers run) with `code`, skipping
    only the modules' teardown; under a profiler or a tracer (cProfile, a debugger) the teardown runs too."""
    global _finished_with
    if sys.getprofile() is None and sys.gettrace() is None:
        _finished_with = code
    sys.exit(code)


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """A console script's body: `main()`, then exit_without_teardown with the code it returned (None: 0); a
    SystemExit or an error raised by main leaves through Python's normal exit, with its code and traceback."""
    exit_without_teardown(main() or 0)


def run_command(module: str, name: str = "main") -> NoReturn:
    """Import `module` (after this module registered its exit handler, so the module's own handlers run before it),
    run its `name` and exit as run_then_exit does."""
    exit_without_teardown(getattr(import_module(module), name)() or 0)
