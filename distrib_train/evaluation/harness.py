"""lm-evaluation-harness's ``LM`` backed by a sharded model: ``HarnessLM``.

``HarnessLM.load("ckpt:runs/sft", mesh_config="cpu-8")`` (or ``HarnessLM(
run_model)`` for a model loaded by ``run_model.load``, or ``HarnessLM.live(…)``
for a training run's state) answers lm-eval's three requests as its ``hf``
model does, on the same token ids:

- ``loglikelihood((context, continuation))``: the pair encoded as lm-eval
  encodes it (the whole text, then the context; trailing spaces of the
  context moved to the continuation; an empty context becomes the prefix
  token), cut to the last ``max_length + 1`` tokens; every request of a call
  packed into rows with segment ids (``generation/scoring.py``), so little
  padding is computed, and a context computed once for the continuations
  that share it (``share_contexts``: a question's answer letters or
  choices, a few-shot prompt's questions; up to 1,024 tokens a tree,
  ``scoring.py``); ``is_greedy`` from the argmax at each continuation token.
- ``loglikelihood_rolling((text,))``: the text in windows of ``max_length``
  tokens, as ``lm_eval.utils.get_rolling_token_windows`` cuts them (the
  prefix token first), each token scored once; the windows of all requests
  packed together.
- ``generate_until((context, gen_kwargs))``: the sampler
  (``generation/engine.py``) with ``until``, ``max_gen_toks``, ``do_sample``
  and ``temperature`` (also ``top_k``, ``top_p``, ``min_p``) as lm-eval
  normalizes them, the end token's text a stop string too; the text cut at
  the first stop string.

``max_length``: ``config.json``'s ``max_position_embeddings`` for ``hf:``
(as the ``hf`` model reads it), the run's ``data.seq_len`` for ``ckpt:``.
Special tokens: a run's ``data.bos_token`` / ``data.eos_token``, else the
tokenizer's (``tokenizer_config.json``); the prefix token is the BOS, else
the end token, else a newline (a byte-level run's). Chat templates
(``--apply_chat_template``) render through ``data/chat.py``, as transformers'
``apply_chat_template``.

Every process of a job answers every request with the same calls (each
device computes its rows) and holds all answers; lm-eval sees one process.

Not for: tasks and the command line (``eval_tasks.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from distrib_train.common import extras

lm_eval = extras.require("lm_eval", "distrib-train eval")
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

SAMPLING_SEED = 1234  # do_sample's seed: lm-eval passes none
_SHORTEST_ROW = 64  # the shortest packed row (shorter sequences share it)


class HarnessLM(TemplateLM):
  """lm-eval's ``LM`` (module docstring). ``batch_size``: packed rows per forward call (and 8 × as many
  prompts decoded together). ``share_contexts``: a context's continuations side by side in a row, the context
  once (``scoring.Scorer.score``'s ``share``; such rows run XLA's attention, whatever ``model.attention`` asks)."""

  def __init__(
    self,
    loaded: Any = None,
    *,
    model: Any = None,
    mesh: Any = None,
    rules: Any = None,
    codec: Any = None,
    end_ids: Sequence[int] = (),
    max_length: int | None = None,
    batch_size: int = 8,
    specials: dict[str, str] | None = None,
    log: Any = None,
    share_contexts: bool = True,
  ):
    super().__init__()
    from distrib_train.generation.engine import Generator
    from distrib_train.generation.scoring import Scorer
    from distrib_train.inference.text import codec_for, end_ids as ends_of

    if loaded is not None:
      model, mesh, rules = loaded.model, loaded.mesh, loaded.rules
      codec = codec if codec is not None else codec_for(loaded)
      end_ids = ends_of(loaded, codec)
      max_length = max_length or model_max_length(loaded)
      data = loaded.config.data
      specials = {
        **_special_texts(codec),
        **{k: v for k, v in (("bos_token", data.bos_token), ("eos_token", data.eos_token)) if v},
      }
    if model is None or codec is None or not max_length:
      raise ValueError("HarnessLM: give a loaded model, or model=, codec= and max_length=.")
    self.codec, self.end_ids, self._max_length = codec, list(end_ids), int(max_length)
    self._batch_size = max(int(batch_size), 1)
    self.share_contexts = share_contexts
    self.scorer = Scorer(model, mesh=mesh, rules=rules)
    self.generator = Generator(model, mesh=mesh, rules=rules, log=log)
    specials = _special_texts(codec) if specials is None else specials
    self.bos_text = specials.get("bos_token") or ""
    eos_text = specials.get("eos_token") or ""
    self.eos_text = eos_text if eos_text and codec.token_id(eos_text) is not None else None
    self._eot = codec.token_id(self.eos_text) if self.eos_text else (self.end_ids[0] if self.end_ids else None)
    bos = codec.bos if codec.bos is not None else codec.token_id(self.bos_text) if self.bos_text else None
    self._prefix = bos if bos is not None else self._eot if self._eot is not None else codec.encode("\n", False)[0]

  @classmethod
  def load(
    cls,
    init_from: str,
    *,
    step: int | None = None,
    mesh_config: str | None = None,
    dtype: str | None = None,
    overrides: dict | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    log: Any = None,
  ) -> HarnessLM:
    """The model ``init_from`` names (``hf:<dir>`` or ``ckpt:<run>``), loaded as ``run_model.load`` reads it."""
    from distrib_train.weights import load as run_model

    loaded = run_model.load(init_from, step=step, mesh_config=mesh_config, dtype=dtype, overrides=overrides or {})
    return cls(loaded, batch_size=batch_size, max_length=max_length, log=log)

  def set_state(self, model: Any) -> None:
    """Later weights of the same layout (a training run's live state): the compiled programs stay."""
    from flax import nnx

    state = nnx.split(model)[1]
    self.scorer.state = self.generator.state = state

  # --- what lm-eval reads ---------------------------------------------------------------------------

  @property
  def eot_token_id(self) -> int | None:
    return self._eot

  @property
  def prefix_token_id(self) -> int:
    return self._prefix

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return 256

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @property
  def tokenizer_name(self) -> str:
    return self.codec.spec.replace("/", "__")

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    if not chat_template:
      return None
    return self._template().text

  def tok_encode(
    self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
  ) -> list[int]:
    """The ids of ``string`` as the ``hf`` model's ``tok_encode``: with the tokenizer's special tokens unless
    ``add_special_tokens`` is False, or is None and the text already starts with the BOS."""
    special = (
      add_special_tokens if add_special_tokens is not None else not (self.bos_text and string.startswith(self.bos_text))
    )
    ids = self.codec.encode(string, bool(special))
    if special and self.codec.bos is not None:  # a run's own BOS, put before each document in training
      ids = [self.codec.bos] + ids
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def tok_decode(self, ids: Sequence[int]) -> str:
    return self.codec.decode(list(ids))

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``apply_chat_template(chat_history, tokenize=False, add_generation_prompt=…,
    continue_final_message=not add_generation_prompt)`` as transformers renders it."""
    from distrib_train.data.chat import ChatEncoder

    text = ChatEncoder(self._template(), None).render(
      chat_history, add_generation_prompt=add_generation_prompt, where="a few-shot chat"
    )
    if not add_generation_prompt and chat_history:  # continue the final message: cut after its text
      final = str(chat_history[-1].get("content", "")).strip()
      if final and final in text:
        text = text[: text.rindex(final) + len(final)]
    return text

  def _template(self):
    from distrib_train.data.chat import ChatTemplate

    if not self.codec.path:
      raise ValueError(
        f"--apply_chat_template: the tokenizer {self.codec.spec} has no chat template; give the"
        " model's tokenizer with --set data.tokenizer=hf:<dir>."
      )
    return ChatTemplate.load(self.codec.path)

  # --- the three requests ---------------------------------------------------------------------------

  def _row_len(self, longest: int) -> int:
    """The longest packed row of sequences alone: the longest sequence's power of two (shorter rows, and rows of
    trees: ``scoring.Scorer.score``)."""
    from distrib_train.generation.engine import bucket

    return bucket(longest)

  def _score(self, pairs: Sequence[tuple[list[int], list[int]]]):
    """Scores of ``(context ids, continuation ids)`` pairs, each cut as the ``hf`` model cuts it."""
    sequences, scored = [], []
    for i, (context, continuation) in enumerate(pairs):
      if not continuation or len(continuation) > self._max_length:
        raise ValueError(
          f"request {i}: a continuation of {len(continuation)} tokens; lm-eval scores 1 to"
          f" max_length ({self._max_length})."
        )
      sequences.append((context + continuation)[-(self._max_length + 1) :])
      scored.append(len(continuation))
    if not sequences:
      return []
    row_len = self._row_len(max(len(s) - 1 for s in sequences))
    return self.scorer.score(
      sequences, scored, row_len=row_len, rows=self._batch_size, shortest=_SHORTEST_ROW, share=self.share_contexts
    )

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    scores = self._score([(list(context), list(continuation)) for _, context, continuation in requests])
    out = []
    for (key, _, _), score in zip(requests, scores):
      answer = (score.logprob, score.greedy)
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, answer)
      out.append(answer)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for i, (text,) in enumerate(req.args for req in requests):
      for pair in get_rolling_token_windows(
        token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self._max_length, context_len=1
      ):
        windows.append(make_disjoint_window(pair))
        owner.append(i)
    totals = [0.0] * len(requests)
    for i, score in zip(owner, self._score(windows)):
      totals[i] += score.logprob
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    from distrib_train.generation.sampling import Sampling

    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    out: list[str] = [""] * len(requests)
    for members in groups.values():
      kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
      until = handle_stop_sequences(kwargs.pop("until", None), eos=self.eos_text)
      new = int(kwargs.pop("max_gen_toks"))
      if new >= self._max_length:
        raise ValueError(f"max_gen_toks {new}: must be under the model's max_length ({self._max_length}).")
      sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
      sampling = (
        Sampling(
          temperature=float(kwargs["temperature"]),
          top_k=int(kwargs.get("top_k") or 0),
          top_p=float(kwargs.get("top_p") or 1.0),
          min_p=float(kwargs.get("min_p") or 0.0),
        )
        if sample
        else Sampling()
      )
      prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self._max_length - new) for i in members]
      completions = self.generator.generate(
        prompts,
        max_new_tokens=new,
        sampling=sampling,
        seed=SAMPLING_SEED,
        eos_ids=self.end_ids,
        batch_size=8 * self._batch_size,
      )
      for i, completion in zip(members, completions):
        text = postprocess_generated_text(self.codec.decode(completion.ids), until, None)
        out[i] = text
        self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out


def model_max_length(loaded: Any) -> int:
  """The context ``HarnessLM`` scores in (module docstring)."""
  if loaded.hf_dir and loaded.source.startswith("hf:"):
    with open(os.path.join(loaded.hf_dir, "config.json"), encoding="utf-8") as f:
      config = json.load(f)
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
      if isinstance(config.get(key), int):
        return config[key]
    return 2048
  return int(loaded.config.data.seq_len)


def _special_texts(codec: Any) -> dict[str, str]:
  """The special tokens' texts: the tokenizer's, a run's ``bos`` from its codec."""
  from distrib_train.data.chat import special_tokens

  return special_tokens(codec.path) if codec.path else {}
