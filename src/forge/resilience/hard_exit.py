"""Leaving without Python's shutdown, after giving registered callbacks a bounded chance to run.

The watchdog (exit 76), a lost peer (exit 77) and an overdue preemption save (exit 75) end the process with
os._exit: a normal shutdown can hang in a collective or in a process group whose peer is gone. Callbacks still get
to mark tracker runs as failed; they run in a daemon thread that is abandoned once `timeout_s` (for all of them
together) has passed, and os._exit happens whatever they do.
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NoReturn

log = logging.getLogger("forge")

_callbacks: list[Callable[[int], None]] = []


def on_hard_exit(callback: Callable[[int], None]) -> Callable[[], None]:
    """Run `callback(exit_code)` before a hard exit; returns the function that unregisters it."""
    _callbacks.append(callback)

    def unregister() -> None:
        if callback in _callbacks:
            _callbacks.remove(callback)

    return unregister


def run_callbacks(code: int, timeout_s: float = 5.0) -> None:
    """Each registered callback (newest first) with `code`; failures are logged, stragglers abandoned."""
    deadline = time.monotonic() + timeout_s
    for callback in reversed(list(_callbacks)):

        def call(callback=callback) -> None:
            try:
                callback(code)
            except Exception as err:  # we are leaving anyway: say what was not done
                log.warning("before exit %d: %s failed: %s", code, getattr(callback, "__qualname__", callback), err)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(max(deadline - time.monotonic(), 0.0))
        if worker.is_alive():
            log.warning("before exit %d: callbacks still running after %.0f s; leaving them", code, timeout_s)
            return


def hard_exit(code: int, timeout_s: float = 5.0) -> NoReturn:
    """Run the callbacks (at most `timeout_s`), flush the logs, and leave with `code` no matter what fails."""
    try:
        run_callbacks(code, timeout_s)
        logging.shutdown()
    finally:
        os._exit(code)
