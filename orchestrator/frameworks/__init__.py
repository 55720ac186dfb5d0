"""Adapters from a plan to another program's command line: torchtitan and Megatron-LM
(one module per framework), and the dispatch every launcher uses (`trainers`). Not planning:
each renders, refuses before launch what its framework would refuse at start-up, and maps
RANK so the framework's own groups are the plan's. Torch-free."""
