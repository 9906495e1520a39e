"""Attention kernels: ``dispatch`` picks one per call and records why; ``splash`` (TPU) and ``cudnn`` (NVIDIA GPUs)."""
