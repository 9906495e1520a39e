"""Kernels: the computations a model's layers call, apart from the models.

- ``attention/``: the attention kernels and the one place that picks among them
  (``dispatch``: splash on TPU, cuDNN on NVIDIA GPUs, XLA's own elsewhere, and
  why, for the plan); splash attention and the work each call records for the
  plan (``splash``); cuDNN's packed-row attention (``cudnn``).
- ``cross_entropy``: next-token cross-entropy and log-probabilities over the
  vocabulary in chunks, never the whole logits at once.
- ``fp8``: FP8 matmuls with current or delayed scaling.
- ``grouped``, ``gmm_triton``: the routed experts' grouped matmuls over rows
  padded to a tile (megablox on TPU, a Triton kernel on NVIDIA GPUs).

Kernels sit on the layer of ``parallel/`` (ARCHITECTURE.md): they may import
``common``, ``models``, the core, ``sharding`` and ``parallel``; reference
models (``recipes/``) import them, never the other way round.
"""
