"""Text for people: a value cut to a readable length, a byte count in its unit, a command's one-line refusal."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

MAX_MESSAGE_VALUE = 80  # characters of a value repeated in an error message


def short_repr(value: Any, limit: int = MAX_MESSAGE_VALUE) -> str:
  """``repr(value)``, cut to ``limit`` characters for an error message (a
  value may be a huge string or a deeply shared structure)."""
  try:
    text = reprlib_repr(value)
  except RecursionError:  # a self-referencing structure nested past reprlib's levels
    text = f"<{type(value).__name__}>"
  return text if len(text) <= limit else f"{text[:limit]}… ({type(value).__name__}, cut)"


def reprlib_repr(value: Any) -> str:
  import reprlib

  shortener = reprlib.Repr()
  shortener.maxstring = shortener.maxother = shortener.maxlong = MAX_MESSAGE_VALUE
  shortener.maxlevel = 3
  return shortener.repr(value)


def human_bytes(n: float | None) -> str:
  """``n`` bytes in the largest unit that keeps it at or above 1 (B … TiB);
  ``-`` for None (a figure a backend did not report)."""
  if n is None:
    return "-"
  sign = "-" if n < 0 else ""
  n = abs(n)
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def fail(message: str) -> NoReturn:
  """A ``distrib-train`` command's refusal: one ``error:`` line on stderr, exit status 2."""
  print(f"distrib-train: error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)
