"""The control protocol's wire format, shared by the coordinator (launch/control.py) and the
copy leaders (train/replicas.py); torch-free.

One message a line: `MAC NONCE SEQ JSON`. JSON is the body in canonical form (sorted keys,
no spaces); MAC is HMAC-SHA256, in hex, over `NONCE SEQ JSON` exactly as sent, with the
job's secret (RUN_DIR/control.key, mode 0600, made at every launch; the ranks find it
through ORCH_CONTROL_KEY_FILE, never on a command line). On connect the server sends a
signed hello with a fresh nonce (SEQ 0); every message of that connection carries that
nonce and a sequence number that only grows, and every reply echoes both, so a line
copied from another connection, or sent twice, is refused on either side. Signing the
bytes as sent costs one HMAC and one JSON parse a message; an answer that goes to every
leader is serialised once and only signed per leader.
"""
from __future__ import annotations

import hmac
import json
import math
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from orchestrator import rundir

KEY_ENV = rundir.ENV_CONTROL_KEY_FILE
SECRET_NAME = rundir.CONTROL_KEY
MAX_LINE = 64 * 1024  # longer lines are refused (and the connection closed)


class Refused(Exception):
    """A line that is not a valid message of this protocol; str() is the reason it is counted under."""


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode(key: bytes, body: dict | bytes, nonce: str, seq: int) -> bytes:
    """One signed line; `body` may come already in canonical form (bytes), to sign it again cheaply."""
    payload = body if isinstance(body, bytes) else canonical(body)
    head = f"{nonce} {seq} ".encode()
    return hmac.digest(key, head + payload, "sha256").hex().encode() + b" " + head + payload + b"\n"


def decode(key: bytes, line: bytes) -> tuple[str, int, dict]:
    """(nonce, seq, body) of a signed line, or Refused(reason)."""
    if len(line) > MAX_LINE:
        raise Refused("oversized")
    parts = line.rstrip(b"\n").split(b" ", 3)
    if len(parts) != 4 or len(parts[0]) != 64 or line.startswith(b"{"):
        raise Refused("unsigned")
    want = hmac.digest(key, parts[1] + b" " + parts[2] + b" " + parts[3], "sha256").hex().encode()
    if not hmac.compare_digest(want, parts[0]):
        raise Refused("bad_mac")
    try:
        nonce, seq, body = parts[1].decode(), int(parts[2]), json.loads(parts[3])
    except (ValueError, UnicodeDecodeError):
        raise Refused("malformed") from None
    if not isinstance(body, dict):
        raise Refused("malformed")
    return nonce, seq, body


def make_secret(run_dir: Path, name: str = SECRET_NAME) -> Path:
    """A fresh per-job secret in RUN_DIR/control.key (or `name`), owner-only (written aside, then renamed)."""
    path = Path(run_dir) / name
    tmp = path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.replace(tmp, path)
    return path


def read_secret(path: str | Path) -> bytes:
    return Path(path).read_text().strip().encode()


def env_secret() -> bytes:
    path = os.environ.get(KEY_ENV)
    if not path:
        raise rundir.RankExit(rundir.EXIT_FAILED, f"{KEY_ENV} is not set: the launcher hands every rank the job's "
                              f"control secret (RUN_DIR/{SECRET_NAME}); start the ranks through orchestrate")
    return read_secret(path)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Client:
    """One copy leader's connection to the coordinator or to another leader's aggregator
    (train/tree.py): blocking requests, refused connects retried until `connect_s`, every
    request with a deadline unless told to wait without one. After `listen()` a reader thread
    owns the socket: requests may then be sent from several threads (`submit` answers through
    a callback, with None when the connection fails) and the server's pushes (sequence 0, this
    connection's nonce) go to `on_push`."""

    def __init__(self, addr: str, key: bytes, connect_s: float = 120.0):
        host, port = addr.rsplit(":", 1)
        self.key, self.seq = key, 0
        deadline = time.monotonic() + connect_s
        while True:
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=5.0)
                break
            except OSError:  # refused (not listening yet) or unreachable: retry until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.rfile = self.sock.makefile("rb")
        self.nonce, _, hello = decode(key, self.rfile.readline(MAX_LINE + 1))
        if hello.get("op") != "hello":
            raise ConnectionError(f"the coordinator said {hello!r} instead of hello")
        self.reader, self.on_push, self.closed = None, None, False
        self.lock = threading.Lock()
        self.slots: dict[int, object] = {}  # seq -> callback waiting for its reply

    def listen(self, on_push=None) -> None:
        """From now on a thread reads every line (replies by sequence number, pushes to on_push)."""
        self.on_push = on_push
        if self.reader is None:
            self.sock.settimeout(None)  # the reader waits for the server; each request has its own deadline
            self.reader = threading.Thread(target=self._read, name="control-client", daemon=True)
            self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                line = self.rfile.readline(MAX_LINE + 1)
            except TimeoutError:
                continue
            except (OSError, ValueError):
                line = b""
            if not line:
                break
            try:
                nonce, seq, reply = decode(self.key, line)
            except Refused:
                continue  # not from the server: ignored
            if nonce != self.nonce:
                continue
            if seq == 0:
                if self.on_push is not None and reply.get("op") != "hello":
                    self.on_push(reply)
                continue
            with self.lock:
                callback = self.slots.pop(seq, None)
            if callback is not None:
                callback(reply)
        with self.lock:
            self.closed, waiting, self.slots = True, list(self.slots.values()), {}
        for callback in waiting:
            callback(None)

    def submit(self, body: dict, callback) -> None:
        """Send one message; `callback(reply)` from the reader thread (None: the connection failed)."""
        self.listen(self.on_push)
        with self.lock:
            if self.closed:
                ok = False
            else:
                self.seq += 1
                self.slots[self.seq] = callback
                line, ok = encode(self.key, body, self.nonce, self.seq), True
            if ok:
                try:
                    self.sock.sendall(line)
                except OSError:
                    self.slots.pop(self.seq, None)
                    ok = False
        if not ok:
            callback(None)

    def request(self, body: dict, timeout_s: float | None) -> dict:
        """Send one message; its reply (verified, for this nonce and sequence number)."""
        if self.reader is not None:
            done, box = threading.Event(), []
            self.submit(body, lambda reply: (box.append(reply), done.set()))
            if not done.wait(timeout_s):
                raise TimeoutError(f"no answer within {timeout_s} s")
            if box[0] is None:
                raise ConnectionError("the connection closed")
            return box[0]
        self.seq += 1
        self.sock.settimeout(timeout_s)
        self.sock.sendall(encode(self.key, body, self.nonce, self.seq))
        while True:
            line = self.rfile.readline(MAX_LINE + 1)
            if not line:
                raise ConnectionError("the coordinator closed the connection")
            try:
                nonce, seq, reply = decode(self.key, line)
            except Refused:
                continue  # not from the coordinator: ignored
            if nonce == self.nonce and seq == self.seq:
                return reply

    def send(self, body: dict) -> None:
        """A message that gets no answer (bye, hi)."""
        with self.lock:
            self.seq += 1
            self.sock.sendall(encode(self.key, body, self.nonce, self.seq))

    def close(self) -> None:
        try:
            if self.reader is not None:  # wake the reader (it holds the file's lock while it reads)
                self.sock.shutdown(socket.SHUT_RDWR)
                self.reader.join(timeout=5)
            self.rfile.close()
            self.sock.close()
        except OSError:
            pass
