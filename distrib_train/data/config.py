"""``DataConfig``: what the input pipeline reads and how it batches it.

Its own module so that the sources (``sources.py``) and the pipeline
(``pipeline.py``) both read it without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

Tokenizer = Callable[[str], Sequence[int]]


# ``DataConfig.reference_logps`` before the precomputation pass names its file (``posttrain/reference_pass.py``).
REFERENCE_PENDING = "<the precomputed reference's file, named by its pass>"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to batch it.

  Attributes:
    source: ``synthetic``, ``pydoc``, ``text`` or ``arithmetic`` (prompt records of sums, for RL's demo).
    paths: files or globs for ``text`` (``.txt``, ``.jsonl``, ``.jsonl.zst``,
      ``.jsonl.gz``, ``.parquet``, ``.array_record``, or folders written by
      ``datasets``' ``save_to_disk``); read lazily, document by document.
    text_field: the JSONL field, or the Parquet / ``datasets`` column, that holds the text.
    block_cache: decoded blocks (Parquet row groups, compressed JSONL's
      ``compressed.BLOCK_BYTES`` blocks) a process's source keeps, an LRU:
      its memory is about this many times the block size
      (``block_order.py``).
    bad_records: what a malformed JSONL line (not UTF-8, not JSON, not an
      object, no string ``text_field``) does when it is read: ``skip`` logs
      it (the first 10 of each file), counts it
      (``data/skipped_documents``) and reads no document from it; ``error``
      stops the run, naming the file and line. The first line of each file
      must parse either way.
    index_cache_dir: where the indexes of data files are kept
      (``index_cache.py``); '' keeps each beside its file where that
      directory is writable, else in ``~/.cache/distrib_train/indexes``.
    seq_len: tokens per sequence (inputs and targets each).
    global_batch_size: sequences per step for the whole job.
    seed: shuffle seed (and the synthetic source's).
    packing: concatenate documents and split at ``seq_len`` (with segment and
      position ids); otherwise each sequence is the start of one document,
      shorter documents are skipped, and a named byte-level or BPE tokenizer
      encodes only a prefix of each long document
      (``tokenizer.Tokenizer.encode_heads``).
    max_documents_per_row: with packing, the documents a row holds at most;
      those past it in a row weigh 0 and attend to each other
      (``sequences.shifted``). 0: any number, or, in the trainer, what the
      model's packed attention takes (the Llama models' ``max_segments`` -
      1).
    eval_fraction: share of the documents held out for evaluation.
    num_workers: worker processes making the training rows ahead
      (``lane_process.py``; 0: in this process), or grain's for a finite pass.
    num_threads: threads reading one batch of documents, per process (the
      lanes tokenize the batch in one call, ``lanes.py``).
    synthetic_documents: documents in the synthetic source.
    tokenizer: a tokenizer spec (``bytes``, ``hf:<tokenizer.json>``,
      ``sentencepiece:<model>``, ``tiktoken:<bpe file>``; ``tokenizer.py``),
      or, from code, any ``str -> list[int]`` function.
    bos_token, eos_token: the text of a special token put before / after
      every document (a spec'd tokenizer only; empty: none).
    allow_replicated_batch: let the trainer run a global batch that the
      mesh's batch axes do not divide, computing the whole batch on every
      device (refused otherwise).
    loss_on: empty (the default): documents of text, every token trained on.
      ``assistant``, ``completion`` or ``all``: conversation records
      (``{"messages": [...]}`` or ``{"prompt", "completion"}``) rendered by
      the chat template, trained on the assistant turns, the completion (a
      record's last assistant turn) or every token (``chat.py``); with
      packing, whole conversations fill a row and the rest is padding.
    chat_template: a ``.jinja`` file to render conversations with instead
      of the tokenizer's own (``chat_template.jinja`` or
      ``tokenizer_config.json``'s beside ``tokenizer.json``); the ``bytes``
      tokenizer has a built-in ChatML template.
    long_conversations: a conversation longer than ``seq_len + 1`` tokens is
      cut there (``truncate``) or left out (``drop``); each is counted
      (``data/long_conversations``).
    pairs: set from ``train.objective: dpo``, not a config key: the records
      are preference pairs (``preference.py``), each two sequences — the
      prompt with the chosen completion, then with the rejected one — packed
      whole into one row as two segments, their completions scored.
    reference_logps: set from ``dpo.precompute_reference``, not a config key:
      the file of the pairs' reference figures (``posttrain/reference_pass.py``),
      put on the batch as ``reference_logps`` (``REFERENCE_PENDING`` until the
      pass has named it: the batch's schema has the field, no loader reads).
    prompts: set from ``train.objective: grpo``, not a config key: the records
      are prompts (``{"prompt": text | messages, …}``) the policy completes
      (``posttrain/rollouts.py``), every column kept for the reward functions.
  """

  source: str = "pydoc"
  paths: tuple[str, ...] = ()
  text_field: str = "text"
  block_cache: int = 16
  bad_records: str = "skip"
  index_cache_dir: str = ""
  seq_len: int = 128
  global_batch_size: int = 32
  seed: int = 0
  packing: bool = True
  max_documents_per_row: int = 0
  eval_fraction: float = 0.05
  num_workers: int = 0
  num_threads: int = 4
  synthetic_documents: int = 4096
  allow_replicated_batch: bool = False
  tokenizer: str = "bytes"  # or, from code, a Tokenizer function
  bos_token: str = ""
  eos_token: str = ""
  loss_on: str = ""
  chat_template: str = ""
  long_conversations: str = "truncate"
  pairs: bool = False
  reference_logps: str = ""
  prompts: bool = False

  @property
  def conversations(self) -> bool:
    """Whether the documents are conversation records (``loss_on`` set)."""
    return bool(self.loss_on)

  @property
  def max_segments_per_row(self) -> int:
    """The segments a row holds at most (0: any number): ``max_documents_per_row``, two for each pair."""
    return self.max_documents_per_row * (2 if self.pairs else 1)

  def __post_init__(self):
    for name in ("seq_len", "global_batch_size", "synthetic_documents", "num_threads", "block_cache"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Data config: {name} must be a positive integer, got {value!r}.")
    for name in ("num_workers", "max_documents_per_row"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Data config: {name} must be 0 or more, got {value!r}.")
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(f"Data config: eval_fraction must be in [0, 1), got {self.eval_fraction!r}.")
    if self.source not in ("synthetic", "pydoc", "text", "arithmetic"):
      raise ValueError(f"Data config: unknown source {self.source!r}; known: synthetic, pydoc, text, arithmetic.")
    if self.bad_records not in ("skip", "error"):
      raise ValueError(f"Data config: unknown bad_records {self.bad_records!r}; known: skip, error.")
    if self.source == "text" and not self.paths:
      raise ValueError("Data config: source 'text' needs paths (files or globs).")
    if self.tokenizer is None:
      object.__setattr__(self, "tokenizer", "bytes")
    if isinstance(self.tokenizer, str):
      from distrib_train.data import tokenizer as tokenizer_lib

      tokenizer_lib.parse(self.tokenizer)  # a known kind and a file that exists, before anything runs
    elif not callable(self.tokenizer):
      raise ValueError(
        f"Data config: tokenizer must be a spec (bytes, hf:<file>, …) or a function, got"
        f" {type(self.tokenizer).__name__}."
      )
    elif self.bos_token or self.eos_token:
      raise ValueError("Data config: bos_token / eos_token need a tokenizer spec (a function adds its own).")
    self._check_conversations()

  def _check_conversations(self) -> None:
    if self.loss_on not in ("", "assistant", "completion", "all"):
      raise ValueError(
        f"Data config: loss_on={self.loss_on!r}; choose assistant, completion or all for"
        " conversation records, or leave it empty for documents of text."
      )
    if self.long_conversations not in ("truncate", "drop"):
      raise ValueError(f"Data config: long_conversations={self.long_conversations!r}; choose truncate or drop.")
    if self.pairs and (self.loss_on != "completion" or not self.packing):
      raise ValueError(
        f"Data config: preference pairs (train.objective: dpo) score their completions and pack"
        f" both of a pair into one row: set data.loss_on=completion (or leave it empty) and"
        f" data.packing=true (it is loss_on={self.loss_on!r}, packing={self.packing})."
      )
    if not self.loss_on:
      if self.chat_template:
        raise ValueError(
          "Data config: chat_template renders conversation records; set data.loss_on (assistant,"
          " completion or all) to read them."
        )
      return
    kind = self.tokenizer.partition(":")[0] if isinstance(self.tokenizer, str) else "code"
    if kind not in ("hf", "bytes"):
      raise ValueError(
        f"Data config: loss_on={self.loss_on} reads conversations through a chat template, which"
        f" needs a Hugging Face tokenizer (hf:<tokenizer.json>) or bytes; data.tokenizer is"
        f" {self.tokenizer_name()}."
      )
    if self.bos_token or self.eos_token:
      raise ValueError(
        "Data config: the chat template puts a conversation's special tokens itself; leave"
        " data.bos_token and data.eos_token empty with data.loss_on."
      )
    if self.source == "synthetic":
      raise ValueError(
        "Data config: the synthetic source holds no conversations; use source pydoc (its"
        " documents as conversations) or text (conversation records)."
      )

  def tokenizer_name(self) -> str:
    """The spec, or ``code:<function name>`` for a tokenizer given as a function."""
    if isinstance(self.tokenizer, str):
      return self.tokenizer
    return f"code:{getattr(self.tokenizer, '__qualname__', type(self.tokenizer).__name__)}"
