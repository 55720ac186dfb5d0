"""Config schema and Hydra registration (torch-free)."""
from orchestrator.config.schema import Config, register

__all__ = ["Config", "register"]
