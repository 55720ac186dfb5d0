"""The coordinator (launch/control.py) or a leader's aggregator (train/tree.py) on a TCP port.

One thread and a selector serve every connection (no thread per leader, no lock held on a
socket): lines are read, checked (train/wire.py: signature, this connection's nonce, a
growing sequence number, the copy the connection speaks for), and handed to the
Coordinator; replies are queued and written by the same loop. A connection that sends
nothing valid within `auth_s`, or too many refused lines, is closed; a leader's connection
that closes is its copy lost (Coordinator.closed). The listen backlog is large, so a
burst of connects at 2,048 leaders is not refused. `push(copy, body)` sends an unasked
message to the connection that speaks for `copy` (sequence number 0, its nonce: the
coordinator's `report` when a change begins).
"""
from __future__ import annotations

import secrets
import selectors
import socket
import threading
import time

from orchestrator.plan.timeouts import keep_alive
from orchestrator.train import wire

MAX_REFUSED = 64  # refused lines on one connection before it is closed


class _Conn:
    def __init__(self, sock: socket.socket, nonce: str):
        self.sock, self.nonce = sock, nonce
        self.inbuf, self.out = b"", b""
        self.seq, self.copy, self.refused = 0, None, 0
        self.writing = False
        self.opened = time.monotonic()


class ControlServer:
    def __init__(self, coordinator, key: bytes, host: str = "127.0.0.1", backlog: int = 4096,
                 tick_s: float = 0.1, auth_s: float = 30.0, on_tick=None):
        self.coordinator, self.key, self.tick_s, self.auth_s, self.on_tick = coordinator, key, tick_s, auth_s, on_tick
        self.listener = socket.create_server((host, 0), backlog=backlog)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.host = host
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.lock = threading.Lock()  # guards the out buffers (replies may come from the supervisor's thread)
        self.conns: dict[int, _Conn] = {}
        self.by_copy: dict[int, _Conn] = {}
        if hasattr(coordinator, "push"):
            coordinator.push = self.push
        self.dirty: set[int] = set()
        self.lines = self.closes = 0  # lines handed over (or refused), connections closed: what tests wait on
        self._last: tuple = (None, b"")
        self.running = True
        self.last_tick = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name="control-server", daemon=True)
        self.thread.start()

    def address(self, host: str | None = None) -> str:
        return f"{host or self.host}:{self.port}"

    # ---- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while self.running:
            try:
                self._serve_once()
            except Exception:  # a bug (or a decision that raised) must not silence the coordinator
                import traceback

                self.coordinator.drop("internal_error")
                traceback.print_exc()

    def _serve_once(self) -> None:
        for key, mask in self.sel.select(timeout=self.tick_s):
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                try:
                    self.wake_r.recv(65536)
                except BlockingIOError:
                    pass
            elif mask & selectors.EVENT_READ:
                self._read(key.data)
            if mask & selectors.EVENT_WRITE and key.data in self.conns:
                self._flush(key.data)
        with self.lock:
            dirty, self.dirty = self.dirty, set()
        for fd in dirty:
            self._flush(fd)
        if time.monotonic() - self.last_tick >= self.tick_s:
            self.last_tick = time.monotonic()
            self.coordinator.tick()
            self._expire()
            if self.on_tick is not None:
                self.on_tick()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a connect reset before accept: the next one may do
                return
            sock.setblocking(False)
            keep_alive(sock)  # a leader cut off (no reset) errors after K: its copy lost (plan/timeouts.py)
            conn = _Conn(sock, secrets.token_hex(16))
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, sock.fileno())
            self._queue(conn, {"op": "hello"}, 0)

    def _read(self, fd: int) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._close(fd)
        conn.inbuf += data
        while b"\n" in conn.inbuf:
            line, conn.inbuf = conn.inbuf.split(b"\n", 1)
            self._line(conn, line)
            if fd not in self.conns:
                return
        if len(conn.inbuf) > wire.MAX_LINE:
            self._refuse(conn, "oversized", close=True)

    def _line(self, conn: _Conn, line: bytes) -> None:
        self.lines += 1
        try:
            nonce, seq, body = wire.decode(self.key, line)
        except wire.Refused as e:
            return self._refuse(conn, str(e))
        if nonce != conn.nonce or seq <= conn.seq:
            return self._refuse(conn, "replayed")  # signed, but for another connection, or sent again
        conn.seq = seq
        copy = body.get("copy")
        if conn.copy is not None and copy != conn.copy:
            return self._refuse(conn, "copy_mismatch")
        before = self.coordinator.dropped_total()
        self.coordinator.handle(body, lambda answer, c=conn, s=seq: self._reply(c, s, answer))
        if self.coordinator.dropped_total() > before:
            conn.refused += 1
        elif conn.copy is None and isinstance(copy, int):
            conn.copy = copy  # this connection speaks for this copy from now on
            self.by_copy[copy] = conn

    def push(self, copy: int, body: dict) -> None:
        conn = self.by_copy.get(copy)
        if conn is not None:
            self._reply(conn, 0, body)

    def _refuse(self, conn: _Conn, reason: str, close: bool = False) -> None:
        self.coordinator.drop(reason)
        conn.refused += 1
        if close or conn.refused > MAX_REFUSED:
            self._close(conn.sock.fileno())

    def _reply(self, conn: _Conn, seq: int, answer: dict) -> None:
        if self._last[0] is not answer:  # one answer to every leader: serialised once, signed per leader
            self._last = (answer, wire.canonical(answer))
        self._queue(conn, self._last[1], seq)

    def _queue(self, conn: _Conn, body, seq: int) -> None:
        data = wire.encode(self.key, body, conn.nonce, seq)
        with self.lock:
            conn.out += data
            self.dirty.add(conn.sock.fileno())
        if threading.current_thread() is not self.thread:
            try:
                self.wake_w.send(b"x")
            except OSError:
                pass

    def _flush(self, fd: int) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        with self.lock:
            try:
                sent = conn.sock.send(conn.out) if conn.out else 0
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                conn.out = b""
                sent = -1
            if sent >= 0:
                conn.out = conn.out[sent:]
            writing = bool(conn.out)
        if sent < 0:
            return self._close(fd)
        if writing != conn.writing:  # ask for write readiness only while something is left to send
            conn.writing = writing
            self.sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0), fd)

    def _expire(self) -> None:
        """Connections that never authenticated within auth_s are closed (and counted)."""
        now = time.monotonic()
        for fd, conn in list(self.conns.items()):
            if conn.copy is None and conn.seq == 0 and now - conn.opened > self.auth_s:
                self.coordinator.drop("idle_unauthenticated")
                self._close(fd)

    def _close(self, fd: int) -> None:
        conn = self.conns.pop(fd, None)
        if conn is None:
            return
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.copy is not None:
            if self.by_copy.get(conn.copy) is conn:
                del self.by_copy[conn.copy]
            self.coordinator.closed(conn.copy)
        self.closes += 1

    def close(self) -> None:
        self.running = False
        self.wake_w.send(b"x")
        self.thread.join(timeout=5)
        for conn in list(self.conns.values()):
            conn.sock.close()
        self.listener.close()
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()
