"""Optional packages, imported where a feature needs one, or refused in one line.

distrib_train's core needs jax, flax, optax, orbax, grain and jinja2; the
rest is imported only by the feature that needs it. ``require`` is that
import: without the package it raises ``MissingPackageError``, a
``ValueError`` whose one line names the feature (the config key or file that
asked for it), the package and the extra of ``setup.py`` that installs it.
The trainer's set-up turns it into one ``distrib-train: error:`` line before
anything is written.

Not for: jax's own plugins (libtpu, the CUDA plugin: ``podplan/tpu.py`` and
``podplan/gpu.py`` name the exact versions to install).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Each optional package and the extra of setup.py that brings it.
EXTRAS = {
  "jinja2": "text",  # also a core dependency (chat templates): missing only from a broken environment
  "tokenizers": "text",
  "sentencepiece": "text",
  "tiktoken": "text",
  "pyarrow": "text",
  "zstandard": "text",
  "datasets": "datasets",
  "penzai": "penzai",
  "lm_eval": "eval",
  "math_verify": "rl",
}


class MissingPackageError(ValueError):
  """An optional package a feature needs is not installed (the message says which, and how to install it)."""


def require(module: str, feature: str) -> ModuleType:
  """``module`` imported, for ``feature`` (a config key, a file), or one line that says what to install.

  Raises:
    MissingPackageError: ``feature needs <package>: pip install 'distrib_train[<extra>]'``.
  """
  try:
    return importlib.import_module(module)
  except ImportError:
    package = module.split(".")[0]
    extra = EXTRAS.get(package)
    fix = f"pip install 'distrib_train[{extra}]'" if extra else f"pip install {package}"
    name = {"lm_eval": "lm-eval", "math_verify": "math-verify"}.get(package, package)
    raise MissingPackageError(f"{feature} needs {name}: {fix}") from None
