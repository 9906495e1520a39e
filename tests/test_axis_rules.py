"""AxisRules: flax / T5X rule semantics, divisibility skips, and errors."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import distrib_train as dt
from distrib_train.sharding.axis_rules import FSDP_TENSOR_RULES

RULES = [
  ("batch", ("data", "fsdp")),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("embed", "fsdp"),
  ("kv", None),
  ("vocab", ("fsdp", "tensor")),
]


@pytest.mark.parametrize(
  "logical_axes, expected",
  [
    # One name per dimension, each with its own rule.
    (("embed", "mlp"), P("fsdp", "tensor")),
    # The earlier *rule* wins a contested mesh axis, not the earlier dim.
    (("heads", "mlp"), P(None, "tensor")),
    (("mlp", "heads"), P("tensor", None)),
    (("embed", "heads"), P("fsdp", "tensor")),
    (("embed", "mlp", "heads"), P("fsdp", "tensor", None)),
    # A tuple rule needs all of its mesh axes free.
    (("batch", "embed"), P(("data", "fsdp"), None)),
    # embed's rule comes first and takes fsdp, wherever embed stands.
    (("vocab", "embed"), P(None, "fsdp")),
    (("embed", "vocab"), P("fsdp", None)),
    (("vocab", "mlp"), P(None, "tensor")),
    (("vocab", "length"), P(("fsdp", "tensor"), None)),
    # A None rule claims the dimension as replicated.
    (("kv", "embed"), P(None, "fsdp")),
    # Names without a rule, and unnamed dimensions, are replicated.
    (("unknown", "mlp"), P(None, "tensor")),
    ((None, "mlp"), P(None, "tensor")),
    ((None, None), P(None, None)),
    ((), P()),
  ],
)
def test_rule_resolution_follows_flax_priority_semantics(logical_axes, expected):
  assert dt.AxisRules(RULES).spec(logical_axes) == expected


def test_none_rule_blocks_later_rules_for_the_same_name():
  rules = dt.AxisRules([("embed", None), ("embed", "fsdp")])
  assert rules.spec(("embed",)) == P(None)


def test_later_rule_for_a_name_is_used_when_the_first_axis_is_taken():
  rules = dt.AxisRules([("mlp", "tensor"), ("heads", "tensor"), ("heads", "fsdp")])
  assert rules.spec(("heads", "mlp")) == P("fsdp", "tensor")


def test_single_axis_tuple_is_normalised_to_a_name():
  assert dt.AxisRules([("embed", ("fsdp",))]).spec(("embed",)) == P("fsdp")


def test_strict_rules_reject_a_name_without_a_rule():
  rules = dt.AxisRules(RULES, strict=True)
  with pytest.raises(ValueError, match="'unknown'"):
    rules.spec(("unknown", "mlp"))
  assert rules.spec(("embed", "mlp")) == P("fsdp", "tensor")


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def test_rule_that_does_not_divide_is_skipped_for_the_next_rule():
  mesh = _mesh((2, 4), ("fsdp", "tensor"))
  rules = dt.AxisRules([("heads", "tensor"), ("heads", "fsdp")])
  spec, skips = rules.resolve(("embed", "heads"), shape=(16, 6), mesh=mesh, path="attn/q")
  assert spec == P(None, "fsdp")
  assert len(skips) == 1
  skip = skips[0]
  assert (skip.path, skip.dim, skip.logical_name, skip.dim_size, skip.mesh_axes, skip.mesh_axes_size) == (
    "attn/q",
    1,
    "heads",
    6,
    ("tensor",),
    4,
  )
  assert "6 is not a multiple of 4" in str(skip)


def test_skipped_rule_leaves_its_mesh_axis_free_for_other_dims():
  mesh = _mesh((2, 4), ("fsdp", "tensor"))
  rules = dt.AxisRules([("heads", "tensor"), ("mlp", "tensor")])
  assert rules.spec(("heads", "mlp"), shape=(6, 8), mesh=mesh) == P(None, "tensor")


def test_without_shape_no_divisibility_check_is_made():
  mesh = _mesh((2, 4), ("fsdp", "tensor"))
  assert dt.AxisRules([("heads", "tensor")]).spec(("heads",), mesh=mesh) == P("tensor")


def test_param_axes_full_match_first_wins():
  rules = dt.AxisRules([], param_axes=[(r"layers/\d+/w", ("embed", "mlp")), (r".*/w", ("mlp", "embed"))])
  assert rules.axes_for_path("layers/3/w") == ("embed", "mlp")
  assert rules.axes_for_path("head/w") == ("mlp", "embed")
  assert rules.axes_for_path("layers/3/w_extra") is None
  assert rules.axes_for_path("x/layers/3/b") is None


def test_named_rule_set():
  assert dt.AxisRules("fsdp_tensor").rules == dt.AxisRules(list(FSDP_TENSOR_RULES)).rules
  with pytest.raises(ValueError, match="Unknown axis rule set 'nope'.*fsdp_tensor"):
    dt.AxisRules("nope")


@pytest.mark.parametrize(
  "rules, message",
  [
    ([("embed",)], r"axis rule #0 .*pair"),
    ([("embed", "fsdp", "x")], r"axis rule #0 .*pair"),
    ([(3, "fsdp")], r"axis rule #0 .*logical name must be a non-empty string"),
    ([("embed", "fsdp"), ("mlp", 7)], r"axis rule #1 .*mesh axes must be"),
    ([("embed", ("fsdp", "fsdp"))], r"repeat an axis"),
    ("not-a-list-of-rules", r"Unknown axis rule set"),
    ({"embed": "fsdp"}, r"must be a sequence"),
  ],
)
def test_malformed_rules_are_rejected_naming_the_rule(rules, message):
  with pytest.raises(ValueError, match=message):
    dt.AxisRules(rules)


def test_repeated_logical_name_in_one_array_is_an_error():
  with pytest.raises(ValueError, match="'embed' appear more than once"):
    dt.AxisRules(RULES).spec(("embed", "embed"))


def test_rule_naming_an_unknown_mesh_axis_the_mesh_lacks_is_an_error():
  mesh = _mesh((8,), ("data",))
  with pytest.raises(
    ValueError,
    match="names mesh axis 'fsdpp', which the mesh does not have .* A mesh may leave"
    " out only context, data, expert, fsdp, stage, tensor",
  ):
    dt.AxisRules([("embed", "fsdpp")]).spec(("embed",), shape=(8,), mesh=mesh)


@pytest.mark.parametrize(
  "logical_axes, shape, expected",
  [
    (("embed", "mlp"), (8, 6), P("fsdp", None)),  # ("mlp", "tensor"): tensor is size 1, mlp whole
    (("batch", "length"), (8, 4), P(("data", "fsdp"), None)),  # ("batch", (data, fsdp, expert)) without expert
    (("expert", "embed", "expert_mlp"), (2, 8, 6), P(None, "fsdp", None)),
    (("layers", "vocab", "length"), (2, 6, 4), P(None, None, None)),
  ],
)
def test_a_known_mesh_axis_the_mesh_leaves_out_reads_as_size_1(logical_axes, shape, expected):
  # data × fsdp only: tensor, stage, expert and context split nothing, as on a mesh where they have size 1;
  # strict rules do not fail for them (a size-1 axis is a usable rule).
  mesh = _mesh((2, 4), ("data", "fsdp"))
  spec, skips = dt.AxisRules("fsdp_tensor", strict=True).resolve(logical_axes, shape=shape, mesh=mesh)
  assert spec == expected and not skips


def test_a_missing_axis_in_a_tuple_rule_leaves_the_rest_of_the_rule():
  mesh = _mesh((2, 4), ("data", "fsdp"))
  rules = dt.AxisRules([("embed", ("fsdp", "tensor")), ("batch", ("data", "fsdp", "expert"))])
  assert rules.spec(("embed",), shape=(8,), mesh=mesh) == P("fsdp")
  assert rules.spec(("batch",), shape=(8,), mesh=mesh) == P(("data", "fsdp"))
  assert rules.spec(("batch", "embed"), shape=(8, 8), mesh=mesh) == P(None, "fsdp")  # embed's rule comes first


def test_a_fallback_that_differs_only_in_a_missing_axis_records_one_skip():
  mesh = _mesh((2, 4), ("data", "fsdp"))
  spec, skips = dt.AxisRules("fsdp_tensor").resolve(("batch",), shape=(6,), mesh=mesh)
  assert spec == P(None) and [str(s) for s in skips] == [
    "dim 0 ('batch', size 6) not split over data×fsdp (size 8): 6 is not a multiple of 8"
  ]


def test_logical_axes_of_the_wrong_rank_is_an_error_naming_the_path():
  with pytest.raises(ValueError, match="w: logical axes .* have 2 entries but the array has rank 3"):
    dt.AxisRules(RULES).resolve(("embed", "mlp"), shape=(2, 3, 4), path="w")


@pytest.mark.parametrize("axes", ["embed", 3, ("embed", 3)])
def test_logical_axes_must_be_a_tuple_of_names(axes):
  with pytest.raises(ValueError, match="logical"):
    dt.AxisRules(RULES).spec(axes)


def test_bad_param_axes_regex_is_an_error():
  with pytest.raises(ValueError, match="bad regex"):
    dt.AxisRules([], param_axes=[("(", ("embed",))])


def test_with_param_axes_puts_new_patterns_first():
  rules = dt.AxisRules(RULES, param_axes=[(r".*", ("embed",))]).with_param_axes([(r"w", ("mlp",))])
  assert rules.rules == dt.AxisRules(RULES).rules
  assert rules.axes_for_path("w") == ("mlp",)
  assert rules.axes_for_path("b") == ("embed",)
