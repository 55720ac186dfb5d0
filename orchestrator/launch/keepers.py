"""The launchers' snapshot keepers (train/keeper.py): one per node, started before the first attempt
whose plan takes memory snapshots and kept across attempts (the restarts), a lost node's keeper
lost with it, closed at the end of the run; and where a restart resumes (`resume_point`: their
inventories, keeper.restore_point). What differs between launchers is only how a keeper starts:
a process here (launcher=local, `LocalKeepers`) or one srun step with a task on each node of the
allocation (`SrunKeepers`), each task writing where it listens into RUN_DIR/keepers/<node>.json.
"""
from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import rundir
from orchestrator.rundir import checkpoints as ckpt
from orchestrator.train import keeper, wire

KEEPER_START_S = 60.0  # a snapshot keeper says where it listens within this
ADOPT_S = 5.0  # a keeper an earlier supervisor started answers within this, or is not used


class Keepers:
    """node -> the address of its keeper, kept across the run's attempts."""

    def __init__(self, run_dir: Path, say=print):
        self.run_dir, self.say = Path(run_dir), say
        self.addrs: dict = {}  # node -> host:port
        self.key: Path | None = None
        self.restore: dict | None = None  # where the next attempt resumes (resume_point), for its plan directory

    def key_file(self) -> Path:
        """The job's keeper secret (RUN_DIR/keeper.key; made once, read by keepers started before)."""
        if self.key is None:
            path = self.run_dir / keeper.KEY_NAME
            self.key = path if path.exists() else keeper.make_secret(self.run_dir)
        return self.key

    def env_for(self, nodes: list) -> dict:
        """A keeper on each of `nodes` (started for those without a live one); the ranks' environment
        naming them in this order. {} (no snapshots; the ranks say so) when some node has none."""
        self.key_file()
        missing = [n for n in nodes if not self.alive(n)]
        if missing:
            self.addrs.update(self._start(missing))
        if any(not self.alive(n) for n in nodes):
            return {}
        return {keeper.ENV_KEEPERS: ",".join(self.addrs[n] for n in nodes), keeper.ENV_KEEPER_KEY_FILE: str(self.key)}

    def alive(self, node) -> bool:
        return node in self.addrs

    def _start(self, nodes: list) -> dict:
        """{node: address} of the keepers started on `nodes`."""
        raise NotImplementedError

    def lose(self, nodes) -> None:
        """Lost nodes lose their host memory: their keepers go with them."""
        for node in nodes:
            self.addrs.pop(node, None)

    def close(self) -> None:
        self.lose(list(self.addrs))

    def resume_point(self, url: str, done: int) -> dict:
        """Where a restart after `done` steps resumes: the newest memory snapshot every rank has in a
        live keeper when newer than the newest complete checkpoint, else the checkpoint
        (keeper.restore_point); what the next attempt's ranks read (keeper.RESTORE_JSON)."""
        dcp = ckpt.latest_complete(url)
        live = [a for n, a in self.addrs.items() if self.alive(n)]
        if live:
            point = keeper.restore_point(keeper.inventories(live, wire.read_secret(self.key_file())), dcp)
        else:
            point = {"source": "checkpoint", "step": dcp or 0}
        self.restore = {**point, "failed_after_step": done, "checkpoint_step": dcp}
        return self.restore

    def hand_over(self, plan_dir: Path) -> None:
        """A restart's attempt: where its ranks resume (the last resume_point), in its plan directory."""
        if self.restore is not None:
            rundir.write_json(Path(plan_dir) / keeper.RESTORE_JSON, self.restore)
            self.restore = None


class LocalKeepers(Keepers):
    """A keeper process per emulated node, dying with this process."""

    def __init__(self, run_dir: Path, say=print):
        super().__init__(run_dir, say)
        self.procs: dict = {}

    def alive(self, node) -> bool:
        return node in self.addrs and self.procs[node].poll() is None

    def _start(self, nodes: list) -> dict:
        out = {}
        for node in nodes:
            self.procs[node], out[node] = start_keeper(self.key_file())
        return out

    def lose(self, nodes) -> None:
        for node in nodes:
            p = self.procs.pop(node, None)
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        super().lose(nodes)


