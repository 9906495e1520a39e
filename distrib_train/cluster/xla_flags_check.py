"""Checks ``XLA_FLAGS`` against the installed jaxlib before a job starts.

An unknown flag in ``XLA_FLAGS`` aborts the process at its first JAX call —
on a cluster, every process of the job, after the queue wait. This module
starts a throwaway CPU-only JAX process per flag and reports the ones the
installed jaxlib rejects (XLA parses every flag, GPU ones included, on any
backend)::

  python -m distrib_train.cluster.xla_flags_check            # checks $XLA_FLAGS; exit 1 if any is rejected
  python -m distrib_train.cluster.xla_flags_check --xla_gpu_enable_latency_hiding_scheduler=true
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

_PROBE = "import jax; jax.devices('cpu')"


def _accepted(flags: Sequence[str]) -> tuple[bool, str]:
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
  return out.returncode == 0, out.stderr


def rejected(flags: str) -> list[str]:
  """The flags in ``flags`` (an ``XLA_FLAGS`` string) this jaxlib rejects."""
  items = shlex.split(flags)
  if not items:
    return []
  ok, _ = _accepted(items)
  if ok:
    return []
  return [flag for flag in items if not _accepted([flag])[0]]


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  flags = " ".join(argv) if argv else os.environ.get("XLA_FLAGS", "")
  bad = rejected(flags)
  import importlib.metadata

  version = importlib.metadata.version("jaxlib")
  if bad:
    for flag in bad:
      print(f"jaxlib {version} rejects XLA flag {flag}", file=sys.stderr)
    return 1
  print(f"jaxlib {version} accepts XLA_FLAGS={flags!r}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
