"""The allocation's real topology and the logical node -> host mapping. Torch-free.

SLURM describes its network in topology.conf (topology/tree: `SwitchName=leaf1
Nodes=node[1-32]`, `SwitchName=spine Switches=leaf[1-32]`; topology/block:
`BlockName=b1 Nodes=node[1-18]`, NVLink domains such as NVL72 racks) and prints the
same as `scontrol show topology`, with each switch's `Level`. One parser reads both.

A switch's level is 0 for a leaf (it has nodes), else one more than its highest child;
level L of the tree is tier L above the NVLink domain of the fabric preset (the preset
says each level's bandwidth and oversubscription once, plan/topology.py `tiers_for`).

Mapping: consecutive logical nodes carry the plan's innermost (busiest) axes, so the
hosts are sorted by their switch path (top switch first) and filled in that order, whole
groups of `chunk` logical nodes first into leaves that hold them whole (`assign`).
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.plan.hostlist import HostlistError, expand, natural_key


class TopologyError(ValueError):
    pass


@dataclass
class Topology:
    parent: dict[str, str] = field(default_factory=dict)  # switch -> the switch above it
    level: dict[str, int] = field(default_factory=dict)  # switch -> level (0 = leaf)
    leaf: dict[str, str] = field(default_factory=dict)  # host -> its leaf switch
    block: dict[str, str] = field(default_factory=dict)  # host -> its block (NVLink domain)
    source: str = ""
    _keys: dict = field(default_factory=dict, repr=False, compare=False)  # memo: path keys, switch chains

    @property
    def levels(self) -> int:
        return max(self.level.values(), default=-1) + 1

    def ancestors(self, host: str) -> list[str | None]:
        """The switch above `host` at each level (the lowest one at or above it), None off the tree."""
        return list(self._chain(self.leaf.get(host)))

    def _chain(self, leaf: str | None) -> tuple:
        key = ("chain", leaf)
        if key not in self._keys:
            out, s = [], leaf
            for L in range(self.levels):
                while s is not None and self.level[s] < L:
                    s = self.parent.get(s)
                out.append(s)
            self._keys[key] = tuple(out)
        return self._keys[key]

    def path_key(self, host: str) -> tuple:
        """Sort key: the host's switches top first, then its name (hosts off the tree last)."""
        key = self._keys.get(host)
        if key is None:
            leaf, block = self.leaf.get(host), self.block.get(host)
            up = self._keys.get(("path", leaf))
            if up is None:
                up = self._keys[("path", leaf)] = tuple((0, natural_key(s)) if s else (1, ())
                                                       for s in reversed(self._chain(leaf)))
            key = self._keys[host] = up + ((0, natural_key(block)) if block else (1, ()), natural_key(host))
        return key


def _fields(line: str) -> dict[str, str]:
    out = {}
    for tok in line.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k.strip().lower()] = v.strip()
    return out


def parse_topology(text: str, source: str = "") -> Topology:
    """topology.conf (tree or block) or `scontrol show topology` output -> Topology."""
    children: dict[str, list[str]] = {}
    topo = Topology(source=source)
    given_level: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        f = _fields(line)
        try:
            if "switchname" in f:
                name = f["switchname"]
                children[name] = expand(f.get("switches"))
                if not children[name]:  # scontrol lists every node below a switch: only a leaf's count
                    for host in expand(f.get("nodes")):
                        topo.leaf[host] = name
                if f.get("level", "").isdigit():
                    given_level[name] = int(f["level"])
            elif "blockname" in f:
                for host in expand(f.get("nodes")):
                    topo.block[host] = f["blockname"]
        except HostlistError as e:
            raise TopologyError(f"{source or 'topology'} line {n}: {e}") from None
    for sw, kids in children.items():
        for k in kids:
            if k not in children:
                raise TopologyError(f"{source or 'topology'}: switch {sw} lists switch {k!r}, which is not defined")
            if k in topo.parent:
                raise TopologyError(f"{source or 'topology'}: switch {k} is under both {topo.parent[k]} and {sw}")
            topo.parent[k] = sw

    def level(sw: str, seen: tuple = ()) -> int:
        if sw in seen:
            raise TopologyError(f"{source or 'topology'}: switches form a loop through {sw}")
        if sw not in topo.level:
            topo.level[sw] = given_level.get(sw, max((level(k, seen + (sw,)) + 1 for k in children[sw]), default=0))
        return topo.level[sw]

    for sw in children:
        level(sw)
    return topo


MAX_TOPOLOGY_BYTES = 64 << 20  # a topology.conf of 100,000 nodes is a few MB


