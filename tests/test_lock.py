"""genoctx.lock.output_lock: one writer per output folder, the holder's PID in the message, --wait, dead holders.

The other holder is a helper process (``_HOLDER``) that takes the lock, prints ``locked`` and keeps it
until its stdin closes, so every test knows the lock is held before it tries (no sleep-based races).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from genoctx.errors import GenoctxError
from genoctx.lock import LOCK_NAME, output_lock

REPO = Path(__file__).resolve().parents[1]
_HOLDER = (
    "import sys; from pathlib import Path; from genoctx.lock import output_lock\n"
    "with output_lock(Path(sys.argv[1]), what=sys.argv[2]):\n"
    "    print('locked', flush=True)\n"
    "    sys.stdin.readline()\n"
)


class Holder:
    """A process that holds ``output_lock(folder, what=what)`` until :meth:`release` (or is killed)."""

    def __init__(self, folder: Path, what: str = "prepare"):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(folder), what],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        assert line == "locked\n", line
        self.pid = self.proc.pid

    def release(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdin.close()


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(folder: Path, what: str = "prepare") -> Holder:
        h = Holder(folder, what)
        started.append(h)
        return h

    yield start
    for h in started:
        if h.proc.poll() is None:
            h.kill()
        h.proc.stdout.close()


def _wait_for(pred, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_lock_file_holds_the_pid_while_held_and_stays_empty_after(tmp_path):
    out = tmp_path / "a" / "out"  # created, parents too
    with output_lock(out, what="train") as lock:
        assert lock.path == out / LOCK_NAME and lock.folder == out
        pid, host, command = lock.path.read_text().split(" ", 2)
        assert (int(pid), host, command) == (os.getpid(), socket.gethostname(), "genoctx train\n")
    assert lock.path.is_file() and lock.path.read_bytes() == b""  # truncated, not deleted
    with output_lock(out):  # free again
        pass


def test_second_writer_is_refused_naming_folder_and_pid(tmp_path, holders):
    out = tmp_path / "out"
    holder = holders(out, "prepare")
    with pytest.raises(GenoctxError) as info:
        with output_lock(out, what="prepare"):
            pytest.fail("acquired a held lock")
    message = str(info.value)
    assert message == f"{out} is being written by PID {holder.pid} (genoctx prepare); wait for it or pass --wait"
    holder.release()
    with output_lock(out, what="export"):  # free again; inside this process a second writer is refused too
        with pytest.raises(GenoctxError, match=f"PID {os.getpid()} \\(genoctx export\\)"):
            with output_lock(out):
                pass


def test_wait_blocks_until_the_holder_is_done(tmp_path, holders, caplog):
    out = tmp_path / "out"
    holder = holders(out, "train")
    acquired = threading.Event()

    def writer():
        with output_lock(out, wait=True):
            acquired.set()

    caplog.set_level(logging.INFO, logger="genoctx.lock")
    t = threading.Thread(target=writer)
    t.start()
    assert _wait_for(lambda: "waiting for PID" in caplog.text)
    assert not acquired.is_set()
    holder.release()
    t.join(timeout=30)
    assert acquired.is_set()
    lines = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert lines == [f"{out} is being written by PID {holder.pid} (genoctx train); waiting for PID {holder.pid}"]


def test_lock_of_a_killed_process_does_not_block(tmp_path, holders):
    out = tmp_path / "out"
    holder = holders(out)
    holder.kill()  # SIGKILL: no cleanup ran, the lock file still names the dead PID
    assert (out / LOCK_NAME).read_text().startswith(f"{holder.pid} ")
    with output_lock(out) as lock:
        assert lock.path.read_text().startswith(f"{os.getpid()} ")


def test_discard_while_another_waits_hands_over_a_fresh_lock(tmp_path):
    out = tmp_path / "out"
    got = threading.Event()
    release = threading.Event()
    inode = {}

    def waiter():
        with output_lock(out, wait=True) as lock:
            inode["b"] = os.stat(lock.path).st_ino
            got.set()
            release.wait(30)

    with output_lock(out) as first:
        assert first.created
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)  # let the waiter block on the first lock file (the test passes either way)
        first.discard()  # removes the lock file while held (a failed run removes what it created)
        assert not first.path.exists()
    assert got.wait(30)
    # the waiter holds the lock file that is at the path now (not the unlinked one): a third writer is refused
    assert os.stat(out / LOCK_NAME).st_ino == inode["b"]
    with pytest.raises(GenoctxError, match=f"PID {os.getpid()}"):
        with output_lock(out):
            pass
    release.set()
    t.join(30)


def test_not_a_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(GenoctxError, match="not a folder"):
        with output_lock(f):
            pass
