"""Muon (``optimizer.name: muon``): which params it orthogonalizes, and the same numbers on any mesh.

* Per matrix by hand: each param's update over three steps equals ``optax.contrib.muon`` run on each of its
  matrices alone (every layer's, head's and expert's slice), the embedding, head and norms ``optax.adamw``.
* Meshes: a scanned decoder on fsdp × tensor and a mixture on an expert axis train, with Muon, to the same
  losses and params as on one device (fp32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils

from distrib_train.common.naming import path_str
from helpers import config_steps
from distrib_train.config import run as config_lib
from distrib_train.config import job as job_lib
from distrib_train.optim import muon, chain as optimizers

MUON = [
  "optimizer.name=muon",
  "optimizer.grad_clip_norm=0",
  "optimizer.weight_decay=0.01",
  "optimizer.warmup_steps=0",
  "optimizer.schedule=constant",
  "optimizer.learning_rate=0.02",
  "optimizer.muon.adam_lr=0.005",
]


def _config(*overrides, preset="tiny"):
  return config_lib.load(
    preset,
    ["model.dtype=float32", "model.attention=xla", "data.global_batch_size=8", "data.seq_len=32", *MUON, *overrides],
  )


def test_dimension_numbers_follow_the_logical_axes():
  c = _config()
  moe = _config(
    "model.name=moe",
    "model.attention_kind=mla",
    "model.q_lora_rank=16",
    "model.kv_lora_rank=16",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=16",
  )
  axes = {
    **job_lib.param_axes(job_lib.model_parts(c)),
    **{f"moe/{k}": v for k, v in job_lib.param_axes(job_lib.model_parts(moe)).items()},
  }
  of = lambda name, shape: muon.dimension_numbers_for(axes[name], shape)
  assert of("embed", (256, 64)) is None and of("head", (64, 256)) is None  # vocab: AdamW
  assert of("final_norm", (64,)) is None and of("layers/attn_norm", (2, 64)) is None
  assert of("layers/w_up", (2, 64, 192)) == ((1,), (2,))  # layers: a batch axis
  assert of("layers/wq", (2, 64, 4, 16)) == ((1,), (3,))  # heads: a batch axis
  assert of("layers/wo", (2, 4, 16, 64)) == ((2,), (3,))
  assert of("moe/layers/w_gate", (4, 8, 64, 96)) == ((2,), (3,))  # each expert's own matrix
  assert of("moe/layers/wkv_a", (4, 64, 24)) == ((1,), (2,))  # MLA's down projection: one matrix
  assert of("moe/layers/wkv_b", (4, 16, 4, 32)) == ((1,), (3,))  # its up projection: one per head
  assert of("moe/layers/router", (4, 64, 8)) == ((1,), (2,))
  assert muon.dimension_numbers_for(None, (3, 4)) == ((0,), (1,))  # unannotated: optax's 2-D rule
  assert muon.dimension_numbers_for(None, (2, 3, 4)) is None


def _slices(x, dims):
  """The param's matrices: every index of its batch axes, the reduction axis then the output axis."""
  (red,), (out,) = dims
  batch = [i for i in range(x.ndim) if i not in (red, out)]
  moved = jnp.moveaxis(x, batch + [red, out], list(range(x.ndim)))
  return moved.reshape(-1, x.shape[red], x.shape[out]), (batch, red, out, moved.shape)


def _unslice(m, layout):
  batch, red, out, shape = layout
  return jnp.moveaxis(m.reshape(shape), list(range(len(shape))), batch + [red, out])


