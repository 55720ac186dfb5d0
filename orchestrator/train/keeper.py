"""Snapshot keepers: each node's host memory holding the latest snapshots of ranks' state, so that
a restart reads a peer's memory instead of the file system (Gemini's and NVIDIA's local
checkpointing). Torch-free: the launcher runs the keepers and decides where a restart reads from;
the ranks (train/checkpoint.py) hand their snapshots over and fetch them back with the client here.

One keeper process per node, started by the launcher beside the ranks; it outlives the ranks'
restarts and dies with its node. Every `training.checkpoint.snapshot_every` steps each rank of the
saving copy writes its shard of the state with DCP into its own memory (train/checkpoint.snapshot)
and hands the files to two keepers: its own node's and its buddy's, node (n+1) mod N. A keeper holds
at most KEEP versions (steps) per rank. What a restart reads (`restore_point`): the newest step whose
every rank (of the world and attempt that took it: shards of one layout, never mixed with a later
attempt's of the same step) some live keeper holds, when it is newer than the newest
complete file-system checkpoint; else the file system. Losing a node and its buddy together loses
some rank's both copies: the file system then.

Wire: on connect the keeper sends a signed hello (train/wire.py: HMAC with the job's keeper secret,
a nonce and sequence numbers); every request and reply is one signed line whose body names the
length and SHA-256 of the raw bytes that follow it (the files of a snapshot, back to back).
"""
from __future__ import annotations

import argparse
import hashlib
import socket
import threading
from pathlib import Path

from orchestrator.train import wire

KEEP = 2  # versions (steps) a keeper holds per rank
RESTORE_JSON = "restore.json"  # in an attempt's plan directory: where its ranks resume from (the launcher's decision)
ENV_KEEPERS = "ORCH_KEEPERS"  # host:port of each node's keeper, in the attempt's node order
ENV_KEEPER_KEY_FILE = "ORCH_KEEPER_KEY_FILE"  # the job's keeper secret (0600)
KEY_NAME = "keeper.key"
IO_TIMEOUT_S = 60.0  # every keeper request is bounded


def every_of(plan_json: dict) -> int:
    """The snapshot interval in steps an attempt's plan resolved (make_plan: the config's
    training.checkpoint.snapshot_every, else the plan's chosen interval); 0: no snapshots, also when
    the run ends before the first one (training.steps)."""
    training = (plan_json.get("config") or {}).get("training") or {}
    snap = (plan_json.get("blast_radius") or {}).get("snapshot") or {}
    every = int(snap["every_steps"] if "every_steps" in snap else training.get("checkpoint", {}).get("snapshot_every") or 0)
    return every if 0 < every < int(training.get("steps", every + 1)) else 0


def buddies(node: int, nodes: int) -> list[int]:
    """The keepers a rank on `node` hands its snapshot to: its own node's, then node (n+1) mod N."""
    return sorted({node % nodes, (node + 1) % nodes}, key=lambda n: n != node % nodes)


