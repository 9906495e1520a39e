"""DeepSeek-V3's multi-token prediction (MTP): ``model.mtp_depth`` extra modules, each predicting one token further.

With ``mtp_depth`` = D > 0 the decoder carries D modules under ``mtp`` (each
param stacked on a leading ``layers`` axis of size D). Depth k = 1…D, at
position i, reads the previous depth's hidden state and the embedding of the
token k places ahead, and predicts the token k + 1 places ahead:

    h'_k = [enorm(Emb(t_{i+k})) ; hnorm(h_{k-1})] · eh_proj       (embedding first, then hidden: [2·d, d])
    h_k  = block_k(h'_k)                                           (one decoder layer)
    P_k  = softmax(head(shared_head_norm(h_k)))                    (predicts t_{i+k+1})

``h_0`` is the main model's final hidden state after its final norm (what
``Decoder.hidden_and_aux`` returns; vLLM's and SGLang's DeepSeek MTP pass the
same); ``h_k`` for k ≥ 1 is the block's output before ``shared_head_norm``.
The embedding table and the output head are the main model's own (shared,
as in DeepSeek-V3); each block is a layer of the kind the model's last layer
is (a mixture layer in a mixture model) with its own params, built by the
decoder's own param builders, so every attention and MLP variant composes.

The loss (``with_mtp_loss``, called by ``decoder.loss_fn``): the main
cross-entropy + ``mtp_loss_weight`` · the mean over depths of each depth's
mean cross-entropy (DeepSeek-V3's λ/D · Σ_k L_k), plus, for a mixture block,
its balance and z losses under the model's weights, averaged over depths.
aux: ``cross_entropy`` (the main head's, which evaluation's perplexity reads),
``mtp_loss_1`` … ``mtp_loss_D`` (each over its own counted tokens; over
microbatches they are weighed by the main token count, like every aux
figure) and ``loss`` (the total).

Which positions count (``shifted``): depth k at position i counts where
i + k + 1 < length (the last k + 1 positions of a row carry none), with
``segment_ids`` only where ``segment_ids[i] == segment_ids[i + k + 1] > 0``
(no prediction crosses a document's end), weighed by the target token's own
weight (``weights[i + k]``: an SFT loss mask applies). The shifted tokens,
targets and weights are made in the batch's own order, before the context
axis reorders the batch (``decoder.forward``), and reordered with it.

Left out: the MTP block's router bias (DeepSeek-V3's score correction) is
read and written but not moved by ``router_bias_update_rate``; under
``fp8=delayed`` its matmuls scale from the current amax (no history); LoRA
adapters on it train without dropout. Only ``train.objective=lm`` trains MTP
(``objectives.build`` refuses the others). Generation reads the main head
only and never runs these modules.

``checkpoint_depth`` reads how many MTP layers a Hugging Face checkpoint
holds (``hf_shape.py`` sets ``mtp_depth`` from it).

Not for: the main decoder (``decoder.py``), the layers (``blocks.py``), the
Hugging Face names (``hf_tables.mtp_tensors``).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distrib_train.kernels import fp8
from distrib_train.kernels.cross_entropy import chunked_cross_entropy
from distrib_train.recipes import blocks
from distrib_train.recipes.parts import Kind, norm, param, project, token_weights
from distrib_train.sharding.axis_rules import constrain

NAME = "mtp"  # the decoder's attribute, and the top-level key of its params in checkpoints


def kind(config) -> Kind:
  """The kind of each MTP block: the model's last layer's."""
  return config.layer_kinds()[-1]


def params(config, rngs: nnx.Rngs) -> dict[str, Any]:
  """The ``mtp_depth`` modules' params, each stacked on a leading ``layers`` axis: the norms of the embedding and
  the hidden state, their projection, one decoder layer's params (and router score correction), and the norm
  before the shared head."""
  c, pd, n, d = config, jnp.dtype(config.param_dtype), config.mtp_depth, config.d_model
  ones = lambda: param(rngs, (n, d), ("layers", "embed"), pd, None, value=1.0 - c.norm_weight_offset)
  return {
    "enorm": ones(),
    "hnorm": ones(),
    "eh_proj": param(rngs, (n, 2 * d, d), ("layers", "embed", None), pd, fan_in=2 * d),
    "head_norm": ones(),
    **blocks.layer_params(c, rngs, n, kind(c).mixture),
  }


def _ahead(x: jax.Array, k: int) -> jax.Array:
  """``x[:, i + k]`` at each position i of a [batch, length] array; zeros past the row's end."""
  if k == 0:
    return x
  return jnp.concatenate([x[:, k:], jnp.zeros((x.shape[0], k), x.dtype)], axis=1)


