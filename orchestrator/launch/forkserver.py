"""Start ranks by forking one process that has already imported the runtime.

Importing torch with DTensor, FSDP and the pipelining schedules costs each rank 3-4 s of
CPU; eight emulated GPUs on a two-core machine then spend most of a short run starting.
A fork server pays that once per attempt: it imports orchestrator.train.worker, then forks
a child per rank on request. Forking is safe there because the server never initialises
torch.distributed, runs no tensor operation and starts no thread.

Each child leads its own session (the launcher kills it with killpg, as a Popen'd rank),
writes to a pipe the launcher created (sent over the socket with SCM_RIGHTS) and dies
with the server, which dies with the launcher (PR_SET_PDEATHSIG). The server reports each
child's pid and exit status back over the same socket: the launcher's `ForkedProcess`
answers poll()/wait() like a Popen object.
"""
from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

MAX_MESSAGE = 1 << 20


def die_with_parent() -> None:
    """In a child: SIGKILL it when its parent dies (Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


class ForkedProcess:
    """A rank the fork server started: the subset of Popen the local launcher uses."""

    def __init__(self, server: "ForkServer", pid: int, stdout):
        self.server, self.pid, self.stdout = server, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("fork server child", timeout)
            time.sleep(0.02)
        return self.returncode


class ForkServer:
    def __init__(self, env: dict, modules: tuple[str, ...] = ("orchestrator.train.worker",)):
        """`modules`: what the server imports before forking (what every rank would import)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.launch.forkserver", str(theirs.fileno()),
                                      *modules],
                                     pass_fds=(theirs.fileno(),), env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)
        theirs.close()
        self.sock = ours
        self._lock = threading.Condition()
        self._pids: dict[int, int] = {}  # request -> pid
        self._exits: dict[int, int] = {}  # pid -> exit code (negative: killed by that signal)
        self._next = 0
        self._closed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._lock:
                if not data:  # the server is gone: every child it had died with it
                    self._closed = True
                    self._lock.notify_all()
                    return
                msg = json.loads(data)
                if "exit" in msg:
                    self._exits[msg["pid"]] = msg["exit"]
                else:
                    self._pids[msg["request"]] = msg["pid"]
                self._lock.notify_all()

    def spawn(self, env: dict, run_dir: str) -> ForkedProcess:
        r, w = os.pipe()
        with self._lock:
            request = self._next
            self._next += 1
        try:
            socket.send_fds(self.sock, [json.dumps({"request": request, "env": env, "run_dir": run_dir}).encode()],
                            [w])
        finally:
            os.close(w)
        with self._lock:
            if not self._lock.wait_for(lambda: request in self._pids or self._closed, timeout=300):
                raise RuntimeError("the fork server did not start a rank in 300 s")
            if request not in self._pids:
                os.close(r)
                raise RuntimeError(f"the fork server exited (status {self.proc.poll()}) before starting a rank")
            pid = self._pids.pop(request)
        return ForkedProcess(self, pid, os.fdopen(r, "r", buffering=1))

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
            if self._closed:
                return -signal.SIGKILL  # the server died, and its children with it
            return None

    def close(self) -> None:
        """The server exits when its socket closes; children still running die with it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread's recv; the server sees EOF
        except OSError:
            pass
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- the server process ---------------------------------------------------------------------

def _serve(fd: int, modules: list[str]) -> None:
    sock = socket.socket(fileno=fd)
    import importlib

    for name in modules:  # the imports every rank would pay
        importlib.import_module(name)

    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    children: set[int] = set()
    while True:
        for _ in sel.select(timeout=0.05):
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                return  # the launcher is done (or gone): children die with this process
            req = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(sock, fds[0], req)  # never returns
            os.close(fds[0])
            children.add(pid)
            if not _send(sock, {"request": req["request"], "pid": pid}):
                return
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                if not _send(sock, {"pid": pid, "exit": os.waitstatus_to_exitcode(status)}):
                    return


def _send(sock: socket.socket, msg: dict) -> bool:
    try:
        sock.send(json.dumps(msg).encode())
        return True
    except OSError:  # the launcher is gone
        return False


def _child(sock: socket.socket, out: int, req: dict) -> None:
    code = 1
    try:
        server = os.getppid()
        os.setsid()
        die_with_parent()
        if os.getppid() != server:  # the server died between fork and prctl
            os._exit(1)
        sock.close()
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.environ.clear()
        os.environ.update(req["env"])
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        sys.argv = ["orchestrator.train.worker", req["run_dir"]]
        from orchestrator.train.worker import main

        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        from orchestrator import rundir

        rundir.exit_now(code)  # what a normal interpreter exit would run (torch's, logging's), less its teardown


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2:])
    # Nothing to flush or clean: skip the interpreter's teardown of torch (about a second),
    # which the launcher would wait for.
    os._exit(0)
