"""Installed versions as numbers: ``jax_version() >= (0, 11)``; a GPU's compute capability: ``gpu_capability(device)``.

Behaviour that differs between jax releases (the persistent cache's CPU
deadlock on jax 0.10, ``train/compilation.py``) is chosen by comparing
tuples of ints, parsed here once.

Not for: pinning or checking requirements (``pyproject.toml``).
"""

from __future__ import annotations

import re

import jax


def release(version: str) -> tuple[int, ...]:
  """The release numbers at the front of a version string.

  ``"0.10.2"`` → ``(0, 10, 2)``; a pre-release or local part ends them:
  ``"0.11.0.dev20250601"`` → ``(0, 11, 0)``, ``"0.12.1rc1"`` → ``(0, 12, 1)``.

  Raises:
    ValueError: the string does not start with a number.
  """
  numbers = []
  for part in version.split("."):
    match = re.match(r"\d+", part)
    if match is None:
      break
    numbers.append(int(match.group()))
    if match.end() != len(part):
      break
  if not numbers:
    raise ValueError(f"Version {version!r} does not start with a release number (like 0.10.2).")
  return tuple(numbers)


def jax_version() -> tuple[int, ...]:
  """The installed jax's release numbers, e.g. ``(0, 10, 2)``; compare a prefix: ``jax_version() >= (0, 11)``."""
  return release(jax.__version__)


def gpu_capability(device) -> tuple[int, int]:
  """A GPU's compute capability as numbers, ``(9, 0)`` for an H100 (``(0, 0)`` for anything else, or where the
  device does not say)."""
  try:
    major, minor = (int(x) for x in str(getattr(device, "compute_capability", "")).split(".")[:2])
  except ValueError:
    return (0, 0)
  return (major, minor) if getattr(device, "platform", "") == "gpu" else (0, 0)
