"""``python -m genoctx ARGS`` for the tests, as a fresh process forked from a server that imported torch once.

Every ``genoctx`` verb imports torch (~1.5-2 s on a small CPU); the suite runs the CLI ~150 times. ``run_genoctx``
asks one server process per test session (``python -c SERVER``, started on first use) to fork a child that takes
the request's working directory, environment, argv and stdin/stdout/stderr files and runs ``genoctx`` as
``python -m genoctx`` would (``runpy.run_module("genoctx", run_name="__main__")``). The child is a new process:
its exit code, or ``-signal`` when it was killed, is the return code; its pid is its own (a driver that a fault
kills, ``GENOCTX_FAULT_KILL=save+driver:N``, ends with -9 as a real one). Nothing of genoctx runs in the server, so
each child starts with no logging handlers, no Ray and no process group; what the server imported is only torch,
``torch._dynamo`` (which torch imports lazily the first time a verb builds a model: ~1.2 s of every such child),
typer and ``genoctx.cli`` (none reads the environment a test changes at import time).
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SERVER = r"""
import io, os, pickle, runpy, struct, sys, traceback
import torch  # what every verb imports: once, here
import torch._dynamo  # imported by torch when a verb first builds a model (nn.init): ~1.2 s a child otherwise
import genoctx.cli  # noqa: F401

inp, out = sys.stdin.buffer, sys.stdout.buffer


def read():
    head = inp.read(4)
    if len(head) < 4:
        return None
    return pickle.loads(inp.read(struct.unpack("!I", head)[0]))


def write(obj):
    data = pickle.dumps(obj)
    out.write(struct.pack("!I", len(data)) + data)
    out.flush()


def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, req["stdin"], os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                            (2, req["stderr"], os.O_WRONLY)):
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), line_buffering=True)
    sys.argv = ["genoctx", *req["args"]]
    sys.path[0] = os.getcwd()  # as python -m puts the working directory first
    code = 0
    try:
        runpy.run_module("genoctx", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


while (req := read()) is not None:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child(req)
        finally:
            os._exit(1)
    write(pid)
    _, status = os.waitpid(pid, 0)
    write(os.waitstatus_to_exitcode(status))
"""

_lock = threading.Lock()
_server: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   cwd=REPO)  # fmt: skip
        atexit.register(_stop)
    return _server


def _stop() -> None:
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        try:
            _server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _server.kill()


def _read(server: subprocess.Popen, deadline: float | None):
    fd = server.stdout.fileno()
    if deadline is not None and not select.select([fd], [], [], max(0.0, deadline))[0]:
        raise TimeoutError
    head = server.stdout.read(4)
    if len(head) < 4:
        raise RuntimeError("the genoctx test server died")
    return pickle.loads(server.stdout.read(struct.unpack("!I", head)[0]))


def run_genoctx(*args, env: dict | None = None, cwd=None, timeout: float | None = 300,
                input: str | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run([sys.executable, "-m", "genoctx", *args], capture_output=True, text=True, ...)``, the process
    forked from the session's server (module docstring).

    Args:
        args: the command line after ``genoctx`` (``str()`` of each).
        env: the child's whole environment (default: this process's ``os.environ``).
        cwd: its working directory (default: this process's).
        timeout: seconds; past it the child is killed and ``subprocess.TimeoutExpired`` raised.
        input: text on its stdin (default: empty).

    Returns:
        ``CompletedProcess`` with ``returncode`` (``-N`` when killed by signal N), ``stdout`` and ``stderr`` (str).
    """
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="genoctx-cli-") as tmp:
        paths = {k: os.path.join(tmp, k) for k in ("stdin", "stdout", "stderr")}
        Path(paths["stdin"]).write_text(input or "")
        for k in ("stdout", "stderr"):
            Path(paths[k]).touch()
        req = {"args": argv, "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()), **paths}
        with _lock:
            server = _start()
            data = pickle.dumps(req)
            server.stdin.write(struct.pack("!I", len(data)) + data)
            server.stdin.flush()
            pid = _read(server, None)
            try:
                code = _read(server, timeout)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                _read(server, None)
                out, err = (Path(paths[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
                raise subprocess.TimeoutExpired(["genoctx", *argv], timeout, out, err) from None
        out, err = (Path(paths[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
    return subprocess.CompletedProcess([sys.executable, "-m", "genoctx", *argv], code, out, err)
