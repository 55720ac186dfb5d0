"""The vocabulary of the system (torch-free): the typed schema, the schedule registry,
Hydra composition and recipes. Every other layer imports from here; this imports none."""
