"""The launcher's rounds over every node's snapshot keeper at scale (issue #36): a restart's
inventory round (launch/keepers.resume_point -> train/keeper.inventories) and a standby's adoption
round (launch/keepers.SrunKeepers.adopt), against N real keepers (train/keeper.Keeper, in this
process, on loopback) of which F are frozen: a machine that accepts the connection but never says
hello (a frozen node's kernel still completes the handshake), so each costs the round its timeout.

    python benchmarks/keeper_rounds.py [--nodes 1024] [--frozen 8] [--timeout-s 2]

Prints each round's wall time and how many keepers it found; the answer must be the same whatever
the order the keepers answer in.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator import rundir  # noqa: E402
from orchestrator.launch import keepers as launch_keepers  # noqa: E402
from orchestrator.train import keeper, wire  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--frozen", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=2.0)
    a = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="keeper_rounds_"))
    ks = launch_keepers.SrunKeepers(type("Spec", (), {})(), run, say=lambda *x: None)
    key = wire.read_secret(ks.key_file())
    live = []
    for i in range(a.nodes - a.frozen):
        k = keeper.Keeper(key)
        k.held = {i: {4: (a.nodes, 0, [], b"")}}
        threading.Thread(target=k.serve_forever, daemon=True).start()
        live.append(k)
    frozen = [socket.create_server(("127.0.0.1", 0), backlog=64) for _ in range(a.frozen)]
    addrs = [k.addr for k in live] + [f"127.0.0.1:{s.getsockname()[1]}" for s in frozen]
    (ks.folder).mkdir(parents=True, exist_ok=True)
    nodes = [f"node{i:05d}" for i in range(len(addrs))]
    for n, addr in zip(nodes, addrs):
        rundir.write_json(ks.folder / f"{n}.json", {"addr": addr, "token": "t"})
    t0 = time.perf_counter()
    held = keeper.inventories(addrs, key, a.timeout_s)
    t_inv = time.perf_counter() - t0
    launch_keepers.ADOPT_S = a.timeout_s
    t0 = time.perf_counter()
    adopted = ks.adopt(nodes)
    t_adopt = time.perf_counter() - t0
    print(json.dumps({"nodes": a.nodes, "frozen": a.frozen, "timeout_s": a.timeout_s,
                      "inventory_s": round(t_inv, 3), "inventories": len(held),
                      "adopt_s": round(t_adopt, 3), "adopted": len(adopted),
                      "pool": getattr(keeper, "POOL", 1)}))
    for k in live:
        k.close()
    for s in frozen:
        s.close()


if __name__ == "__main__":
    main()
