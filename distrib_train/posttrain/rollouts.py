"""``train.objective: grpo``'s batches: the policy's own completions, sampled on the training mesh and scored.

``RolloutSource`` is the training loop's batch source (``loop.py``): given the state at step ``s`` it returns
the batch step ``s + 1`` trains on. Every ``grpo.num_iterations`` steps it makes a new one:

1. **Prompts.** ``data.global_batch_size / grpo.num_generations`` records of the prompt corpus (``data.paths``
   in any corpus format, or ``data.source: arithmetic``), each ``{"prompt": text | messages, …}``, in an order
   that comes from the step alone (a permutation per epoch, ``data.seed``); messages are rendered through the
   chat template with the generation prompt; the last ``max_prompt_length`` tokens kept.
2. **Completions.** ``num_generations`` per prompt from the sampler (``generation/engine.Generator``) over the
   policy's params where they are laid out (no gather, no host copy), its programs kept across steps; the
   sampling key comes from the step, so a resumed run samples what an unstopped one did.
3. **Rewards** (``rewards.py``): each process scores its share of the groups; every process gets all of them.
   A function that fails stops the run with one line naming it and the prompt.
4. **Advantages**, the rows (prompt + completion, the completion's targets weighed), the sampler's
   log-probabilities and, with ``num_iterations`` > 1, the policy's at generation time (kept in
   ``<workdir>/rollouts_batch/`` for a resume mid-way: ``rollout_records.py``), placed on the step's input
   shardings.
5. **Records**: ``rollouts.jsonl`` (one line per completion), and ``rollout/`` figures in ``metrics.jsonl``
   (``rollout_records.py``).

After a rollback by the non-finite guard the batches are sampled anew (another key), not the one that failed.

The time is the ``generate`` phase, the goodput category ``generation``.

Not for: the loss (``objectives/grpo.py``), the reward functions (``rewards.py``), the sampler (``generation/``).
"""

from __future__ import annotations

import functools
import json
import os
import time
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from distrib_train.posttrain import rewards as rewards_lib
from distrib_train.data.batch_source import RunContext
from distrib_train.posttrain import records as records

POSITION_VERSION = 1
NO_EVAL = "train.objective=grpo trains on its own completions, with no held-out loss (train.eval_tasks scores tasks)."


def prompt_records(config: Any) -> Any:
  """The prompt corpus (``data/sources.Documents``: records as JSON text), the first record checked."""
  from distrib_train.data.sources import Documents

  documents = Documents(config.data_config())
  first = _record(documents, 0)
  if first is None:
    raise ValueError("data: the prompt corpus's first record is unreadable.")
  return documents


def _record(documents: Any, index: int) -> dict[str, Any] | None:
  text = documents[index]
  if text is None:
    return None
  record = json.loads(text) if isinstance(text, str) else None
  prompt = record.get("prompt") if isinstance(record, dict) else None
  if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
    raise ValueError(
      f"data: prompt record {index} needs 'prompt' (text, or a list of {{role, content}}"
      f" messages); it has {sorted(record)[:8] if isinstance(record, dict) else type(record).__name__}."
    )
  return record


