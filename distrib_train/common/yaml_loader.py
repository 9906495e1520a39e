"""Reading YAML that people wrote: safely, and within bounds.

Both the run config (``config/run.py``) and the mesh configs
(``sharding/mesh.py``) read YAML through ``safe_load_yaml``: a SafeLoader (no
Python tags, so no code runs), no key given twice, nesting and alias
expansion bounded, and one ``ConfigError`` line naming the file otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from distrib_train.common.text import MAX_MESSAGE_VALUE

# Bounds on what a YAML document may expand to: an alias bomb (a few hundred
# bytes of nested aliases) expands to billions of nodes, and deep nesting
# overflows the recursive composer. Real configs are a few levels and nodes.
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000


class ConfigError(ValueError):
  """A configuration mistake; the message names the key or file."""


class _UniqueKeyLoader(yaml.SafeLoader):
  """``yaml.SafeLoader`` (no Python tags, so no code runs) that refuses a key
  given twice in one mapping, where plain YAML silently keeps the last."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=True)
      try:
        repeated = key in seen
        seen.add(key)
      except TypeError:  # an unhashable key; construct_mapping names it below
        continue
      if repeated:
        raise yaml.constructor.ConstructorError(
          "while constructing a mapping", node.start_mark, f"found the key {key!r} twice", key_node.start_mark
        )
    return super().construct_mapping(node, deep)

  def compose_node(self, parent, index):
    # The composer recurses once per level: refuse deep nesting before Python's recursion limit.
    self._depth = getattr(self, "_depth", 0) + 1
    try:
      if self._depth > MAX_YAML_DEPTH:
        mark = self.peek_event().start_mark
        raise _YamlTooLarge(
          f"nests deeper than {MAX_YAML_DEPTH} levels (line {mark.line + 1}, column {mark.column + 1})"
        )
      return super().compose_node(parent, index)
    finally:
      self._depth -= 1

  def get_single_data(self):
    node = self.get_single_node()
    if node is None:
      return None
    nodes = _expanded_nodes(node, {})
    if nodes > MAX_YAML_NODES:
      raise _YamlTooLarge(
        f"expands to more than {MAX_YAML_NODES:,} values through its aliases ({nodes:,}); a config needs far fewer"
      )
    return self.construct_document(node)


class _YamlTooLarge(yaml.YAMLError):
  """A document beyond ``MAX_YAML_DEPTH`` / ``MAX_YAML_NODES``."""


def _expanded_nodes(node: yaml.Node, counted: dict[int, int | None]) -> int:
  """How many nodes ``node`` stands for once every alias is expanded; a
  shared node is counted once per use, but computed once (bombs are cheap
  to measure). Recursion depth is bounded by the composer's depth check."""
  key = id(node)
  if key in counted:
    if counted[key] is None:
      raise _YamlTooLarge("holds an alias inside its own anchor (a recursive structure)")
    return counted[key]
  counted[key] = None
  if isinstance(node, yaml.SequenceNode):
    total = 1 + sum(_expanded_nodes(child, counted) for child in node.value)
  elif isinstance(node, yaml.MappingNode):
    total = 1 + sum(_expanded_nodes(k, counted) + _expanded_nodes(v, counted) for k, v in node.value)
  else:
    total = 1
  counted[key] = total
  return total


def safe_load_yaml(path: str | os.PathLike, what: str = "Config") -> Any:
  """A YAML file's content, safely: no Python tags, no repeated keys.

  Raises:
    ConfigError: the file cannot be read, is not UTF-8 or not valid YAML;
      one line that names ``what`` and the file.
  """
  try:
    with open(path, encoding="utf-8") as f:
      return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
  except OSError as e:
    raise ConfigError(f"Cannot read {what.lower()} {os.fspath(path)!r}: {e.strerror}.") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"{what} {os.fspath(path)!r} is not UTF-8 text (byte {e.start}).") from None
  except _YamlTooLarge as e:
    raise ConfigError(f"{what} {os.fspath(path)!r} is refused: it {e}.") from None
  except yaml.YAMLError as e:
    message = " ".join(str(e).split())
    if len(message) > 4 * MAX_MESSAGE_VALUE:
      message = message[: 4 * MAX_MESSAGE_VALUE] + "… (cut)"
    raise ConfigError(f"{what} {os.fspath(path)!r} is not valid YAML: {message}") from None
