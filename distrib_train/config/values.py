"""Config values from YAML and ``--set``: parsed into each field's type, checked, and misspellings answered.

``coerce(value, kind, key)`` turns what a YAML file or a ``--set key=value``
gives (often a string) into a config field's type, refusing what does not
fit with a ``ConfigError`` that names the key; ``model_field_types`` and
``check_model_value`` do the same for a reference model's fields, which its
own config cannot check before it builds; ``closest_keys`` suggests the keys
a mistyped one may have meant.

Not for: the sections and their defaults, or the checks across fields
(``config.py``, ``config_checks.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Sequence
from typing import Any

from distrib_train.common.text import short_repr
from distrib_train.common.yaml_loader import ConfigError


def closest_keys(key: str, known: Sequence[str]) -> str:
  """Suggestions for a mistyped key: close spellings, then keys that start
  with (or contain) what was typed, in the same section first.

  Args:
    key: the unknown ``section.key``.
    known: every valid key (``config.valid_keys``).

  Returns:
    ``did you mean …?``, or the valid keys when none is close.
  """
  section, _, field = key.rpartition(".")
  close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
  if field:
    same = [k for k in known if k.rpartition(".")[0] == section]
    initials = lambda k: "".join(w[:1] for w in k.rpartition(".")[2].split("_"))
    close = [k for k in same if initials(k) == field and "_" in k] + close  # lr → learning_rate
    close += [k for k in same if k.rpartition(".")[2].startswith(field[:2]) and k not in close]
    close += [k for k in difflib.get_close_matches(key, same, n=3, cutoff=0.5) if k not in close]
  if close:
    return f"did you mean {', '.join(close[:3])}?"
  return f"valid keys: {', '.join(sorted(known))}."


def coerce(value: Any, kind: Any, key: str) -> Any:
  """``value`` as ``kind``; strings (from ``--set`` or YAML) are parsed.

  Args:
    value: what the YAML file or ``--set`` gave.
    kind: the field's type (``int``, ``float``, ``bool``, ``str`` or a tuple
      of strings).
    key: the ``section.key``, for the message.

  Raises:
    ConfigError: a value that is not of ``kind`` (or not finite), the key named.
  """

  def wrong(what: str) -> ConfigError:
    return ConfigError(f"{key} must be {what}, got {short_repr(value)}.")

  origin = typing.get_origin(kind)
  if origin is tuple:
    item = (typing.get_args(kind) or (str,))[0]
    if isinstance(value, str):
      value = [v.strip() for v in value.split(",") if v.strip()]
    if item is int and isinstance(value, (list, tuple)):
      try:
        numbers = [float(v) if not isinstance(v, bool) else 0.5 for v in value]
      except (TypeError, ValueError):
        raise wrong("a list of integers (0,1,2)") from None
      if not all(n.is_integer() for n in numbers):
        raise wrong("a list of integers (0,1,2)")
      value = [int(n) for n in numbers]
    if item is float and isinstance(value, (list, tuple)):
      try:
        value = (
          [float(v) for v in value if not isinstance(v, bool)] if not any(isinstance(v, bool) for v in value) else None
        )
      except (TypeError, ValueError):
        value = None
      if value is None or not all(math.isfinite(v) for v in value):
        raise wrong("a list of finite numbers (1.0,0.5)")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, item) for v in value):
      raise wrong("a list of integers (0,1,2)" if item is int else "a list of strings (a,b,c)")
    return tuple(value)
  if kind is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
      return value.lower() in ("true", "yes", "1", "on")
    raise wrong("true or false")
  numbers = {int: (int, "an integer"), float: ((int, float), "a number")}
  if kind in numbers:
    accepted, what = numbers[kind]
    if not isinstance(value, bool):
      number = None
      if isinstance(value, (accepted, str)):
        try:
          number = kind(value)
        except (ValueError, OverflowError):  # not a number, or an int too large for a float
          pass
      if number is not None:
        if not math.isfinite(number):  # nan or inf would poison the run, not stop it
          raise wrong("finite")
        return number
    raise wrong(what)
  if kind is str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return str(value)
    if not isinstance(value, str):
      raise wrong("a string")
    return value
  raise ConfigError(f"{key}: unsupported type {kind}.")  # pragma: no cover - a field type this code lacks


def model_field_types(name: str, preset: str) -> dict[str, type]:
  """Field → type of the named model's config, from the preset's values.

  Raises:
    ConfigError: no such model or preset.
  """
  from distrib_train import recipes

  try:
    recipe = recipes.get(name, preset)
  except ValueError as e:
    raise ConfigError(f"model: {e}") from None
  config = recipe.config
  hints = typing.get_type_hints(type(config))  # tuple[str, ...] and tuple[int, ...] keep their items' type
  return {
    f.name: hints[f.name] if typing.get_origin(hints[f.name]) is tuple else type(getattr(config, f.name))
    for f in dataclasses.fields(config)
  }


# integer model fields where 0 is a setting (off), not a size
_MAY_BE_ZERO = ("max_segments", "fp8_min_dim", "sliding_window", "q_lora_rank", "lora_rank", "mtp_depth")


def check_model_value(key: str, value: Any, field: str = "") -> Any:
  """What a model config cannot catch before it builds: every integer field
  of the reference models is a size (0 or less fails deep inside jit, or
  trains and then fails to checkpoint), and a dtype must name a float type.

  Returns:
    ``value``, unchanged.

  Raises:
    ConfigError: a size below 1 or a dtype that is not a float type, the key named.
  """
  zero_ok = (field or key.rsplit(".", 1)[-1]) in _MAY_BE_ZERO  # field: model.lora.rank's is lora_rank
  if isinstance(value, int) and not isinstance(value, bool) and value < (0 if zero_ok else 1):
    raise ConfigError(f"{key} must be at least {0 if zero_ok else 1}, got {short_repr(value)}.")
  if key.endswith("dtype"):
    import jax.numpy as jnp

    try:
      floating = jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except (TypeError, ValueError, SyntaxError):  # numpy's dtype parser raises all three ("01": SyntaxError)
      floating = False
    if not floating:
      raise ConfigError(f"{key} must name a float dtype (float32, bfloat16, float16), got {short_repr(value)}.")
  return value
