"""What a plan shows a reader: the table and plan.md (`markdown`), the pictures (`figures`),
and the files a plan and a finished run leave in the run directory (`artifacts`).
Torch-free; reads plans, never changes them."""
