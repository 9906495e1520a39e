"""Generation from token ids: batches of prompts through one prefill and a donated ``while_loop`` of decode steps.

``Generator(model, mesh=…, rules=…).generate(prompts, max_new_tokens=…,
sampling=…, n=…, seed=…, eos_ids=…)`` gives one ``Completion`` per prompt
and sample. Each batch:

1. **Rows.** Every prompt is repeated ``n`` times; rows are sorted by
   length and cut into batches of ``batch_size``. A batch's rows are padded
   to a power of two and to a multiple of the devices its ``batch`` axis
   splits over (a mixture's expert axis too: the experts' all-to-all needs
   every device to hold rows); the padding rows are finished from the start.
2. **Buckets.** The prompts are left-padded to the next power of two (16 at
   least): one compile serves every prompt length up to it. The cache
   holds that bucket plus ``max_new_tokens``.
3. **Prefill** (one jitted call): the cache made and written, the first new
   token chosen.
4. **Decode** (one compiled call): a ``while_loop`` of cached steps, the
   cache donated, in the layout the compiler chose for the loop (the
   prefill writes it so); each finished row (an end id) is kept finished,
   and it ends when every row has, or at ``max_new_tokens``. With
   ``on_token`` (a terminal's streamed answer) the same program runs one
   step a call, each step's tokens read on the host.

Each program is compiled once per (rows, bucket, cache length, sampling)
and kept; ``compiles`` counts them, and each new one is logged.

Not for: text, prompts from files or the command line (``inference/generate.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from distrib_train.generation import cache as cache_lib
from distrib_train.generation.sampling import Sampling, choose, row_keys
from distrib_train.sharding.axis_rules import activation_sharding

MIN_BUCKET = 16


@dataclasses.dataclass
class Completion:
  """One sample's new tokens: ``index`` (its prompt's), ``sample`` (0 … n − 1), ``ids`` (an end id included,
  where one stopped it), ``logprobs`` (the model's, one per id) and ``finish_reason`` (``stop``: an end id, or
  a stop string in ``inference/generate.py``; ``length``: ``max_new_tokens``)."""

  index: int
  sample: int
  ids: list[int]
  logprobs: list[float]
  finish_reason: str


def bucket(length: int) -> int:
  """The padded prompt length a prompt of ``length`` tokens compiles for."""
  return max(MIN_BUCKET, 1 << max(0, length - 1).bit_length())


def batch_multiple(mesh, rules) -> int:
  """How many devices the rules split the ``batch`` axis over on ``mesh`` (1 without a mesh)."""
  if mesh is None:
    return 1
  entry = rules.spec(("batch",), mesh=mesh)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(dict(mesh.shape)[a] for a in axes)


class Generator:
  """Samples from ``model`` (a reference decoder, ``recipes/decoder.Decoder``), its params as they are laid out
  (``mesh`` and ``rules``: the activations' and the cache's layout, as in training)."""

  def __init__(self, model: Any, *, mesh: Any = None, rules: Any = None, log: Callable[[str], None] | None = None):
    if mesh is not None and rules is None:
      raise ValueError("Generator: a mesh needs its axis rules (rules=).")
    self.config = model.config
    self.graphdef, self.state = nnx.split(model)
    self.mesh, self.rules = mesh, rules
    self.log = log or (lambda line: None)
    self._programs: dict[tuple, Any] = {}

  @property
  def compiles(self) -> int:
    """The programs compiled so far (prefill and decode, per rows, bucket and cache length)."""
    return len(self._programs)

  def _sharding(self):
    return activation_sharding(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

  def _program(self, kind: str, rows: int, prompt: int, max_len: int, sampling: Sampling, ends: int):
    key = (kind, rows, prompt, max_len, sampling, ends)
    if key not in self._programs:
      if kind == "decode":
        self._programs[key] = self._decode_program(rows, prompt, max_len, sampling, ends)
      else:
        decode = self._program("decode", rows, prompt, max_len, sampling, ends)
        formats = None if self.mesh is None else decode.input_formats[0][1]  # the cache's, as the decode takes it
        self._programs[key] = self._prefill_program(rows, prompt, max_len, sampling, formats)
      self.log(
        f"Generation: {kind} for {rows} rows × {prompt} prompt tokens (cache {max_len}) is new"
        f" ({self.compiles} programs so far)."
      )
    return self._programs[key]

  def _cache_shardings(self, rows: int, max_len: int):
    if self.mesh is None:
      return None
    return cache_lib.cache_shardings(self.config, rows, max_len, self.mesh, self.rules)

  def _replicated(self):
    return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

  def _prefill_program(self, rows: int, prompt: int, max_len: int, sampling: Sampling, cache_formats):
    """The prefill, its cache written in ``cache_formats``: the decode program's (``_decode_program``)."""
    graphdef, config, new = self.graphdef, self.config, max_len - prompt

    def run(state, tokens, pads, index, sample, seed, eos, live):
      model = nnx.merge(graphdef, state)
      cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_lib.cache_spec(config, rows, max_len))
      logits, cache = cache_lib.prefill(model, cache, tokens, pads, max_len=max_len)
      token, logprob = choose(logits, row_keys(seed, index, sample), jnp.int32(0), sampling)
      out = jnp.zeros((rows, new), jnp.int32).at[:, 0].set(token)
      logprobs = jnp.zeros((rows, new), jnp.float32).at[:, 0].set(logprob)
      done = jnp.any(token[:, None] == eos[None, :], axis=-1) | (jnp.arange(rows) >= live)
      return cache, out, logprobs, done

    replicated = self._replicated()
    return jax.jit(
      run, out_shardings=None if cache_formats is None else (cache_formats, replicated, replicated, replicated)
    )

  def _decode_program(self, rows: int, prompt: int, max_len: int, sampling: Sampling, ends: int):
    """The decode loop from new token ``start`` up to (not including) ``until``, or until every row is done.

    On a mesh it is compiled ahead of the call, the cache's layout left to the compiler (``Layout.AUTO``): libtpu
    lays a loop's carried cache out otherwise than a program's argument, and with the argument's layout fixed it
    copied the whole cache into and out of the loop at every call (``bench/generation.py tpu``). The prefill
    then writes the cache in the layout this program takes."""
    graphdef = self.graphdef
    new = max_len - prompt

    def run(state, cache, out, logprobs, done, pads, index, sample, seed, eos, start, until):
      model = nnx.merge(graphdef, state)
      keys = row_keys(seed, index, sample)

      def proceed(carry):
        i, _, _, _, done, _ = carry
        return (i < jnp.minimum(until, new)) & ~jnp.all(done)

      def step(carry):
        i, cache, out, logprobs, done, last = carry
        logits, cache = cache_lib.decode(model, cache, last, prompt + i - 1, pads, max_len=max_len)
        token, logprob = choose(logits, keys, i, sampling)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(done, 0, token)[:, None], i, axis=1)
        logprobs = jax.lax.dynamic_update_slice_in_dim(logprobs, jnp.where(done, 0.0, logprob)[:, None], i, axis=1)
        done = done | jnp.any(token[:, None] == eos[None, :], axis=-1)
        return i + 1, cache, out, logprobs, done, token

      last = jax.lax.dynamic_index_in_dim(out, start - 1, axis=1, keepdims=False)
      i, cache, out, logprobs, done, _ = jax.lax.while_loop(proceed, step, (start, cache, out, logprobs, done, last))
      return out, logprobs, done, i, cache  # the cache returned: its donated buffers are the loop's

    shardings, replicated = self._cache_shardings(rows, max_len), self._replicated()
    if shardings is None:
      return jax.jit(run, donate_argnums=(1, 2, 3))
    from jax.experimental.layout import Format, Layout

    auto = jax.tree.map(lambda sh: Format(Layout.AUTO, sh), shardings)
    spec = cache_lib.cache_spec(self.config, rows, max_len)
    at = lambda shape, dtype, sharding=replicated: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    state = jax.tree.map(lambda x: at(x.shape, x.dtype, x.sharding), self.state)
    cache = jax.tree.map(lambda s, sh: at(s.shape, s.dtype, sh), spec, shardings)
    new, vector, scalar = max_len - prompt, (rows,), ()
    args = (
      state,
      cache,
      at((rows, new), np.int32),
      at((rows, new), np.float32),
      at(vector, np.bool_),
      at(vector, np.int32),
      at(vector, np.int32),
      at(vector, np.int32),
      at(scalar, np.uint32),
      at((ends,), np.int32),
      at(scalar, np.int32),
      at(scalar, np.int32),
    )
    in_shardings = (jax.tree.map(lambda x: x.sharding, state), auto) + (replicated,) * (len(args) - 2)
    with self._sharding():
      # the cache alone donated: libtpu refused to alias the token outputs, which it laid out anew (small: rows × new)
      return (
        jax.jit(
          run,
          donate_argnums=(1,),
          in_shardings=in_shardings,
          out_shardings=(replicated, replicated, replicated, replicated, auto),
        )
        .lower(*args)
        .compile()
      )

  def generate(
    self,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    n: int = 1,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
    batch_size: int = 64,
    on_token: Callable[[np.ndarray, np.ndarray], None] | None = None,
  ) -> list[Completion]:
    """Completions of ``prompts`` (lists of token ids), ``n`` each, ordered by prompt then sample.

    ``on_token(tokens, finished)``, where given, receives each step's new token of every row [rows] and which rows
    had finished before it, as the steps run (for a terminal that prints the answer as it comes): the decode loop
    then returns to the host after every step.

    Raises:
      ValueError: an empty prompt, ``max_new_tokens`` or ``n`` under 1, ids outside the vocabulary (named).
    """
    if max_new_tokens < 1 or n < 1 or batch_size < 1:
      raise ValueError(f"max_new_tokens, n and batch_size must be at least 1, got {max_new_tokens}, {n}, {batch_size}.")
    vocab = self.config.vocab_size
    for i, ids in enumerate(prompts):
      if len(ids) == 0:
        raise ValueError(f"prompt {i} is empty: a prompt needs at least one token.")
      if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(
          f"prompt {i} holds token id {max(ids) if max(ids) >= vocab else min(ids)}, outside the"
          f" model's vocabulary of {vocab}."
        )
    rows = sorted(((len(prompts[p]), p, s) for p in range(len(prompts)) for s in range(n)), reverse=True)
    out: dict[tuple[int, int], Completion] = {}
    for start in range(0, len(rows), batch_size):
      chunk = [(p, s) for _, p, s in rows[start : start + batch_size]]
      for completion in self._batch(prompts, chunk, max_new_tokens, sampling, seed, tuple(eos_ids), on_token):
        out[(completion.index, completion.sample)] = completion
    return [out[(p, s)] for p in range(len(prompts)) for s in range(n)]

  def _batch(self, prompts, chunk, max_new_tokens, sampling, seed, eos_ids, stream) -> list[Completion]:
    multiple = batch_multiple(self.mesh, self.rules)
    rows = max(1 << (len(chunk) - 1).bit_length(), multiple)
    rows = -(-rows // multiple) * multiple
    prompt = bucket(max(len(prompts[p]) for p, _ in chunk))
    max_len = prompt + max_new_tokens
    tokens = np.zeros((rows, prompt), np.int32)
    pads = np.full((rows,), prompt - 1, np.int32)  # a padding row: one token
    index, sample = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
    for r, (p, s) in enumerate(chunk):
      ids = np.asarray(prompts[p], np.int32)
      tokens[r, prompt - len(ids) :], pads[r], index[r], sample[r] = ids, prompt - len(ids), p, s
    eos = np.asarray(eos_ids, np.int32).reshape(-1)
    seed = np.uint32(seed)
    with self._sharding():
      prefill = self._program("prefill", rows, prompt, max_len, sampling, len(eos))
      decode = self._program("decode", rows, prompt, max_len, sampling, len(eos))
      cache, out, logprobs, done = prefill(self.state, tokens, pads, index, sample, seed, eos, np.int32(len(chunk)))
      inputs = (pads, index, sample, seed, eos)
      if stream is None:  # one call: the whole loop on the device
        out, logprobs, done, steps, _ = decode(
          self.state, cache, out, logprobs, done, *inputs, np.int32(1), np.int32(max_new_tokens)
        )
      else:  # one call a step, each step's tokens to the host as they come (a terminal's answer)
        stream(np.asarray(out[:, 0]), np.zeros((rows,), bool))
        steps = 1
        while steps < max_new_tokens and not bool(np.all(np.asarray(done))):
          before = np.asarray(done)
          out, logprobs, done, _, cache = decode(
            self.state, cache, out, logprobs, done, *inputs, np.int32(steps), np.int32(steps + 1)
          )
          stream(np.asarray(out[:, steps]), before)
          steps += 1
    out, logprobs, steps = np.asarray(out), np.asarray(logprobs), int(steps)
    completions = []
    for r, (p, s) in enumerate(chunk):
      ids = out[r, :steps].tolist()
      stop = next((i for i, t in enumerate(ids) if t in set(eos_ids)), None)
      length = len(ids) if stop is None else stop + 1
      completions.append(
        Completion(p, s, ids[:length], logprobs[r, :length].tolist(), "length" if stop is None else "stop")
      )
    return completions
