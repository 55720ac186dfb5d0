"""Launchers (dry, local, slurm) and the one failover loop they share (supervisor.py).
Torch-free: the ranks are separate programs (orchestrator.train.worker)."""
