"""The machines a job runs on: joining processes, devices, XLA flags.

- ``distributed``: ``initialize`` (explicit, SLURM, TPU, GKE or CPU
  emulation), topology, preemption signals.
- ``hardware``: the device table (memory, peak FLOP/s, ICI/DCN bandwidth);
  ``device_memory``: a compiled step against a device's memory, the levers
  that make it fit, the one line for an out-of-memory error.
- ``xla_flags_check``: refuses ``XLA_FLAGS`` this jaxlib does not know
  (``python -m distrib_train.cluster.xla_flags_check``).
"""
