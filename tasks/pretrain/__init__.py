"""The pretraining stage: takes a corpus manifest URI and hands on a checkpoint URI in the store, by
launching the torchrun job (``train``) on this machine, Slurm or Kubernetes (``launchers``)."""