# ---- the wire --------------------------------------------------------------------------------
def _send(sock, key: bytes, nonce: str, seq: int, body: dict, payload: bytes = b"") -> None:
    body = dict(body, bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    sock.sendall(wire.encode(key, body, nonce, seq) + payload)


def _recv(rfile, key: bytes, nonce: str | None, seq: int | None) -> tuple[str, int, dict, bytes]:
    line = rfile.readline(wire.MAX_LINE + 1)
    if not line:
        raise ConnectionError("the keeper connection closed")
    got_nonce, got_seq, body = wire.decode(key, line)
    if (nonce is not None and got_nonce != nonce) or (seq is not None and got_seq != seq):
        raise wire.Refused("replayed")
    n = body.get("bytes", 0)
    if not isinstance(n, int) or n < 0:
        raise wire.Refused("malformed")
    payload = rfile.read(n) if n else b""
    if len(payload) != n or hashlib.sha256(payload).hexdigest() != body.get("sha256"):
        raise wire.Refused("payload")
    return got_nonce, got_seq, body, payload


def pack(files: dict[str, bytes]) -> tuple[list, bytes]:
    """(the index [[name, size], ...], the bytes back to back)."""
    names = sorted(files)
    return [[n, len(files[n])] for n in names], b"".join(files[n] for n in names)


def unpack(index: list, payload: bytes) -> dict[str, bytes]:
    out, at = {}, 0
    for name, size in index:
        out[name] = payload[at:at + size]
        at += size
    return out


class Client:
    """One request per connection (a keeper serves ranks that come and go)."""

    def __init__(self, addr: str, key: bytes, timeout_s: float = IO_TIMEOUT_S):
        self.addr, self.key, self.timeout_s = addr, key, timeout_s

    def request(self, body: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        host, port = self.addr.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=self.timeout_s) as sock:
            rfile = sock.makefile("rb")
            nonce, _, hello, _ = _recv(rfile, self.key, None, 0)
            if hello.get("op") != "hello":
                raise ConnectionError(f"the keeper at {self.addr} said {hello!r} instead of hello")
            _send(sock, self.key, nonce, 1, body, payload)
            _, _, reply, data = _recv(rfile, self.key, nonce, 1)
        if reply.get("error"):
            raise ConnectionError(f"the keeper at {self.addr}: {reply['error']}")
        return reply, data

    def put(self, step: int, rank: int, world: int, files: dict[str, bytes], attempt: int = 0) -> None:
        index, payload = pack(files)
        self.request({"op": "put", "step": step, "rank": rank, "world": world, "attempt": attempt, "index": index},
                     payload)

    def inventory(self) -> dict:
        """{"ranks": {rank: [[step, world, attempt], ...]}} as the keeper holds them."""
        return self.request({"op": "inventory"})[0]

    def get(self, step: int, rank: int) -> dict[str, bytes]:
        reply, payload = self.request({"op": "get", "step": step, "rank": rank})
        return unpack(reply["index"], payload)


# ---- the keeper --------------------------------------------------------------------------------
class Keeper:
    """Holds {rank: {step: (world, attempt, index, payload)}}, KEEP steps per rank, in memory."""

    def __init__(self, key: bytes, host: str = "127.0.0.1", port: int = 0):
        self.key = key
        self.held: dict[int, dict[int, tuple]] = {}
        self.lock = threading.Lock()
        self.server = socket.create_server((host, port))
        self.addr = f"{host}:{self.server.getsockname()[1]}"

    def serve_forever(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept (close alone leaves it listening)
        except OSError:
            pass
        self.server.close()

    def _serve(self, conn: socket.socket) -> None:
        import secrets

        with conn:
            conn.settimeout(IO_TIMEOUT_S)
            nonce = secrets.token_hex(8)
            try:
                _send(conn, self.key, nonce, 0, {"op": "hello"})
                _, seq, body, payload = _recv(conn.makefile("rb"), self.key, nonce, 1)
                reply, data = self.handle(body, payload)
                _send(conn, self.key, nonce, seq, reply, data)
            except (OSError, wire.Refused, ValueError, KeyError, TypeError):
                return  # a bad or broken request: dropped (the client's bounded wait says so)

    def handle(self, body: dict, payload: bytes) -> tuple[dict, bytes]:
        op = body.get("op")
        if op == "put":
            step, rank, world, attempt = int(body["step"]), int(body["rank"]), int(body["world"]), int(body["attempt"])
            with self.lock:
                mine = self.held.setdefault(rank, {})
                mine[step] = (world, attempt, body["index"], payload)
                for old in sorted(mine)[:-KEEP]:
                    del mine[old]
            return {"op": "ok"}, b""
        if op == "inventory":
            with self.lock:
                return {"ranks": {str(r): [[s, v[0], v[1]] for s, v in sorted(h.items())]
                                  for r, h in self.held.items()}}, b""
        if op == "get":
            with self.lock:
                held = self.held.get(int(body["rank"]), {}).get(int(body["step"]))
            if held is None:
                return {"error": f"no snapshot of rank {body['rank']} at step {body['step']}"}, b""
            return {"index": held[2]}, held[3]
        return {"error": f"unknown op {op!r}"}, b""


# ---- where a restart reads from -------------------------------------------------------------------
POOL = 64  # keepers asked at once in a round over every node's keeper (a frozen one costs its timeout once)


def ask_all(items: list, ask, pool: int = POOL) -> list:
    """[ask(item) for item in items], asked `pool` at a time on threads (a round over thousands of
    nodes' keepers takes about the slowest answer's time per `pool`, not the sum of them), in the
    items' order; an item whose ask raised OSError, wire.Refused, KeyError, ValueError or TypeError
    gives None."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        try:
            return ask(item)
        except (OSError, wire.Refused, KeyError, ValueError, TypeError):
            return None
    if len(items) <= 1:
        return [one(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(pool, len(items)), thread_name_prefix="keeper-ask") as ex:
        return list(ex.map(one, items))


def inventories(addrs: list[str], key: bytes, timeout_s: float = 10.0) -> dict[str, dict]:
    """{addr: inventory} of the keepers that answer (a keeper that does not is left out); asked
    POOL at a time (ask_all)."""
    answers = ask_all(list(addrs), lambda a: Client(a, key, timeout_s).inventory()["ranks"])
    return {a: held for a, held in zip(addrs, answers) if held is not None}


def restore_point(held: dict[str, dict], checkpoint_step: int | None) -> dict:
    """Where a restart resumes: {"source": "snapshot", "step", "world", "attempt", "holders": {rank:
    [addr]}} for the newest step every rank of the world and attempt that took it has in some live
    keeper (`held`: inventories), when it
    is newer than the newest complete checkpoint; else {"source": "checkpoint", "step"}, with
    "why" saying what the snapshots lacked."""
    holders: dict[tuple[int, int, int], dict[int, list[str]]] = {}
    for addr, ranks in held.items():
        for rank, steps in ranks.items():
            for step, world, attempt in steps:
                holders.setdefault((int(step), int(attempt), int(world)), {}).setdefault(int(rank), []).append(addr)
    why = "no snapshot held"
    for (step, attempt, world) in sorted(holders, reverse=True):
        have = holders[(step, attempt, world)]
        missing = [r for r in range(world) if r not in have]
        if missing:
            why = (f"the snapshot of step {step} lacks rank(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                   f"(their node and its buddy lost)")
            continue
        if checkpoint_step is not None and step <= checkpoint_step:
            why = f"the newest complete snapshot (step {step}) is not newer than the checkpoint"
            break
        return {"source": "snapshot", "step": step, "world": world, "attempt": attempt,
                "holders": {str(r): have[r] for r in range(world)}}
    return {"source": "checkpoint", "step": checkpoint_step or 0, "why": why}


def make_secret(run_dir: Path) -> Path:
    return wire.make_secret(run_dir, KEY_NAME)


def announce(folder: Path, addr: str, token: str) -> Path:
    """Say where this node's keeper listens: FOLDER/<node>.json (SLURM's name for the node, else the
    host's), written whole and then renamed; `token` names the start it answers (launch/keepers.py)."""
    import os

    from orchestrator import rundir

    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    Path(folder).mkdir(parents=True, exist_ok=True)
    return rundir.write_json(Path(folder) / f"{node}.json", {"node": node, "addr": addr, "token": token,
                                                             "pid": os.getpid()})


def main() -> None:
    ap = argparse.ArgumentParser(description="a node's snapshot keeper (started by the launcher)")
    ap.add_argument("key_file")
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on; 'hostname': this host's name "
                    "(SLURM: the ranks on other nodes reach it)")
    ap.add_argument("--announce", help="a folder to write <node>.json with the address into (SLURM)")
    ap.add_argument("--token", default="", help="what the launcher named this start (in <node>.json)")
    args = ap.parse_args()
    host = socket.gethostname() if args.host == "hostname" else args.host
    keeper = Keeper(wire.read_secret(args.key_file), host)
    if args.announce:
        announce(Path(args.announce), keeper.addr, args.token)
    print(f"keeper {keeper.addr}", flush=True)
    keeper.serve_forever()


if __name__ == "__main__":
    main()
