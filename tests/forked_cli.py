"""`forge-train` forked from a warm process, for the tests that run its command line.

A fresh `python -m forge.train` spends seconds of CPU importing torch, DTensor, dynamo and Hydra before it reads its
arguments, and the suite runs it hundreds of times on 2 cores. A server (one per pytest worker, started by
tests/conftest.py) imports all of that once. This file run as a script is the client a test starts instead of
`python -m forge.train`: it passes its arguments, working directory, environment and standard streams over a unix
socket; the server forks a child that runs `forge.train` as `python -m` would, in that directory, with that
environment and those streams; the child's exit status comes back and the client exits with it. Signals sent to the
client are passed on to the child, and a killed client takes the child (and what it started) with it. So a test
still starts a process, reads what it printed and its exit code; only the imports are shared.

The client runs the command in a fresh interpreter instead when there is no server, or when its environment differs
from the server's in a variable outside FREE_ENV (torch and Hydra read some variables once, when imported).
Only the standard library is imported here before the server forks: the client must start in milliseconds.
"""

import contextlib
import json
import os
import signal
import socket
import sys

SERVER_ENV = "FORGE_TEST_FORK_SERVER"
"""The server's socket path, set in the pytest worker's environment while the server runs."""
SERVER_PID_ENV = "FORGE_TEST_FORK_SERVER_PID"
"""Its process id (/proc/PID/environ: the environment it started with)."""

FREE_ENV = ("PYTHONUNBUFFERED", "PYTEST_", "FORGE_", "HYDRA_FULL_ERROR", "SLURM_", "WANDB_", "MLFLOW_", "HF_XET_")
"""Prefixes of the variables a command's environment may set otherwise than the server's: read when a run reads
them, not when a module is imported."""
RUNTIME_ENV = {
    *("_", "PWD", "OLDPWD", "SHLVL"),
    *("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    *("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "CUBLAS_WORKSPACE_CONFIG"),
}
"""What a shell sets for the commands it starts, and what torch reads when a process group is made (forge sets
some of them in the process that runs an in-process test)."""

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
MESSAGE = 1 << 20


def fresh(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "forge.train", *args])


def client(args: list[str]) -> None:
    path = os.environ.get(SERVER_ENV)
    if not path:
        fresh(args)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError:
        fresh(args)
    request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(sock, [request], [0, 1, 2])
    reply = sock.recv(MESSAGE).decode().split()
    if reply in ([], ["fresh"]):  # the server went before starting the command, or cannot run it
        sock.close()
        fresh(args)
    child = int(reply[1])  # "pid N"
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: forward(child, sig))
    reply = sock.recv(MESSAGE).decode().split()
    if not reply:  # the server's watcher is gone
        os._exit(1)
    how, number = reply[0], int(reply[1])
    if how == "signal":
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's disposition cannot be set; it kills all the same
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(number)


def forward(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile; its status is on its way
        os.kill(pid, sig)


def changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return set(a) ^ set(b) | {key for key in a if key in b and a[key] != b[key]}


def differing_environment(env: dict[str, str], started: dict[str, str], imported: dict[str, str]) -> list[str]:
    """The variables of `env` that the server's imports could have read otherwise. A variable its imports set
    (`imported`) may hold the value they set: a fresh run sets the same before its imports (forge.runtime.host_memory's
    huge-page switch)."""
    keys = changed(env, started) - RUNTIME_ENV
    return sorted(k for k in keys if not k.startswith(FREE_ENV) and not (k in imported and env.get(k) == imported[k]))


def serve(path: str) -> None:
    """Bind first (clients queue until the imports are done), import, then fork a watcher per command."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    started = dict(os.environ)
    warm_up()
    imported = {key: os.environ[key] for key in changed(started, dict(os.environ)) if key in os.environ}
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}  # as a fresh interpreter has them
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the watchers are reaped by the kernel
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            watch(conn, started, imported, handlers)
        conn.close()


def warm_up() -> None:
    """What every run imports, and the meta device's first initialisation (it loads torch's reference ops)."""
    import importlib

    importlib.import_module("forge.runtime.commands")  # first, as in `python -m forge.train`: forge.runtime.exit
    # registers its exit handler before torch's, so that it runs after them
    from forge.runtime.host_memory import ask_huge_pages

    ask_huge_pages()  # before torch's first CPU allocation, as the command does (train.cpu_huge_pages)
    import torch
    import torch._dynamo  # noqa: F401 - the optimizer's first step imports it
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import forge.models.llama.hf  # noqa: F401
    import forge.models.llama.spec  # noqa: F401
    import forge.train.main  # noqa: F401
    import forge.train.trainer  # noqa: F401

    with torch.device("meta"):
        torch.nn.Embedding(8, 8)


def watch(conn: socket.socket, started: dict[str, str], imported: dict[str, str], handlers: dict) -> None:
    """In a fork of the server: start the command's process, pass its pid and then its exit status to the client,
    and kill its process group if the client goes first. `started` is the server's environment before its imports,
    `imported` what they set (torch sets TORCHINDUCTOR_CACHE_DIR), as they would in a fresh process."""
    import select

    pid = None
    try:
        message, fds, _, _ = socket.recv_fds(conn, MESSAGE, 3)
        request = json.loads(message)
        differing = differing_environment(request["env"], started, imported)
        if differing:
            print(f"fresh interpreter for a command: its environment differs in {differing}", file=sys.stderr)
            conn.send(b"fresh")
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            try:
                conn.close()
                run(request, fds, imported, handlers)
            except BaseException:
                traceback_to_stderr()
            finally:
                os._exit(1)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # (the command does it too): its group exists before the first kill
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        conn.send(f"pid {pid}".encode())
        poll = select.poll()
        poll.register(conn, select.POLLIN | select.POLLHUP)
        poll.register(pidfd, select.POLLIN)
        while pidfd not in dict(ready := poll.poll()):
            if any(fd == conn.fileno() for fd, _ in ready):  # the client is gone (killed): so is the command
                raise ConnectionError
        _, status = os.waitpid(pid, 0)
        pid = None
        if os.WIFSIGNALED(status):
            conn.send(f"signal {os.WTERMSIG(status)}".encode())
        else:
            conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
    except BaseException:
        if pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)
    finally:
        os._exit(0)


def traceback_to_stderr() -> None:
    import traceback

    with contextlib.suppress(BaseException):
        traceback.print_exc()


def run(request: dict, fds: list[int], imported: dict[str, str], handlers: dict) -> None:
    """In the command's process: its streams, directory, environment, signals and argv, then `python -m
    forge.train`'s run and interpreter exit."""
    import atexit
    import io
    import runpy
    import threading
    import traceback

    os.setpgid(0, 0)  # the command and what it starts: one group for the watcher to kill
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"] | imported)
    for sig, handler in handlers.items():  # SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt, ...
        if handler is not None:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, handler)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.argv = ["-m", *request["args"]]
    sys.path[0] = request["cwd"]
    code, interrupted = 0, False
    try:
        runpy._run_module_as_main("forge.train")  # type: ignore[attr-defined] - what `python -m` calls
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined] - as the interpreter does at exit: join the threads left
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
    if interrupted:  # as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
