"""Each rank's last started step, kept in the job's key-value store, so that a watchdog that fires can say which
rank is behind instead of only that its own step is late.

A stalled rank holds the others inside a collective of the step it never joined; every rank's watchdog then fires
at about the same time. The ranks that started a later step than another are waiting for it: the board names the
ones behind.

The training step only records the number (`started`); a thread of the board's own writes it to the store over a
connection of its own (torch's store client is not safe to share between threads), so no step waits on a TCP round
trip to the store's host. The write follows within milliseconds, long before any watchdog fires.
"""

import datetime
import logging
import threading
from itertools import groupby

import torch.distributed as dist

log = logging.getLogger("forge")

_KEY = "forge/progress/{rank}"


def _tcp_store(store):
    """The TCPStore under the default store's prefixes, or None (a file or hash store: no server to connect to)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


class ProgressBoard:
    """A no-op in a single process (or without a TCP store to connect to)."""

    def __init__(self, timeout_s: float = 30.0):
        self.server: tuple[str, int] | None = None
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.latest: int | None = None  # the newest started step
        self.written: int | None = None  # the newest one in the store
        self.changed = threading.Condition()
        self.closed = False
        if dist.is_initialized() and dist.get_world_size() > 1:
            try:
                tcp = _tcp_store(dist.distributed_c10d._get_default_store())
            except (RuntimeError, ValueError) as err:  # no store: the watchdog names only its own rank
                tcp = None
                log.debug("no default store for the progress board: %s", err)
            if tcp is not None:
                self.server = (tcp.host, tcp.port)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.server is not None:
            threading.Thread(target=self._write_loop, name="forge-progress", daemon=True).start()

    def client(self) -> dist.TCPStore:
        """A connection of the calling thread's own to the job's store."""
        host, port = self.server
        return dist.TCPStore(host, port, is_master=False, timeout=self.timeout, wait_for_workers=False)

    def started(self, step: int) -> None:
        """Record that this rank started `step`; the board's thread writes it."""
        if self.server is not None:
            with self.changed:
                self.latest = step
                self.changed.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the newest started step is in the store; False if it is not within `timeout_s`."""
        with self.changed:
            return self.changed.wait_for(lambda: self.written == self.latest, timeout_s)

    def close(self) -> None:
        """Stop the board's thread (it drops its connection)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def _write_loop(self) -> None:
        """The board's thread: clear what an earlier attempt of the job left under this rank's key, then write each
        newest started step until closed."""
        key = _KEY.format(rank=self.rank)
        try:
            store = self.client()
            store.set(key, "")  # no step yet: a restarted job's store may still hold the last attempt's step
            while True:
                with self.changed:
                    self.changed.wait_for(lambda: self.closed or self.latest != self.written)
                    if self.closed:
                        return
                    step = self.latest
                store.set(key, str(step))
                with self.changed:
                    self.written = step
                    self.changed.notify_all()
        except Exception as err:  # the store's host is gone (rank 0 died, or the job ends): the board goes quiet
            log.warning("progress board: rank %d stopped reporting its steps: %s", self.rank, err)

    def last_started(self) -> dict[int, int | None]:
        """Each rank's last started step (None: not a step yet). Every board writes its key when it starts, so one
        check and one multi_get read them all; only when a rank never got that far is each key read on its own."""
        store = self.client()
        keys = [_KEY.format(rank=rank) for rank in range(self.world)]
        if store.check(keys):
            values = [value.decode() for value in store.multi_get(keys)]
        else:
            values = [store.get(key).decode() if store.check([key]) else "" for key in keys]
        return {rank: int(value) if value else None for rank, value in enumerate(values)}

    def report(self, timeout_s: float = 10.0) -> str:
        """One line on who is behind, read within `timeout_s` (the store may be gone with a dead rank 0)."""
        if self.server is None:
            return ""
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(describe(self.last_started())), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return result[0] if result else f"the ranks' progress could not be read within {timeout_s:g} s"


def describe(steps: dict[int, int | None]) -> str:
    """Which ranks have not started the newest step any rank started. Runs of ranks at the same step are shown as
    one range, so that 512 ranks with one behind make a short line."""
    runs = groupby(sorted(steps.items()), key=lambda item: item[1])  # neighbouring ranks at the same step
    shown = ", ".join(f"{rank_ranges([r for r, _ in run])}: {'-' if step is None else step}" for step, run in runs)
    started = [step for step in steps.values() if step is not None]
    if not started:
        return f"last started step per rank: {shown}"
    newest = max(started)
    behind = [rank for rank, step in sorted(steps.items()) if step is None or step < newest]
    if not behind:
        return (
            f"last started step per rank: {shown}; every rank started step {newest}, so the stall is inside it (a "
            "rank whose main thread is not in a collective is holding the others)"
        )
    who = ("rank " if len(behind) == 1 else "ranks ") + rank_ranges(behind)
    return f"last started step per rank: {shown}; {who} did not start step {newest} (stalled or dead before it)"


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges: [0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
