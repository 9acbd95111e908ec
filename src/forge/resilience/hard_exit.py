"""Leaving without Python's shutdown, after giving registered callbacks a bounded chance to run.

The watchdog (exit 76), a lost peer (exit 77) and an overdue preemption checkpoint (exit 75) end the process with
os._exit: a normal shutdown can hang in a collective or in a process group whose peer is gone. Callbacks still
get to mark tracker runs as failed and flush their files; each runs in a daemon thread that is abandoned after
`timeout_s`, so a hung callback cannot keep the process alive either.
"""

import logging
import os
import threading
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


def run_callbacks(code: int, timeout_s: float = 10.0) -> None:
    """Each registered callback (newest first) with `code`; failures are logged, stragglers abandoned."""
    for callback in reversed(list(_callbacks)):

        def call(callback=callback) -> None:
            try:
                callback(code)
            except Exception as err:  # noqa: BLE001 - we are leaving anyway; say what was not saved
                log.warning("before exit %d: %s failed: %s", code, getattr(callback, "__qualname__", callback), err)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            log.warning("before exit %d: %s still running after %.0f s; leaving it", code, callback, timeout_s)


def hard_exit(code: int, timeout_s: float = 10.0) -> NoReturn:
    run_callbacks(code, timeout_s)
    logging.shutdown()
    os._exit(code)
