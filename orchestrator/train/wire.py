"""The control protocol's wire format, shared by the coordinator (launch/control.py) and the
copy leaders (train/replicas.py); torch-free.

One JSON object a line: {"body": {...}, "mac": hex}. The MAC is HMAC-SHA256 over the body's
canonical JSON (sorted keys, no spaces) with the job's secret (RUN_DIR/control.key, mode
0600, made at every launch; the ranks find it through ORCH_CONTROL_KEY_FILE, never on a
command line). On connect the server sends a signed hello with a fresh nonce; every
message of that connection carries the nonce and a sequence number that only grows, and
every reply echoes both, so a line copied from another connection, or sent twice, is
refused on either side.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import socket
import time
from pathlib import Path

KEY_ENV = "ORCH_CONTROL_KEY_FILE"
SECRET_NAME = "control.key"
MAX_LINE = 64 * 1024  # longer lines are refused (and the connection closed)


class Refused(Exception):
    """A line that is not a valid message of this protocol; str() is the reason it is counted under."""


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def mac(key: bytes, body: dict) -> str:
    return hmac.new(key, canonical(body), hashlib.sha256).hexdigest()


def encode(key: bytes, body: dict) -> bytes:
    return json.dumps({"body": body, "mac": mac(key, body)}, separators=(",", ":")).encode() + b"\n"


def decode(key: bytes, line: bytes) -> dict:
    """The body of a signed line, or Refused(reason)."""
    if len(line) > MAX_LINE:
        raise Refused("oversized")
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise Refused("malformed") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("body"), dict):
        raise Refused("unsigned")
    sig = msg.get("mac")
    if not isinstance(sig, str):
        raise Refused("unsigned")
    try:
        want = mac(key, msg["body"])
    except (TypeError, ValueError):
        raise Refused("malformed") from None
    if not hmac.compare_digest(want, sig):
        raise Refused("bad_mac")
    return msg["body"]


def make_secret(run_dir: Path) -> Path:
    """A fresh per-job secret in RUN_DIR/control.key, owner-only (written aside, then renamed)."""
    path = Path(run_dir) / SECRET_NAME
    tmp = path.with_name(f".{SECRET_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
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
        raise SystemExit(f"{KEY_ENV} is not set: the launcher hands every rank the job's control secret "
                         f"(RUN_DIR/{SECRET_NAME}); start the ranks through orchestrate")
    return read_secret(path)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Client:
    """One copy leader's connection to the coordinator (blocking; refused connects are retried
    until `connect_s`; every request has a deadline unless told to wait without one)."""

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
        hello = decode(key, self.rfile.readline(MAX_LINE + 1))
        self.nonce = hello["nonce"]

    def request(self, body: dict, timeout_s: float | None) -> dict:
        """Send one message; its reply (verified, for this nonce and sequence number)."""
        self.seq += 1
        self.sock.settimeout(timeout_s)
        self.sock.sendall(encode(self.key, {**body, "nonce": self.nonce, "seq": self.seq}))
        while True:
            line = self.rfile.readline(MAX_LINE + 1)
            if not line:
                raise ConnectionError("the coordinator closed the connection")
            try:
                reply = decode(self.key, line)
            except Refused:
                continue  # not from the coordinator: ignored
            if reply.get("nonce") == self.nonce and reply.get("seq") == self.seq:
                return reply

    def send(self, body: dict) -> None:
        """A message that gets no answer (bye)."""
        self.seq += 1
        self.sock.sendall(encode(self.key, {**body, "nonce": self.nonce, "seq": self.seq}))

    def close(self) -> None:
        try:
            self.rfile.close()
            self.sock.close()
        except OSError:
            pass