def shifted(
  config, targets: jax.Array, segment_ids: jax.Array | None, weights: jax.Array | None
) -> dict[str, jax.Array]:
  """Per depth k, in the batch's own order: ``mtp_tokens_k`` (t_{i+k}, the embedded token), ``mtp_targets_k``
  (t_{i+k+1}) and ``mtp_weights_k`` (float32; 0 where the prediction is not counted: module docstring)."""
  weights = token_weights(targets, segment_ids, weights)
  length = targets.shape[1]
  out = {}
  for k in range(1, config.mtp_depth + 1):
    counted = jnp.broadcast_to(jnp.arange(length) + k + 1 < length, targets.shape)
    if segment_ids is not None:
      counted = counted & (segment_ids == _ahead(segment_ids, k + 1)) & (segment_ids > 0)
    out[f"mtp_tokens_{k}"] = _ahead(targets, k - 1)
    out[f"mtp_targets_{k}"] = _ahead(targets, k)
    out[f"mtp_weights_{k}"] = jnp.where(counted, _ahead(weights, k), 0.0).astype(jnp.float32)
  return out


def _module(
  config, block, layer: dict, hidden: jax.Array, embedded: jax.Array, positions, segment_ids
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """One depth: the block's output ``h_k`` and its routing aux, from ``h_{k-1}`` and the shifted embeddings."""
  e = norm(config, embedded, layer["enorm"])
  h = norm(config, hidden, layer["hnorm"]).astype(e.dtype)
  x = constrain(
    project("btc,cd->btd", jnp.concatenate([e, h], axis=-1), layer, "eh_proj"), ("batch", "length", "embed")
  )
  return block(x, layer, positions, segment_ids)


def with_mtp_loss(
  model,
  hidden: jax.Array,
  rest: dict[str, Any],
  loss: jax.Array,
  aux: dict[str, jax.Array],
  head: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``loss`` (the main objective's, routing losses included) plus the weighted MTP losses, and ``aux`` with
  ``cross_entropy`` (kept where given), ``mtp_loss_<k>`` and the new ``loss``.

  Args:
    model: the decoder (its ``mtp`` params, embedding and head).
    hidden: the main model's final hidden states (``decoder.forward``'s, in its order).
    rest: ``forward``'s per-token arrays, ``shifted``'s among them, in the same order.
    loss, aux: the main loss and its aux (``aux["loss"]`` is the main cross-entropy where ``cross_entropy`` is
      not there yet).
    head: the output head as the main loss used it (gathered once for both); None: ``model.head_weight()``.
  """
  c = model.config
  block = functools.partial(blocks.layer, c, kind(c))
  if c.remat != "none":
    block = jax.checkpoint(block, policy=model._remat_policy())
  stack = getattr(model, NAME)
  head = model.head_weight() if head is None else head
  positions, segment_ids = rest["positions"], rest.get("segment_ids")
  figures, routing = {}, {"balance": [], "z": []}
  with fp8.active("current" if c.fp8 == "delayed" else c.fp8, c.fp8_min_dim):  # no amax histories here
    for k in range(1, c.mtp_depth + 1):
      layer = {name: v[...][k - 1] for name, v in stack.items()}
      embedded = model.embed_tokens(rest[f"mtp_tokens_{k}"])
      hidden, layer_aux = _module(c, block, layer, hidden, embedded, positions, segment_ids)
      total, count = chunked_cross_entropy(
        norm(c, hidden, layer["head_norm"]),
        head,
        rest[f"mtp_targets_{k}"],
        rest[f"mtp_weights_{k}"],
        c.loss_chunk_size,
        c.loss_remat,
        softcap=c.final_logit_softcap,
      )
      figures[f"mtp_loss_{k}"] = total / jnp.maximum(count, 1.0)
      for name in routing if layer_aux else ():
        routing[name].append(jnp.mean(layer_aux[name]))
  mean = lambda values: sum(values) / len(values)
  total = loss + c.mtp_loss_weight * mean(list(figures.values()))
  if routing["balance"]:
    total = total + c.aux_loss_weight * mean(routing["balance"]) + c.z_loss_weight * mean(routing["z"])
  return total, {**aux, "cross_entropy": aux.get("cross_entropy", aux["loss"]), **figures, "loss": total}


def extra_flops_per_token(config, seq_len: int) -> int:
  """The training FLOPs per token the MTP modules add beyond their params' 6·N (which ``num_params`` counts):
  the shared head's matmul again at each depth, and each block's attention over ``seq_len`` (its window where
  shorter)."""
  window = min(seq_len, config.sliding_window) if kind(config).sliding else seq_len
  per_depth = config.d_model * config.vocab_size + config.num_heads * (config.qk_dim + config.v_dim) * window
  return 6 * config.mtp_depth * per_depth


def checkpoint_depth(hf: dict, directory: str, layers: int) -> int:
  """``config.json``'s ``num_nextn_predict_layers`` (``hf``) where ``directory``'s safetensors (their index, or
  their headers) hold those layers after the last ``layers``; else 0 (many conversions leave them out)."""
  depth, names = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0), set()
  index = os.path.join(directory, "model.safetensors.index.json")
  try:
    if depth and os.path.exists(index):
      with open(index, encoding="utf-8") as f:
        names = set(json.load(f).get("weight_map", {}))
    for name in [n for n in os.listdir(directory) if n.endswith(".safetensors")] if depth and not names else []:
      with open(os.path.join(directory, name), "rb") as f:
        names.update(json.loads(f.read(int.from_bytes(f.read(8), "little"))))
  except (OSError, ValueError, AttributeError):  # the weights' reader names a damaged file
    pass
  return depth if all(f"model.layers.{layers + k}.eh_proj.weight" in names for k in range(depth)) else 0
