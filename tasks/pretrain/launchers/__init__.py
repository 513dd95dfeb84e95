"""Launchers: take a job spec (the torchrun job's flags, nodes, GPUs) and hand on a handle to watch,
read logs from and cancel, whether the job runs here, under Slurm or on Kubernetes."""
