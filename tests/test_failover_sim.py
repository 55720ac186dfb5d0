"""The failover control plane at 2,048 ranks (256 copies of 8): the real coordinator and the real
in-place decision, leaders emulated on a virtual clock (benchmarks/failover_sim.py). Every
failure kind recovers in place, no healthy copy is dismissed, nobody is left waiting, and no
step is lost. Behaviour only: the timings are the benchmark's to print."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import failover_sim  # noqa: E402


@pytest.mark.parametrize("kind", ["crash", "node", "hang", "straggler", "two", "flap", "drain", "partition"])
def test_every_failure_kind_recovers_in_place_at_2048_ranks(kind):
    r = failover_sim.scenario("2k-8", kind)
    assert r["ranks"] == 2048 and r["copies"] == 256
    assert r["recovered"], r
    assert r["healthy_evicted"] == 0 and r["left_waiting"] == 0 and r["steps_lost"] == 0, r
    assert r["steps_done"] == (20 if kind == "flap" else 12)  # every step of the run committed
    if kind == "straggler":  # slow, not failed: nobody dropped, no new generation
        assert r["generations"] == 0 and r["detected_s"] is None
    else:
        assert r["generations"] >= 1 and r["detected_s"] is not None
        # every wait bounded: detection and recovery within the collective's timeout, the quorum window
        # and SLURM's node-down time (each stated in CONSTANTS), not without end
        bound = 60.0 + 10.0 + failover_sim.CONSTANTS["node_down_s"]
        assert r["detected_s"] <= bound and r["recovery_s"] <= 2 * bound, r
