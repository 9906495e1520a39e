"""The GPU process environment the presets are tuned in, set before JAX starts its GPU client.

Two settings, each applied only where the user has not made the choice:

- ``XLA_PYTHON_CLIENT_MEM_FRACTION`` = ``hardware.GPU_MEMORY_FRACTION``
  (0.92). JAX's allocator takes 75 % of the card otherwise, and XLA sizes a
  step's temporaries to what it is allowed: the 1b GPU preset compiled to
  50.08 GiB of temporaries at 0.75 and ran out of memory; at 0.92 it runs
  (one H100, jax 0.11.2; ``../shared/FACTS.md``).
- ``--xla_gpu_enable_command_buffer=-CUDNN`` in ``XLA_FLAGS``: XLA's
  default puts cuDNN's kernels into CUDA-graph command buffers, and on an
  H100 the first step died once in four runs with ``cuda_graph_end_capture
  … capturing stream has unjoined work`` from ``cuda_dnn.cc`` (cuDNN's
  attention inside a graph capture). cuDNN calls then run on the stream,
  outside the graphs; fusions and cuBLAS stay captured.

The environment is read when JAX creates its GPU client, so ``prepare``
runs before any JAX call (``distributed.initialize`` calls it first); it
changes nothing on a CPU or TPU run.
"""

from __future__ import annotations

import os

from distrib_train.cluster.hardware import GPU_MEMORY_FRACTION

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
CUDNN_OUT_OF_COMMAND_BUFFERS = f"{COMMAND_BUFFER_FLAG}=-CUDNN"


def prepare(environ: dict[str, str] | None = None) -> list[str]:
  """Sets the two defaults in ``environ`` (``os.environ``) where unset; returns what it set, as ``NAME=value``."""
  environ = os.environ if environ is None else environ
  done = []
  if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in environ:
    environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(GPU_MEMORY_FRACTION)
    done.append(f"XLA_PYTHON_CLIENT_MEM_FRACTION={GPU_MEMORY_FRACTION}")
  flags = environ.get("XLA_FLAGS", "")
  if COMMAND_BUFFER_FLAG not in flags:
    environ["XLA_FLAGS"] = f"{flags} {CUDNN_OUT_OF_COMMAND_BUFFERS}".strip()
    done.append(CUDNN_OUT_OF_COMMAND_BUFFERS)
  return done
