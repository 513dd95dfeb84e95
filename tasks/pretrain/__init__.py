"""The pretraining stage: takes a corpus manifest URI and hands on a checkpoint URI in the store, by
launching the torchrun job (``train``) through the job runtime (``tasks.jobs``)."""