def read_topology(path: str | None) -> Topology | None:
    """A topology.conf file, or (path None) what this SLURM cluster reports; None without one."""
    if path:
        p = Path(path)
        try:
            if not p.is_file():  # a folder, a device (/dev/zero never ends), a pipe: not a topology.conf
                raise TopologyError(f"{path} is not a file" + ("." if p.exists() else " (it does not exist)."))
            if p.stat().st_size > MAX_TOPOLOGY_BYTES:
                raise TopologyError(f"{path} is {p.stat().st_size:,} bytes, more than a topology.conf "
                                    f"({MAX_TOPOLOGY_BYTES:,}).")
            return parse_topology(p.read_text(), str(p))
        except OSError as e:
            raise TopologyError(f"cannot read {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise TopologyError(f"{path} is not text (byte {e.start} is not UTF-8): not a topology.conf.") from None
    try:
        out = subprocess.run(["scontrol", "show", "topology"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    topo = parse_topology(out.stdout, "scontrol show topology") if out.returncode == 0 else None
    return topo if topo and (topo.leaf or topo.block) else None


# ------------------------------------------------------------------------------ mapping

def _ids(topo: Topology | None, hosts: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
    """Integer switch ids [levels, hosts] (hosts off the tree get ids of their own) and block ids."""
    n = len(hosts)
    levels = topo.levels if topo else 0
    ids = np.empty((levels, n), dtype=np.int64)
    names: dict = {}
    for j, h in enumerate(hosts):
        for L, s in enumerate(topo.ancestors(h)) if topo else ():
            ids[L, j] = names.setdefault(s if s is not None else ("off", h), len(names))
    blocks = None
    if topo and topo.block:
        blocks = np.array([names.setdefault(("block", topo.block.get(h, h)), len(names)) for h in hosts])
    return ids, blocks


def host_ids(topo: Topology | None, hosts: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
    return _ids(topo, hosts)


def span_levels(ids: tuple[np.ndarray, np.ndarray | None], groups: np.ndarray) -> np.ndarray:
    """Per group of logical nodes [G, k] (`ids` = host_ids of the mapped hosts): -2 inside one
    node, -1 inside one block (NVLink domain), L under one level-L switch, `levels` when no
    switch holds it whole."""
    ids, blocks = ids
    out = np.full(groups.shape[0], ids.shape[0], dtype=np.int64)
    for L in range(ids.shape[0] - 1, -1, -1):
        g = ids[L][groups]
        out[g.min(axis=1) == g.max(axis=1)] = L
    if blocks is not None:
        b = blocks[groups]
        out[b.min(axis=1) == b.max(axis=1)] = -1
    out[groups.min(axis=1) == groups.max(axis=1)] = -2
    return out


def choose(topo: Topology | None, candidates: list[str], need: int) -> list[str]:
    """`need` of the candidates as close together as the tree allows: the smallest subtree
    that holds them, else the fullest subtrees whole; in path order."""
    if need >= len(candidates) or topo is None or not topo.levels:
        return sorted(candidates, key=topo.path_key if topo else natural_key)[:need]
    anc = {h: topo.ancestors(h) for h in candidates}

    def pick(hosts: list[str], k: int, L: int) -> list[str]:
        if k >= len(hosts) or L < 0:
            return sorted(hosts, key=topo.path_key)[:k]
        by: dict = {}
        for h in hosts:
            by.setdefault(anc[h][L] or ("off", h), []).append(h)
        groups = sorted(by.values(), key=lambda g: (len(g), topo.path_key(g[0])))
        fits = [g for g in groups if len(g) >= k]
        if fits:
            return pick(fits[0], k, L - 1)
        out: list[str] = []
        for g in sorted(groups, key=lambda g: -len(g)):
            take = min(k - len(out), len(g))
            out += g if take == len(g) else pick(g, take, L - 1)
            if len(out) == k:
                break
        return sorted(out, key=topo.path_key)

    return pick(list(candidates), need, topo.levels - 1)


def assign(topo: Topology | None, hosts: list[str], chunk: int = 1) -> list[str]:
    """Host of each logical node: hosts in switch-path order, whole chunks of `chunk`
    consecutive logical nodes first into leaves (blocks) that hold them whole, the rest after."""
    if topo is None:
        return list(hosts)
    ordered = sorted(hosts, key=topo.path_key)
    if chunk <= 1:
        return ordered
    leaves: dict = {}  # the lowest unit: the host's block (NVLink domain), else its leaf switch
    for h in ordered:
        leaves.setdefault(topo.block.get(h) or topo.leaf.get(h) or ("off", h), []).append(h)
    whole, rest = [], []
    for members in leaves.values():
        cut = len(members) // chunk * chunk
        whole += members[:cut]
        rest += members[cut:]
    return whole + rest


def tree_conf(leaves: list[list[str]], per_pod: int = 0) -> str:
    """topology.conf text of a tree: leaf switch i holds leaves[i]; with `per_pod`, every
    `per_pod` leaves under one pod switch; one top switch above all (benchmarks, tests)."""
    out = [f"SwitchName=leaf{i} Nodes={','.join(hosts)}" for i, hosts in enumerate(leaves)]
    names = [f"leaf{i}" for i in range(len(leaves))]
    if per_pod:
        pods = [names[i:i + per_pod] for i in range(0, len(names), per_pod)]
        out += [f"SwitchName=pod{j} Switches={','.join(p)}" for j, p in enumerate(pods)]
        names = [f"pod{j}" for j in range(len(pods))]
    return "\n".join(out + [f"SwitchName=top Switches={','.join(names)}"]) + "\n"