def start_keeper(key_file: Path):
    """One node's snapshot keeper here, dying with this process: (process, address)."""
    import select

    from orchestrator.launch.forkserver import die_with_parent

    p = subprocess.Popen([sys.executable, "-m", "orchestrator.train.keeper", str(key_file)], stdout=subprocess.PIPE,
                         text=True, start_new_session=True, preexec_fn=die_with_parent)
    ready = select.select([p.stdout], [], [], KEEPER_START_S)[0]
    line = p.stdout.readline().strip() if ready else f"nothing within {KEEPER_START_S:.0f} s"
    if not line.startswith("keeper "):  # "keeper HOST:PORT" once it listens
        p.kill()
        p.wait()
        raise RuntimeError(f"a snapshot keeper did not start (status {p.poll()}): {line!r}")
    return p, line.split(" ", 1)[1]


class SrunKeepers(Keepers):
    """The keepers of a SLURM allocation: one srun step (sbatch.keeper_command) with a task on each
    node, beside the training steps (--overlap) and outliving them; each task writes
    RUN_DIR/keepers/<node>.json (its address and the start's token). A node lost takes its task with
    it (marked lost here). A standby that took over adopts the keepers the supervisor before it
    started in the allocation when they answer with the job's key: their snapshots are the run's."""

    def __init__(self, spec, run_dir: Path, say=print):
        super().__init__(run_dir, say)
        self.spec = spec
        self.steps: list[subprocess.Popen] = []
        self.step_of: dict = {}  # node -> the srun step its keeper runs in (None: adopted)

    @property
    def folder(self) -> Path:
        return self.run_dir / rundir.KEEPERS

    def alive(self, node) -> bool:
        step = self.step_of.get(node)
        return node in self.addrs and (step is None or step.poll() is None)

    def adopt(self, nodes: list) -> dict:
        """{node: address} of the keepers already running on `nodes` that answer with the job's key,
        kept from now on (a standby's takeover: srun.takeover_point; a new job starts its own)."""
        key = wire.read_secret(self.key_file())

        def answers(node):  # its address, when its keeper answers with the job's key (asked keeper.POOL at once)
            addr = json.loads((self.folder / f"{node}.json").read_text())["addr"]
            keeper.Client(addr, key, ADOPT_S).inventory()
            return addr
        out = {n: a for n, a in zip(nodes, keeper.ask_all(list(nodes), answers)) if a is not None}
        for node in out:
            self.step_of[node] = None
        self.addrs.update(out)
        if out:
            self.say(f"snapshot keepers already running, kept: {out}")
        return out

    def announced(self, nodes: list, token: str) -> dict:
        """{node: address} the keepers of the start named `token` wrote so far."""
        out = {}
        for node in nodes:
            try:
                said = json.loads((self.folder / f"{node}.json").read_text())
            except (OSError, ValueError):
                continue
            if said.get("token") == token:
                out[node] = said["addr"]
        return out

    def _start(self, nodes: list) -> dict:
        from orchestrator.launch import sbatch

        token = secrets.token_hex(8)
        (self.run_dir / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        cmd = sbatch.keeper_command(self.spec.launcher, self.run_dir, nodes, sys.executable, self.key_file(), token)
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
        self.steps.append(proc)
        self.say(f"snapshot keepers: {' '.join(cmd)}")
        deadline = time.monotonic() + KEEPER_START_S
        while True:  # bounded: every keeper said where it listens, the step ended, or KEEPER_START_S passed
            found = self.announced(nodes, token)
            if len(found) == len(nodes) or proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if len(found) < len(nodes):
            how = "running" if proc.poll() is None else f"exited with {proc.poll()}"
            self.say(f"NO SNAPSHOTS: the keepers on node(s) {sorted(set(nodes) - set(found))} did not say where they "
                     f"listen within {KEEPER_START_S:.0f} s (their step: {how}; {rundir.LOGS}/keeper*.log); a restart "
                     f"reads the checkpoint")
            self._end(proc)
            return {}
        self.step_of.update({n: proc for n in nodes})
        return found

    def close(self) -> None:
        """The end of the run: the keepers' steps end (srun forwards TERM to their tasks; bounded)."""
        super().close()
        for proc in self.steps:
            self._end(proc)
        self.steps = []

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
