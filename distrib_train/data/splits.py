"""A split of the source's documents: which ones it holds, how they are tokenized, and the checks before reading.

The documents are dealt into ``eval`` (``data.eval_fraction`` of them, drawn
by the seed) and ``train`` (the rest), each kept in the source's order. Before
any batch is read, the split is checked against its readers and the model: a
document for every data shard, pre-tokenized shards of the run's tokenizer,
ids inside the model's vocabulary and some tokens (in a sample of documents),
and, without packing, documents long enough for a sequence.

Not for: where documents come from (``sources.py``), shuffling, sharding and
batching them (``pipeline.py`` and the reads it builds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from distrib_train.data import block_order
from distrib_train.data import sources
from distrib_train.data import tokenizer as tokenizer_lib
from distrib_train.data.config import DataConfig, Tokenizer

# A document (text, or token ids) → its token ids.
Tokenize = Callable[[Any], np.ndarray]


class Subset:
  """The documents at ``indices`` of a source, as a source of their own."""

  def __init__(self, source: sources.Documents, indices: np.ndarray):
    self._source = source
    self._indices = indices

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, index: int) -> str | np.ndarray:
    return self._source[int(self._indices[index])]


def split_documents(
  config: DataConfig, split: str, shard_count: int, vocab_size: int | None
) -> tuple[sources.Documents, np.ndarray, DocumentTokenizer]:
  """The source's documents, the split's indices into them (sorted) and the tokenizer, checked.

  Args:
    config: the data config.
    split: ``train`` or ``eval``.
    shard_count: the data shards the split is read in (one document each at least).
    vocab_size: the model's vocabulary, or None: no check of the ids.

  Raises:
    ValueError: an empty eval split, fewer documents than shards, shards of
      another tokenizer, ids the model does not know, no tokens, or (without
      packing) no document longer than a sequence.
  """
  docs = sources.Documents(config)
  order = np.random.default_rng(config.seed).permutation(len(docs))
  n_eval = int(round(len(docs) * config.eval_fraction))
  if config.eval_fraction > 0:
    n_eval = max(1, min(n_eval, len(docs) - 1))
  held_out = np.sort(order[:n_eval])
  if split == "eval" and not n_eval:
    raise ValueError("The eval split is empty: eval_fraction is 0.")
  indices = held_out if split == "eval" else np.sort(order[n_eval:])
  if len(indices) < shard_count:
    source = f"data source {config.source!r}" + (f" {list(config.paths)}" if config.paths else "")
    raise ValueError(
      f"The {split} split has {len(indices)} document(s) ({source} holds {len(docs)}, {n_eval} held out by"
      f" data.eval_fraction={config.eval_fraction}), fewer than the {shard_count} data shard(s) it is"
      " read in; give more documents or change data.eval_fraction."
    )
  tokenize = _tokenizer(config)
  # The documents checked: spread over the split; where the source has block-read files, those the
  # shuffle by blocks reads first instead (decoded once, kept for it: a spread would decode every block).
  checked = indices[:: max(1, len(indices) // 2000)]
  blocks = docs.blocks()
  if blocks is not None:
    order = block_order.BlockOrder(*blocks, indices=indices, seed=config.seed)
    checked = indices[[order.position(p) for p in range(min(len(indices), 2000))]]
  if docs.pretokenized is not None:
    _check_pretokenized(docs.pretokenized, config)
  if vocab_size is not None and isinstance(config.tokenizer, str):
    ids = tokenizer_lib.load(config.tokenizer, config.bos_token, config.eos_token).vocab_size
    if ids > vocab_size:
      raise ValueError(
        f"data.tokenizer {config.tokenizer} has {ids} ids but the model's vocabulary holds"
        f" {vocab_size}; set model.vocab_size={ids} (or more), or use the model's own tokenizer."
      )
  if vocab_size is not None:
    _check_token_ids(tokenize, docs, checked[:: max(1, len(checked) // 16)][:16], vocab_size, split)
  # A sample: reading every document of a large ArrayRecord corpus here would be too slow.
  sample = checked
  # Only whether a document has a row's tokens matters: each one's head (a prefix of a long text) is encoded.
  longest = max(
    max(map(len, tokenize.heads([docs[int(i)] for i in sample[start : start + 256]], config.seq_len + 1)))
    for start in range(0, len(sample), 256)
  )
  if longest == 0:  # packing would look for tokens forever
    source = f"data source {config.source!r}" + (f" {list(config.paths)}" if config.paths else "")
    skipped = (
      f" ({docs.skipped_documents} of them malformed lines, skipped: data.bad_records=skip)"
      if docs.skipped_documents
      else ""
    )
    if config.conversations and config.long_conversations == "drop":
      skipped += (
        f"; conversations over seq_len + 1 = {config.seq_len + 1} tokens are left out"
        " (data.long_conversations=drop): raise seq_len or set data.long_conversations=truncate"
      )
    raise ValueError(
      f"The {split} split of {source} holds no tokens: all {len(sample)} document(s) checked are"
      f" empty{skipped}; give documents with text."
    )
  if not config.packing and not config.conversations and longest < config.seq_len + 1:
    raise ValueError(
      f"seq_len {config.seq_len} + 1 is longer than every {split} document (longest {longest} tokens of"
      f" {len(sample)} checked) and packing is off; lower seq_len or turn packing on."
    )
  return docs, indices, tokenize


class DocumentTokenizer:
  """A document → its int32 ids (``tokenize(doc)``), or many documents in one call (``tokenize.batch(docs)``).

  A document of ids (pre-tokenized or synthetic) passes through as it is; a
  skipped document (``None``, a malformed one its source dropped) has no ids.
  A tokenizer named in the config encodes a batch in one call
  (``tokenizer.Tokenizer.encode_batch``); one given as a Python function,
  document by document.
  """

  def __init__(self, config: DataConfig):
    tokenizer: Tokenizer | None = config.tokenizer
    self._loaded = None
    # Conversation records (data.loss_on): through the chat template, each token with its loss mask.
    self._chat = None
    if config.conversations:
      from distrib_train.data.chat import ConversationTokenizer
      from distrib_train.data.preference import PairTokenizer

      self._chat = (PairTokenizer if config.pairs else ConversationTokenizer)(config)
    if isinstance(tokenizer, str):
      loaded = tokenizer_lib.load(tokenizer, config.bos_token, config.eos_token)
      plain_bytes = tokenizer == "bytes" and loaded.bos_id is None and loaded.eos_id is None
      self._loaded = None if plain_bytes else loaded
      tokenizer = None if plain_bytes else loaded
    self._function = tokenizer

  @property
  def long_conversations(self) -> int:
    """Conversations longer than a row, cut or left out so far (``data.long_conversations``), here."""
    return 0 if self._chat is None else self._chat.long

  def __call__(self, doc: Any) -> np.ndarray:
    if isinstance(doc, np.ndarray):  # synthetic documents are tokens already
      return doc
    if self._chat is not None:
      return self._chat(doc) if doc is not None else np.zeros(0, self._chat.dtype)
    if doc is None:
      return _EMPTY
    if self._function is None:
      return np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return np.asarray(self._function(doc), dtype=np.int32)

  def batch(self, docs: Sequence[Any]) -> list[np.ndarray]:
    """Each document's ids, as ``__call__`` gives them; the texts among them encoded in one call."""
    if self._chat is not None:
      return [self(doc) for doc in docs]
    if self._function is None:
      return self._with_texts_encoded(docs, tokenizer_lib.utf8_bytes)
    if self._loaded is not None:
      return self._with_texts_encoded(docs, self._loaded.encode_batch)
    return self._with_texts_encoded(docs, lambda texts: [self(text) for text in texts])

  def heads(self, docs: Sequence[Any], count: int) -> list[np.ndarray]:
    """``[ids[:count] for ids in self.batch(docs)]``: the sequences without packing are documents' heads, so a
    named tokenizer encodes only a prefix of each long text (``tokenizer.Tokenizer.encode_heads``)."""
    if self._chat is not None:  # a conversation is rendered whole
      return [ids[:count] for ids in self.batch(docs)]
    if self._function is None:  # UTF-8 bytes: the first ``count`` characters hold the first ``count`` bytes
      encoded = self._with_texts_encoded(docs, lambda texts: tokenizer_lib.utf8_bytes([t[:count] for t in texts]))
    elif self._loaded is not None:
      encoded = self._with_texts_encoded(docs, lambda texts: self._loaded.encode_heads(texts, count))
    else:
      encoded = self.batch(docs)
    return [ids[:count] for ids in encoded]

  @staticmethod
  def _with_texts_encoded(docs: Sequence[Any], encode: Callable[[list[str]], Sequence[np.ndarray]]) -> list[np.ndarray]:
    """The documents with their texts replaced by ``encode(texts)`` (one call); a document of ids as it is, a
    skipped one (None) as no ids."""
    out: list[np.ndarray | None] = [
      doc if isinstance(doc, np.ndarray) else _EMPTY if doc is None else None for doc in docs
    ]
    texts = [i for i, got in enumerate(out) if got is None]
    if texts:
      for i, ids in zip(texts, encode([docs[i] for i in texts])):
        out[i] = ids
    return out  # type: ignore[return-value]


