"""Muon on the right matrices: which params Newton–Schulz orthogonalizes, and along which axes.

``optax.contrib.muon`` orthogonalizes every leaf it is given dimension numbers for
(``MuonDimensionNumbers``: the reduction and output axes; every other axis is a batch axis, each slice its own
matrix) and sends the rest to AdamW. Its default — every 2-D leaf to Muon — is backwards for a scanned decoder
(the ``[layers, in, out]`` kernels are 3-D, the embedding and head 2-D), so ``dimension_numbers`` reads each
param's logical axes instead:

* AdamW: the embedding and the output head (an axis named ``vocab``), and whatever has fewer than two axes left
  once the batch axes are set aside — norms, biases, the router's bias (Moonlight's split).
* Batch axes: ``layers`` (a scanned stack), ``expert`` (each expert's matrix on its own, as Moonlight and
  Kimi K2 train DeepSeek-style mixtures) and the head axes ``heads`` / ``kv_heads`` (each head's projection its
  own matrix).
* The two axes left are the projection's reduction (input) and output axes, in the weight's order: the
  decoder's weights are all ``x @ W`` ``[in, out]`` (``wq`` ``[embed | heads, head_dim]``, ``wo``
  ``[heads | head_dim, embed]``, ``w_down`` ``[mlp, embed]``, an expert's ``[expert | embed, expert_mlp]``).
  MLA's down projections (``wq_a`` ``[embed, latent]``, ``wkv_a`` ``[embed, kv_lora + rope]``) are one matrix
  each, its up projections (``wq_b``, ``wkv_b`` ``[latent | heads, head_dim]``) one per head; the router
  ``[embed, experts]`` is a matrix. More than two axes left (a model of the user's with other names): all but
  the last reduce.
* A param without logical axes: optax's rule (2-D → Muon).

Not for: building the optimizer (``optimizers.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from optax.contrib import MuonDimensionNumbers

from distrib_train.common.naming import path_str

BATCH_AXES = ("layers", "expert", "heads", "kv_heads")
ADAMW_AXES = ("vocab",)


def dimension_numbers_for(axes: tuple[str | None, ...] | None, shape: tuple[int, ...]) -> MuonDimensionNumbers | None:
  """One param's: its ``MuonDimensionNumbers``, or None for AdamW (module docstring)."""
  if axes is None or len(axes) != len(shape):
    return MuonDimensionNumbers((0,), (1,)) if len(shape) == 2 else None
  if any(a in ADAMW_AXES for a in axes):
    return None
  matrix = [i for i, a in enumerate(axes) if a not in BATCH_AXES]
  if len(matrix) < 2:
    return None
  return MuonDimensionNumbers(tuple(matrix[:-1]), (matrix[-1],))


def dimension_numbers(axes_by_path: Mapping[str, tuple[str | None, ...]]) -> Any:
  """``optax.contrib.muon``'s ``muon_weight_dimension_numbers`` as a function of the params (or updates): each
  leaf's from its ``/``-path's logical axes in ``axes_by_path`` (``models.annotated_axes``). A path is looked up
  whole, then without its leading keys (the optimizer may see ``params`` of a flax fp8 model, not the whole
  collection)."""

  def find(path: tuple[Any, ...]) -> tuple[str | None, ...] | None:
    name = path_str(path)
    if name in axes_by_path:
      return axes_by_path[name]
    return next((v for k, v in axes_by_path.items() if k.endswith("/" + name)), None)

  def of(tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda path, x: dimension_numbers_for(find(path), x.shape), tree)

  return of


def describe(params: Any, axes_by_path: Mapping[str, tuple[str | None, ...]]) -> dict[str, str]:
  """Each param's treatment, by path: ``muon reduce (1,) out (2,)`` or ``adamw`` (for the plan and the docs)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dims = dimension_numbers_for(axes_by_path.get(path_str(path)), tuple(leaf.shape))
    out[path_str(path)] = "adamw" if dims is None else f"muon reduce {dims.reduction_axis} out {dims.output_axis}"
  return out
