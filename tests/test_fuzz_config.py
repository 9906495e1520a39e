"""Property-based fuzzing of the config and mesh-config loaders (hypothesis).

The contract: whatever a YAML file or a ``--set`` holds, the loaders either
return a checked object or raise their own documented error — ``ConfigError``
for the run config, ``ValueError`` (``ConfigError`` is one) for mesh configs
and axis rules — with a one-line message. Never a ``KeyError``,
``TypeError``, ``AttributeError``, ``OverflowError`` or a YAML internal.
"""

from __future__ import annotations

import math

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import distrib_train as dt  # noqa: E402
from distrib_train.config import run as config_lib  # noqa: E402
from distrib_train.sharding.mesh import MeshConfig, find_mesh_config  # noqa: E402

# No example database: nothing is written into the checkout, and every run is fresh.
FUZZ = settings(
  max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Scalars a YAML file can hold, the nasty ones included.
scalars = st.one_of(
  st.none(),
  st.booleans(),
  st.integers(min_value=-(10**30), max_value=10**30),
  st.integers(-3, 300),
  st.floats(allow_nan=True, allow_infinity=True),
  st.text(max_size=12),
  st.sampled_from(["", "-1", "0", "1e400", "nan", "true", "tiny", "cpu-8", "fsdp_tensor", "a,b", "~", "8"]),
)
values = st.recursive(
  scalars,
  lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
  max_leaves=8,
)

_CONFIG_KEYS = config_lib.valid_keys(
  ["d_model", "num_layers", "num_heads", "num_kv_heads", "dtype", "remat", "vocab_size", "scan_layers"]
)
_SECTIONS = ["model", "optimizer", "data", "train"]
config_keys = st.one_of(st.sampled_from([k.partition(".")[2] for k in _CONFIG_KEYS if "." in k]), st.text(max_size=8))
sections = st.dictionaries(config_keys, values, max_size=4)
config_docs = st.dictionaries(
  st.one_of(st.sampled_from(_SECTIONS + ["mesh_config"]), st.text(max_size=6), st.integers(), st.none()),
  st.one_of(sections, values),
  max_size=4,
)


def _assert_one_line(error: Exception) -> None:
  message = str(error)
  assert message and "\n" not in message, repr(message)


def _load_config_text(path, text: str) -> None:
  path.write_text(text, encoding="utf-8")
  try:
    config = config_lib.load(str(path))
  except config_lib.ConfigError as e:
    _assert_one_line(e)
  else:
    assert config.train.steps >= 1 and math.isfinite(config.optimizer.learning_rate)


@FUZZ
@given(doc=config_docs)
def test_config_mappings_load_or_raise_config_error(tmp_path, doc):
  _load_config_text(tmp_path / "c.yaml", yaml.safe_dump(doc, allow_unicode=True))


@FUZZ
@given(
  text=st.one_of(
    st.text(max_size=80),
    st.lists(
      st.sampled_from(
        [
          "train:",
          "  steps: 3",
          "- a",
          "{",
          "}",
          "[",
          ": x",
          "\t",
          "&a x",
          "*a",
          "!!python/object/apply:os.getcwd []",
          "? [a]",
          "---",
          "model: {preset: huge}",
          "data: {paths: [1]}",
          "'",
          '"\\x',
        ]
      ),
      max_size=6,
    ).map("\n".join),
  )
)
def test_config_text_loads_or_raises_config_error(tmp_path, text):
  _load_config_text(tmp_path / "c.yaml", text)


assignments = st.builds(
  lambda k, v: f"{k}={v}", st.sampled_from(_CONFIG_KEYS), st.one_of(st.text(max_size=10), scalars.map(str))
)


@FUZZ
@given(items=st.lists(st.one_of(assignments, st.text(max_size=16)), max_size=4))
def test_set_overrides_load_or_raise_config_error(items):
  try:
    config_lib.load("tiny", items)
  except config_lib.ConfigError as e:
    _assert_one_line(e)


# --- mesh configs and axis rules ---------------------------------------------------------

axis_names = st.one_of(st.sampled_from(["data", "fsdp", "tensor", "x"]), st.text(max_size=4), st.integers(), st.none())
sizes = st.one_of(st.integers(-2, 16), st.sampled_from([-1, 1, 2, 4, 8]), scalars)
axis_specs = st.one_of(
  sizes, st.dictionaries(st.one_of(st.sampled_from(["ici", "dcn"]), st.text(max_size=4)), sizes, max_size=3)
)
rule_mesh_axes = st.one_of(
  st.none(),
  st.sampled_from(["data", "fsdp", "tensor", "x"]),
  st.lists(st.sampled_from(["data", "fsdp", "tensor", "x"]), max_size=3),
  scalars,
)
rules = st.one_of(
  st.sampled_from(["fsdp_tensor", "data_parallel", "nope"]),
  scalars,
  st.lists(
    st.one_of(st.tuples(st.one_of(st.sampled_from(["batch", "embed", "mlp"]), scalars), rule_mesh_axes), values),
    max_size=4,
  ),
)
param_axes = st.one_of(
  scalars,
  st.lists(
    st.one_of(
      st.tuples(
        st.sampled_from([".*", "(", r"\d+/w", "a"]),
        st.lists(st.one_of(st.sampled_from(["embed", "mlp"]), st.none(), st.integers()), max_size=3),
      ),
      values,
    ),
    max_size=3,
  ),
)
mesh_docs = st.fixed_dictionaries(
  {},
  optional={
    "axes": st.one_of(st.dictionaries(axis_names, axis_specs, max_size=4), values),
    "rules": rules,
    "param_axes": param_axes,
    "devices": st.one_of(st.sampled_from([1, 8, 16]), scalars),
    "granules": st.one_of(st.sampled_from([1, 2]), scalars),
    "extra": values,
  },
)


def _load_mesh(doc) -> None:
  try:
    mesh_config = MeshConfig.from_dict(doc, source="fuzz.yaml")
    mesh_config.resolve(8, 1)
  except ValueError as e:
    _assert_one_line(e)


@FUZZ
@given(doc=st.one_of(mesh_docs, values))
def test_mesh_configs_load_or_raise_value_error(doc):
  _load_mesh(doc)


@FUZZ
@given(doc=mesh_docs)
def test_mesh_config_files_load_or_raise_value_error(tmp_path, doc):
  path = tmp_path / "m.yaml"
  try:
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
  except yaml.YAMLError:  # a value safe_dump cannot write is no file to read
    return
  try:
    MeshConfig.from_yaml(path)
  except ValueError as e:
    _assert_one_line(e)


@FUZZ
@given(text=st.text(max_size=40))
def test_mesh_config_names_resolve_or_raise_value_error(text):
  try:
    path = find_mesh_config(text)
  except ValueError as e:
    _assert_one_line(e)
  else:
    assert path.endswith(".yaml")


@FUZZ
@given(
  rule_list=rules,
  patterns=param_axes,
  logical=st.lists(
    st.one_of(st.sampled_from(["batch", "embed", "mlp", "heads"]), st.none(), st.integers()), max_size=3
  ),
)
def test_axis_rules_build_and_resolve_or_raise_value_error(rule_list, patterns, logical):
  try:
    axis_rules = dt.AxisRules(rule_list, param_axes=patterns)
    axis_rules.spec(logical)
  except ValueError as e:
    _assert_one_line(e)
