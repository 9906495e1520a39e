"""XLA flags every test process compiles with (no jax import here).

The tests' programs are tiny and run for milliseconds, while LLVM's
optimizations of each CPU executable took most of the suite's time: level 0,
without the expensive passes, compiles the tiny Llama's steps about twice as
fast. Only compile speed changes; each comparison a test makes is between
programs compiled the same way. The product's own defaults are untouched.
"""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def with_device_count(count: int) -> str:
  """``XLA_FLAGS`` for a test subprocess that emulates ``count`` CPU devices."""
  return f"--xla_force_host_platform_device_count={count} {FAST_COMPILE}"


def without_device_count(env: dict[str, str]) -> dict[str, str]:
  """``env`` for a subprocess that sets its own device count (``--cpu_devices``): the fast-compile flags only."""
  env = dict(env)
  env["XLA_FLAGS"] = FAST_COMPILE
  return env


def add_to_environment() -> None:
  """Adds the fast-compile flags to this process's ``XLA_FLAGS`` (before jax is imported)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if FAST_COMPILE not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE}".strip()