_EMPTY = np.zeros(0, np.int32)
_EMPTY.flags.writeable = False


def token_ids(tokens: np.ndarray) -> np.ndarray:
  """A document's ids: its tokens, or a conversation's ``ids`` field (``chat.SCORED_TOKENS``)."""
  return tokens["ids"] if tokens.dtype.names else tokens


def _tokenizer(config: DataConfig) -> DocumentTokenizer:
  """The config's tokenizer as document → int32 ids (a document of ids, pre-tokenized or synthetic, as it is)."""
  return DocumentTokenizer(config)


def _check_pretokenized(fingerprint: Mapping[str, Any], config: DataConfig) -> None:
  """Refuses pre-tokenized shards of another tokenizer than the run's ``data.tokenizer``."""
  run = (
    tokenizer_lib.load(config.tokenizer, config.bos_token, config.eos_token).fingerprint
    if isinstance(config.tokenizer, str)
    else {"spec": config.tokenizer_name()}
  )
  keys = ("spec", "sha256", "bos_id", "eos_id")
  if any(fingerprint.get(k) != run.get(k) for k in keys):
    raise ValueError(
      f"The data paths' shards hold token ids of tokenizer {fingerprint.get('spec')} (BOS"
      f" {fingerprint.get('bos_id')}, EOS {fingerprint.get('eos_id')}); data.tokenizer says"
      f" {run.get('spec')} (BOS {run.get('bos_id')}, EOS {run.get('eos_id')}). Set data.tokenizer,"
      " bos_token and eos_token as the shards were converted, or convert them again."
    )


def _check_token_ids(tokenize, docs, sample: np.ndarray, vocab_size: int, split: str) -> None:
  """Refuses ids outside the model's vocabulary in a sample of documents
  (the model would look them up as NaN and every step would be skipped)."""
  for index in sample:
    ids = token_ids(tokenize(docs[int(index)]))
    if len(ids) and (ids.max() >= vocab_size or ids.min() < 0):
      bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
      raise ValueError(
        f"The {split} data holds token id {bad} (document {int(index)}), outside the model's vocabulary of"
        f" {vocab_size} ids (0 to {vocab_size - 1}); use a tokenizer that matches the model or a model with a"
        " larger vocab_size."
      )