def test_update_equals_optax_muon_per_matrix_by_hand():
  c = _config()
  o = c.optimizer
  parts = job_lib.model_parts(c)
  axes = job_lib.param_axes(parts)
  tree = job_lib.job_spec(c, parts=parts).make_state().params
  names = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  opt = optimizers.build(o, 10, "skip", param_axes=axes)
  opt_state, opt_update = opt.init(tree), jax.jit(opt.update)
  ref_muon = optax.contrib.muon(
    o.learning_rate,
    beta=o.muon_beta,
    ns_steps=o.muon_ns_steps,
    weight_decay=o.weight_decay,
    consistent_rms=o.muon_consistent_rms,
  )
  ref_adam = optax.adamw(o.muon_adam_lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, nesterov=True)
  update = {id(t): jax.jit(t.update) for t in (ref_muon, ref_adam)}
  leaves = jax.tree_util.tree_leaves(tree)
  refs = []
  for path, leaf in zip(names, leaves):
    dims = muon.dimension_numbers_for(axes[path_str(path)], leaf.shape)
    if dims is None:
      refs.append((None, ref_adam, ref_adam.init(leaf)))
    else:
      mats, layout = _slices(leaf, dims)
      refs.append((layout, ref_muon, [ref_muon.init(m) for m in mats]))
  params, ref_params = tree, list(leaves)
  key = jax.random.key(1)
  for step in range(3):
    grads = jax.tree_util.tree_map(
      lambda x: jax.random.normal(jax.random.fold_in(key, step * 100 + x.size % 97), x.shape), params
    )
    updates, opt_state = opt_update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    new_refs = []
    for (layout, t, st), g, p, i in zip(refs, jax.tree_util.tree_leaves(grads), ref_params, range(len(refs))):
      if layout is None:
        u, st = update[id(t)](g, st, p)
      else:
        mats_g, _ = _slices(g, ((layout[1],), (layout[2],)))
        mats_p, _ = _slices(p, ((layout[1],), (layout[2],)))
        outs = [update[id(t)](mg, s, mp) for mg, s, mp in zip(mats_g, st, mats_p)]
        u, st = _unslice(jnp.stack([o_[0] for o_ in outs]), layout), [o_[1] for o_ in outs]
      ref_params[i] = p + u
      new_refs.append((layout, t, st))
    refs = new_refs
  for path, got, want in zip(names, jax.tree_util.tree_leaves(params), ref_params):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6, err_msg=path_str(path))


def _train(config, mesh, steps=3):
  out, state = config_steps(config, mesh, steps)
  params = [
    np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree_util.tree_leaves(state.params)
  ]
  return [o["loss"] for o in out], params


@pytest.mark.parametrize(
  "model,axes",
  [("llama", {"fsdp": 4, "tensor": 2}), ("moe", {"fsdp": 2, "expert": 4})],
  ids=["dense-fsdp-tensor", "moe-expert"],
)
def test_muon_on_8_devices_equals_one_device(model, axes):
  config = _config(f"model.name={model}")
  one = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
  eight = jax.make_mesh(tuple(axes.values()), tuple(axes), devices=jax.devices())
  losses_1, params_1 = _train(config, one)
  losses_8, params_8 = _train(config, eight)
  np.testing.assert_allclose(losses_8, losses_1, rtol=2e-5)
  assert losses_1[-1] < losses_1[0]
  for a, b in zip(params_8, params_1):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_the_plan_counts_the_optimizers_collectives_apart():
  """A collective whose op_name lies in the ``optimizer`` scope (``train_state.apply_optimizer``) counts as the
  optimizer's: the plan's "in the optimizer's update" and ``optimizer_wire_bytes``."""
  from distrib_train.podplan import collectives

  hlo = """HloModule step, num_partitions=8

ENTRY %main (x: f32[4,16]) -> f32[8,16] {
  %x = f32[4,16]{1,0} parameter(0)
  %g = f32[8,16]{1,0} all-gather(%x), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jit(main)/optimizer/dot_general"}
  ROOT %h = f32[8,16]{1,0} all-gather(%x), channel_id=2, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/jit(main)/transpose(jvp(loss))/dot_general"}
}
"""
  found = {c.name: c for c in collectives.find_collectives(hlo, (2, 2, 2), ("data", "fsdp", "tensor"))}
  assert found["g"].optimizer and not found["h"].optimizer
  assert collectives.optimizer_wire_bytes(list(found.values())) == found["g"].wire_bytes > 0
