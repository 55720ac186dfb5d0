"""The published-runs harness: every published training run in `published/*.csv` planned on
its authors' stack, fabric and hardware, predicted against the throughput it printed, and
the kernel constants fitted on them (`calibrate`)."""