def check(config: Any) -> list[rewards_lib.RewardFunc]:
  """The checks of a ``grpo`` run before anything is written: the batch splits into groups, a completion fits a
  row, no held-out evaluation, the reward functions load.

  Raises:
    ValueError: one line naming the key.
  """
  g, data = config.grpo, config.data
  if data.global_batch_size % g.num_generations:
    raise ValueError(
      f"data.global_batch_size={data.global_batch_size} is not a multiple of grpo.num_generations="
      f"{g.num_generations}: a step's batch holds whole groups of completions."
    )
  if data.seq_len < g.max_completion_length + 1:
    raise ValueError(
      f"data.seq_len={data.seq_len} holds no prompt before grpo.max_completion_length="
      f"{g.max_completion_length} new tokens; raise data.seq_len."
    )
  if config.data.source not in ("text", "arithmetic"):
    raise ValueError(
      f'data.source={config.data.source}: train.objective=grpo reads prompt records, {{"prompt":'
      " …}: data.source text with data.paths (JSONL, Parquet, a datasets folder), or arithmetic."
    )
  if getattr(config.model_recipe().config, "lora_dropout", 0.0):
    raise ValueError(
      "model.lora.dropout: train.objective=grpo compares the policy with its sampler and its"
      " reference, which drop nothing; set model.lora.dropout=0."
    )
  if config.train.eval_every:
    raise ValueError(
      "train.eval_every: train.objective=grpo trains on its own completions and has no held-out"
      " loss; score tasks with train.eval_tasks instead."
    )
  if not g.reward_funcs:
    raise ValueError("grpo.reward_funcs is empty: name at least one (accuracy, format, overlong, or module:function).")
  return rewards_lib.resolve(
    list(g.reward_funcs),
    format_pattern=g.format_pattern,
    where="grpo.reward_funcs",
    overlong_buffer=g.overlong_buffer or max(1, g.max_completion_length // 4),
    max_completion_length=g.max_completion_length,
  )


def prompt_order(count: int, per_step: int, seed: int, batch: int) -> list[int]:
  """The corpus indices (of ``count`` records) of batch ``batch``'s ``per_step`` prompts: the records in a
  permutation per epoch (from ``seed`` and the epoch), one batch after another."""
  out = []
  for i in range(batch * per_step, (batch + 1) * per_step):
    epoch, at = divmod(i, count)
    out.append(int(_permutation(count, seed, epoch)[at]))
  return out


@functools.lru_cache(maxsize=4)
def _permutation(count: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(count)


class RolloutSource:
  """The batches of a ``grpo`` run (module docstring): a ``BatchSource``. ``run`` is what it asks of the run
  (``RunContext``: the workdir, the log, the phase clock, the steps the checkpoint tiers hold)."""

  def __init__(self, config: Any, plan: Any, rules: Any, run: RunContext):
    from distrib_train.inference import text as generate_text

    self.config, self.settings, self.plan, self.rules, self.run = config, config.grpo, plan, rules, run
    self.funcs = check(config)
    self.documents = prompt_records(config)
    init = config.train.init_from
    loaded = types.SimpleNamespace(
      config=config, hf_dir=os.path.expanduser(init[3:]) if init.startswith("hf:") else None
    )
    self.codec = generate_text.codec_for(loaded)
    self.end_ids = generate_text.end_ids(loaded, self.codec, "union")  # TRL's: the tokenizer's end token too
    self.prompts_per_step = config.data.global_batch_size // self.settings.num_generations
    self.max_prompt = config.data.seq_len - self.settings.max_completion_length
    if self.settings.max_prompt_length:
      self.max_prompt = min(self.max_prompt, self.settings.max_prompt_length)
    self._generator = self._logps_fn = self._chat = None
    self._kept: tuple[int, dict[str, jax.Array]] | None = None
    self._figures: dict[str, float] = {}
    self._furthest: int | None = None
    self._replays = 0
    self.skipped_documents = 0

  # --- the loop's source ---------------------------------------------------------------------------------

  def next_batch(self, state: Any) -> dict[str, jax.Array]:
    """The batch step ``state.step + 1`` trains on: the kept one within ``num_iterations``, else new rollouts."""
    step = int(state.step)
    if self._furthest is None:  # a resumed run trains the steps after it again: their lines go
      if jax.process_index() == 0:
        records.trim(self.run.workdir, step)
    elif step < self._furthest:  # a rollback (the non-finite guard): sample anew, not the batch that failed
      self._replays += 1
      self._kept = None
      self.run.log(f"Rollouts from step {step} are sampled anew after the rollback (replay {self._replays}).")
    self._furthest = max(step, self._furthest or 0)
    first = step - step % self.settings.num_iterations
    if self._kept is None or self._kept[0] != first:
      if first != step:  # resumed mid-way: the batch made at ``first``, as it was
        host = records.read(self.run.workdir, first, self.settings.num_iterations)
      else:
        jax.block_until_ready(state.params)  # the step before, dispatched: its time is not the sampler's
        with self.run.phase("generate"):
          host = self._roll_out(state, step)
      self._kept = (first, self._place(host))
    return self._kept[1]

  def counts(self) -> dict[str, int]:
    """``data/skipped_documents``: malformed prompt records skipped (``BatchSource``)."""
    return {"skipped_documents": self.skipped_documents}

  def take_figures(self) -> dict[str, float]:
    """The figures of the rollouts made since the last call (``rollout/…``), once; the loop's window logs them."""
    figures, self._figures = self._figures, {}
    return figures

  def data_position(self) -> dict[str, Any]:
    """Where the prompts stand: a function of the step alone, so the layout is all a checkpoint keeps."""
    return {"version": POSITION_VERSION, **self._layout()}

  def set_data_position(self, position: Mapping[str, Any]) -> None:
    changed = [f"{k}: {position.get(k)!r} → {v!r}" for k, v in self._layout().items() if position.get(k) != v]
    if position.get("version") != POSITION_VERSION or changed:
      raise ValueError(
        "The saved rollout position was written for another prompt layout ("
        + "; ".join(changed or [f"version {position.get('version')}"])
        + "); resume with the"
        " checkpoint's config, or train in a new workdir."
      )

  def _layout(self) -> dict[str, Any]:
    return {
      "kind": "rollouts",
      "prompts": len(self.documents),
      "prompts_per_step": self.prompts_per_step,
      "seed": self.config.data.seed,
      "num_iterations": self.settings.num_iterations,
    }

  def close(self) -> None:
    pass

  # --- one batch ---------------------------------------------------------------------------------------

  def prompt_indices(self, step: int) -> list[int]:
    """The corpus indices of the prompts generated for at ``step`` (a multiple of ``num_iterations``)."""
    return prompt_order(
      len(self.documents), self.prompts_per_step, self.config.data.seed, step // self.settings.num_iterations
    )

  def _records(self, indices: list[int]) -> tuple[list[int], list[dict[str, Any]]]:
    """The records at ``indices``; a malformed one (``data.bad_records: skip``) is counted and the next one in
    the corpus taken instead."""
    out_indices, records = [], []
    for index in indices:
      record, tried = _record(self.documents, index), 1
      while record is None:
        if tried == len(self.documents):
          raise ValueError("data: every prompt record is malformed (data.bad_records: skip skipped them all).")
        self.skipped_documents += 1
        index, tried = (index + 1) % len(self.documents), tried + 1
        record = _record(self.documents, index)
      out_indices.append(index)
      records.append(record)
    return out_indices, records

  def _prompt(self, record: dict[str, Any], index: int) -> tuple[list[int], str]:
    """A record's prompt ids (the last ``max_prompt`` kept) and its rendered text."""
    prompt = record["prompt"]
    if isinstance(prompt, str):
      text, ids = prompt, self.codec.encode(prompt, True)
      ids = ([self.codec.bos] if self.codec.bos is not None else []) + ids
    else:
      from distrib_train.data.chat import ChatEncoder, ChatTemplate

      if not self.codec.path:
        raise ValueError(
          f"prompt record {index}: messages need a chat template, and the tokenizer"
          f" {self.codec.spec} has none; give 'prompt' text, or the model's tokenizer."
        )
      if self._chat is None:  # the model's template, read once
        self._chat = ChatEncoder(ChatTemplate.load(self.codec.path, self.config.data.chat_template), None)
      text = self._chat.render(prompt, add_generation_prompt=True, where=f"prompt record {index}")
      ids = self.codec.encode(text, False)
    return ids[-self.max_prompt :], text

  def _roll_out(self, state: Any, step: int) -> dict[str, np.ndarray]:
    from distrib_train.generation.sampling import Sampling

    started = time.perf_counter()
    g = self.settings
    indices, records = self._records(self.prompt_indices(step))
    prompts, rendered = zip(*[self._prompt(r, i) for r, i in zip(records, indices)])
    generator = self._sampler(state)
    sampled = time.perf_counter()
    sampling = Sampling(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, min_p=g.min_p, scaled_logprobs=True)
    seed = (self.config.train.seed * 1_000_003 + step + 7_919 * self._replays) % (1 << 32)
    completions = generator.generate(
      prompts,
      max_new_tokens=g.max_completion_length,
      sampling=sampling,
      n=g.num_generations,
      seed=seed,
      eos_ids=self.end_ids,
      batch_size=self.config.data.global_batch_size,
    )
    generated = time.perf_counter() - sampled
    rows = [
      (p, c) for p in range(len(prompts)) for c in completions[p * g.num_generations : (p + 1) * g.num_generations]
    ]
    texts = [self.codec.decode([t for t in c.ids if t not in self.end_ids]) for _, c in rows]
    values = self._rewards(records, indices, rows, texts)
    reward = rewards_lib.combine(values, list(g.reward_weights) or None)
    advantages, zero_std = rewards_lib.advantages(reward, g.num_generations, g.scale_rewards)
    host = self._rows(prompts, rows, advantages)
    if g.num_iterations > 1:
      host["old_logps"] = self._old_logps(state, host)
      self._keep(step, host)
    self._record(
      step,
      indices,
      rendered,
      rows,
      texts,
      values,
      reward,
      advantages,
      zero_std,
      generated,
      time.perf_counter() - started,
    )
    return host

  def _sampler(self, state: Any) -> Any:
    from flax import nnx

    from distrib_train.generation.engine import Generator
    from distrib_train.objectives.dpo import policy_of

    model = policy_of(state.model)
    if self._generator is None:
      self._generator = Generator(model, mesh=self.plan.mesh, rules=self.rules, log=self.run.log)
    else:  # the same layout: the compiled programs stay
      self._generator.state = nnx.split(model)[1]
    return self._generator

  def _rewards(self, records, indices, rows, texts) -> np.ndarray:
    """[completions, functions]: each process scores the groups ``g`` with ``g % processes`` its index; all are
    gathered (a failure anywhere stops every process with its line)."""
    n, funcs = len(rows), self.funcs
    me, count = jax.process_index(), jax.process_count()
    mine = [i for i, (p, _) in enumerate(rows) if p % count == me]
    values = np.full((n, len(funcs)), np.nan)
    error = ""
    if mine:
      chat = [not isinstance(records[rows[i][0]]["prompt"], str) for i in mine]
      columns = {k: [records[rows[i][0]].get(k) for i in mine] for k in records[0] if k != "prompt"}
      try:
        values[mine] = rewards_lib.score(
          funcs,
          [records[rows[i][0]]["prompt"] for i in mine],
          [[{"role": "assistant", "content": texts[i]}] if c else texts[i] for i, c in zip(mine, chat)],
          [rows[i][1].ids for i in mine],
          columns,
          [indices[rows[i][0]] for i in mine],
        )
      except rewards_lib.RewardError as e:
        error = str(e)
      except Exception as e:  # noqa: BLE001 - every process must reach the gather below, then stop with the line
        error = f"reward functions: {type(e).__name__}: {e}".splitlines()[0]
    if count == 1:
      if error:
        raise rewards_lib.RewardError(error)
      return values
    from jax.experimental import multihost_utils

    message = np.zeros((1024,), np.uint8)
    raw = error.encode("utf-8")[:1024]
    message[: len(raw)] = np.frombuffer(raw, np.uint8)
    owned = np.asarray([p % count == me for p, _ in rows])
    exact = np.ascontiguousarray(np.where(owned[:, None], values, 0.0), np.float64).view(np.uint32)  # no float32
    gathered = multihost_utils.process_allgather({"values": exact, "message": message})
    messages = [bytes(m).rstrip(b"\0").decode("utf-8", "replace") for m in np.asarray(gathered["message"])]
    if any(messages):
      raise rewards_lib.RewardError(next(m for m in messages if m))
    owner = np.asarray([p % count for p, _ in rows])
    every = np.ascontiguousarray(np.asarray(gathered["values"], np.uint32)).view(np.float64)
    return every.reshape(count, n, len(funcs))[owner, np.arange(n)]

  def _rows(self, prompts, rows, advantages) -> dict[str, np.ndarray]:
    """The batch's rows: prompt then completion, its targets weighed (module docstring of objectives/grpo.py)."""
    shape = (self.config.data.global_batch_size, self.config.data.seq_len)
    out = {name: np.zeros(shape, np.int32) for name in ("tokens", "targets")}
    out.update({name: np.zeros(shape, np.float32) for name in ("weights", "advantages", "sampler_logps")})
    masked = self.settings.mask_truncated_completions
    for r, (p, completion) in enumerate(rows):
      prompt, ids = prompts[p], completion.ids
      sequence = np.asarray(list(prompt) + ids, np.int32)
      first, end = len(prompt) - 1, len(sequence) - 1  # the targets that are completion tokens: [first, end)
      out["tokens"][r, : len(sequence)] = sequence
      out["targets"][r, :end] = sequence[1:]
      if not (masked and completion.finish_reason == "length"):
        out["weights"][r, first:end] = 1.0
      out["advantages"][r] = advantages[r]
      out["sampler_logps"][r, first:end] = completion.logprobs
    return out

  def _old_logps(self, state: Any, host: Mapping[str, np.ndarray]) -> np.ndarray:
    """The policy's log-probabilities of the targets now, before any step on this batch (``num_iterations`` > 1)."""
    from distrib_train.objectives import grpo
    from distrib_train.sharding.axis_rules import activation_sharding

    if self._logps_fn is None:
      temperature = self.settings.temperature

      def logps(model, tokens, targets):
        from distrib_train.objectives.dpo import policy_of

        policy = policy_of(model)
        positions = jax.numpy.broadcast_to(jax.numpy.arange(tokens.shape[1]), tokens.shape)
        hidden, _ = policy.hidden_and_aux(tokens, positions=positions)
        return grpo.logprobs(policy, hidden, targets, temperature)[0]

      self._logps_fn = jax.jit(logps)
    batch = self._place({k: host[k] for k in ("tokens", "targets")})
    with activation_sharding(self.plan.mesh, self.rules):
      out = self._logps_fn(state.model, batch["tokens"], batch["targets"])
    return np.asarray(jax.device_get(_replicated(out, self.plan.mesh)), np.float32)

  def _place(self, host: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    shardings = self.plan.input_kwarg_shardings
    return {
      name: jax.make_array_from_callback(value.shape, shardings[name], lambda index, v=value: v[index])
      for name, value in host.items()
    }

  # --- a batch kept for num_iterations > 1, and the records (rollout_records.py) ------------------------------

  def _keep(self, step: int, host: Mapping[str, np.ndarray]) -> None:
    if jax.process_index() == 0:
      oldest = self._oldest_checkpoint()
      records.keep(self.run.workdir, step, host, oldest - oldest % self.settings.num_iterations)

  def _oldest_checkpoint(self) -> int:
    """The oldest step either checkpoint tier may restore (0 where none is saved yet): its batch stays."""
    steps = self.run.checkpoint_steps()
    return min(steps) if steps else 0

  def _record(
    self, step, indices, rendered, rows, texts, values, reward, advantages, zero_std, generated, seconds
  ) -> None:
    lengths = np.asarray([len(c.ids) for _, c in rows])
    truncated = np.asarray([c.finish_reason == "length" for _, c in rows])
    names = [f.name for f in self.funcs]
    self._figures = records.figures(names, values, reward, zero_std, lengths, truncated, generated, seconds)
    if jax.process_index() != 0:
      return
    records.write_lines(
      self.run.workdir,
      [
        {
          "step": step + 1,
          "prompt_index": indices[p],
          "prompt": rendered[p],
          "completion": texts[r],
          "completion_ids": completion.ids,
          "rewards": {name: (None if np.isnan(values[r, j]) else float(values[r, j])) for j, name in enumerate(names)},
          "reward": float(reward[r]),
          "advantage": float(advantages[r]),
          "length": len(completion.ids),
          "truncated": bool(truncated[r]),
        }
        for r, (p, completion) in enumerate(rows)
      ],
    )


def _replicated(x: jax.Array, mesh: Any) -> jax.Array:
  from jax.sharding import NamedSharding, PartitionSpec

  return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
