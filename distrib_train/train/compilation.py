"""Compiling the step once: the persistent cache, cache hits, memory report.

- ``setup_compilation_cache(dir)``: executables go to (and come from) a
  directory, so a relaunch skips compilation.
- ``CacheEvents``: counts persistent-cache hits and misses while entered
  (the trainer says whether the step came from the cache).
- ``memory_line(compiled)``: the compiled step's per-device memory analysis
  in one line.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from distrib_train.common.text import human_bytes
from distrib_train.common.versions import jax_version


def setup_compilation_cache(directory: str, enable: bool = True) -> str | None:
  """Points JAX's persistent compilation cache at ``directory`` ('' : off).

  Takes effect even when this process compiled something before (JAX
  decides whether to use the cache once, at the first compile).

  With ``enable`` False the directory is only checked (created), and the
  cache is off for this process's compiles from here on.

  Raises:
    ValueError: the directory cannot be created.
  """
  from jax.experimental.compilation_cache import compilation_cache

  if not directory:
    return None
  path = os.path.abspath(os.path.expanduser(directory))
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"train.compilation_cache_dir {directory!r} cannot be created: {e.strerror}.") from None
  if jax.config.jax_enable_compilation_cache != enable:  # a cache an earlier run in this process turned on too
    jax.config.update("jax_enable_compilation_cache", enable)
    compilation_cache.reset_cache()
  if not enable:
    return None
  if jax.config.jax_compilation_cache_dir != path:
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()
  # Cache every executable, the small ones too: a relaunch then compiles nothing.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def cache_unsafe_reason() -> str | None:
  """Why this process must not load multi-device executables from the persistent cache, or None.

  jax 0.10 on CPU: a step with collectives loaded from the cache can deadlock in its first all-gather (seen
  with fsdp 8 on 8 emulated devices: one device's thread runs ahead to a later collective and the runtime
  aborts after 40 s; the same program compiled afresh, or cached with jax 0.12, runs). BUILD_NOTES.md.
  """
  if jax_version() < (0, 11) and jax.default_backend() == "cpu" and jax.device_count() > 1:
    return (
      f"off: jax {jax.__version__} on CPU can deadlock in the collectives of a multi-device step"
      " loaded from the persistent cache (jax 0.11 and later, GPU and TPU use it)"
    )
  return None


class CacheEvents:
  """Counts persistent-cache hits and misses while it is entered."""

  def __enter__(self):
    self.hits = self.misses = 0
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def _on_event(self, event: str, **kwargs: Any) -> None:
    del kwargs
    if event == "/jax/compilation_cache/cache_hits":
      self.hits += 1
    elif event == "/jax/compilation_cache/cache_misses":
      self.misses += 1

  def __exit__(self, *exc_info: Any) -> None:
    jax.monitoring.unregister_event_listener(self._on_event)


def memory_line(compiled: Any) -> str:
  try:
    m = compiled.memory_analysis()
  except Exception:  # not every backend reports it
    m = None
  if m is None:
    return "no memory analysis on this backend."
  size = human_bytes
  return (
    f"per device: arguments {size(m.argument_size_in_bytes)}, outputs {size(m.output_size_in_bytes)}"
    f" (aliased {size(m.alias_size_in_bytes)}), temporaries {size(m.temp_size_in_bytes)}, code"
    f" {size(m.generated_code_size_in_bytes)}."
  )
