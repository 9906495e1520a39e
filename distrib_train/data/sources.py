"""Where documents come from: the config's source as random-access documents (``Documents``).

``synthetic`` (random tokens), ``pydoc`` (the English documentation shipped
with every CPython, ``pydoc_data.topics``: a real corpus with no download), or
``text``: files or globs of text, JSONL or Parquet (read lazily by
``text_files.py``), compressed JSONL (``compressed.py``), Hugging Face
``datasets`` folders (``arrow_text.py``), or ArrayRecord shards of text or of
token ids (written by ``record_shards.py``); ``arithmetic``: prompt records of
single-digit sums with their solution (``{"prompt": "3+4=", "solution": "7"}``),
the GRPO demo's task. Each is random access (``len``
and ``[index]``), as grain's ``MapDataset.source`` wants; a corpus with files
read by blocks (Parquet, compressed JSONL) says so (``blocks()``) and its
readers share one ``block_order.BlockCache`` of ``data.block_cache`` blocks.

Not for: reading a file format (``text_files.py``), writing shards
(``record_shards.py``), splitting, shuffling or batching (``pipeline.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from distrib_train.data import arrow_text
from distrib_train.data import block_order
from distrib_train.data import compressed
from distrib_train.data import jsonl
from distrib_train.data import record_shards
from distrib_train.data import text_files
from distrib_train.data.config import DataConfig


def _pydoc_documents(target_bytes: int = 4096) -> list[str]:
  """The pydoc topics as documents of whole paragraphs, about 4 KiB each.

  Paragraphs alone (~100 bytes) would make grain's per-record cost the
  bottleneck; whole topics (79 of them) would leave too few to shard.
  """
  from pydoc_data import topics

  docs, current = [], ""
  for name in sorted(topics.topics):
    for paragraph in topics.topics[name].split("\n\n"):
      if not paragraph.strip():
        continue
      current = f"{current}\n\n{paragraph}" if current else paragraph
      if len(current) >= target_bytes:
        docs.append(current)
        current = ""
  if current:
    docs.append(current)
  return docs


CONVERSATION_BYTES = 600  # the pydoc documents the conversations answer with: paragraphs joined to this length


def pydoc_conversations(docs: list[str]) -> list[str]:
  """The pydoc documents as conversation records: a user asks about the text's opening, the assistant
  answers with the text (the ``sft-tiny`` preset's data, no download)."""
  import json

  def asked(doc: str) -> str:
    opening = doc.strip().splitlines()[0][:80]
    return f"Explain this part of the Python documentation: {opening}"

  def answer(doc: str) -> str:  # at most 800 characters, cut at a line's end: nearly all fit a 1024-byte row
    if len(doc) <= 800:
      return doc
    cut = doc.rfind("\n", 200, 800)
    return doc[: cut if cut > 0 else 800]

  return [
    json.dumps({"messages": [{"role": "user", "content": asked(doc)}, {"role": "assistant", "content": answer(doc)}]})
    for doc in docs
  ]


def pydoc_pairs(docs: list[str]) -> list[str]:
  """The pydoc conversations as preference records: the passage asked about chosen, the same passage with its
  words shuffled rejected (``train.objective: dpo`` on the demo corpus). The two are equally long and hold the
  same words, so what a tiny model can learn from them is what generalizes to held-out pairs: fluent text over
  scrambled text. (Another passage as the rejected answer taught it nothing that held out: reward accuracy 0.25.)"""
  import json
  import random

  def scrambled(message: dict, seed: int) -> dict:
    words = message["content"].split(" ")
    random.Random(seed).shuffle(words)
    return {**message, "content": " ".join(words)}

  turns = [json.loads(record)["messages"] for record in pydoc_conversations(docs)]
  return [json.dumps({"prompt": m[:1], "chosen": m[1:], "rejected": [scrambled(m[1], i)]}) for i, m in enumerate(turns)]


def arithmetic_records() -> list[str]:
  """Sums of two digits under 10 as prompt records (JSON text), ``a+b=`` with its ``solution``: ten for each sum,
  so no answer is more likely than another (a policy that ignores its prompt gets one in ten right)."""
  import json

  pairs = [(j % (total + 1), total - j % (total + 1)) for total in range(10) for j in range(10)]
  return [json.dumps({"prompt": f"{a}+{b}=", "solution": str(a + b)}) for a, b in pairs]


def read_by_blocks(config: DataConfig) -> bool:
  """Whether ``config``'s corpus has files read by blocks (Parquet, compressed JSONL), whose order is the
  shuffle by blocks (``block_order.py``) rather than grain's index shuffle."""
  return config.source == "text" and any(
    path.endswith(".parquet") or compressed.is_compressed(path) for path in text_files.expand(config.paths)
  )


class Documents:
  """Random-access documents (grain ``RandomAccessDataSource``); ``pretokenized`` is the tokenizer
  fingerprint of shards that hold token ids (``convert --tokenizer``), else None. A malformed JSONL line
  reads as None under ``data.bad_records=skip`` (counted in ``skipped_documents``)."""

  def __init__(self, config: DataConfig):
    self.config = config
    self._array_record = None
    self.bad_records = jsonl.BadRecords(config.bad_records)
    self.pretokenized: dict[str, Any] | None = None
    self._block_cache = block_order.BlockCache(config.block_cache)
    if config.source == "pydoc":
      self._docs = _pydoc_documents()
      if config.conversations:  # a pair is two answers: half as long each
        self._docs = (
          pydoc_pairs(_pydoc_documents(CONVERSATION_BYTES // 2))
          if config.pairs
          else pydoc_conversations(_pydoc_documents(CONVERSATION_BYTES))
        )
    elif config.source == "synthetic":
      self._docs = None
    elif config.source == "arithmetic":
      self._docs = arithmetic_records()
    else:
      files = text_files.expand(config.paths)
      records = [f for f in files if f.endswith(".array_record")]
      texts = [f for f in files if not f.endswith(".array_record")]
      if records and texts:
        raise ValueError("Data paths mix .array_record shards and text files; give one kind.")
      if records and (config.conversations or config.prompts):
        raise ValueError(
          f"Data file {records[0]!r} is an ArrayRecord shard, not conversation records"
          f" (data.loss_on={config.loss_on}): give JSONL (plain or compressed), Parquet or a datasets"
          " folder of records with 'messages', or 'prompt' and 'completion'."
        )
      if records:
        import grain

        for path in records:
          record_shards.check_readable(path)
        self._array_record = grain.sources.ArrayRecordDataSource(records)
        self.pretokenized = record_shards.pretokenized(records)
      else:
        # Each JSONL or compressed file keeps its index mapped and its data (or decompressor) open, Parquet its file.
        jsonl.allow_open_files(
          sum(
            2 if path.endswith(".jsonl") or compressed.is_compressed(path) else 1 if path.endswith(".parquet") else 0
            for path in texts
          )
        )
        self._docs = text_files.Concatenated([self._reader(path) for path in texts])
    if len(self) == 0:
      raise ValueError(f"Data source {config.source!r} {list(config.paths) or ''} holds no documents.")

  def _reader(self, path: str) -> Any:
    """The reader of one text file (or ``datasets`` folder); of its conversation records with ``data.loss_on``."""
    config = self.config
    field = arrow_text.PROMPTS if config.prompts else arrow_text.RECORD if config.conversations else config.text_field
    if (config.conversations or config.prompts) and not (
      path.endswith((".jsonl", ".parquet")) or compressed.is_compressed(path) or arrow_text.is_dataset_folder(path)
    ):
      raise ValueError(
        f"Data file {path!r} holds text, not conversation records (data.loss_on={config.loss_on}):"
        " give JSONL (plain or compressed), Parquet or a datasets folder of records with"
        " 'messages', or 'prompt' and 'completion'."
      )
    if path.endswith(".jsonl"):
      return jsonl.JsonlFile(path, field, self.bad_records, config.index_cache_dir)
    if path.endswith(".parquet"):
      return text_files.ParquetFile(path, field, self._block_cache)
    if compressed.is_compressed(path):
      parse = functools.partial(jsonl.json_document, bad_records=self.bad_records)
      return compressed.CompressedJsonl(path, field, parse, self._block_cache, config.index_cache_dir)
    if arrow_text.is_dataset_folder(path):
      return arrow_text.DatasetFolder(path, field)
    return text_files.TextFile(path)

  @property
  def skipped_documents(self) -> int:
    """Malformed JSONL lines read so far (``data.bad_records=skip``), in this process."""
    return self.bad_records.skipped

  def blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The source's blocks where it has files read by blocks (``text_files.Concatenated.blocks``), else None."""
    docs = getattr(self, "_docs", None)  # ArrayRecord shards have none
    return docs.blocks() if isinstance(docs, text_files.Concatenated) else None

  def __len__(self) -> int:
    if self._array_record is not None:
      return len(self._array_record)
    if self._docs is None:
      return self.config.synthetic_documents
    return len(self._docs)

  def __getitem__(self, index: int) -> str | np.ndarray | None:
    if self._array_record is not None:
      record = self._array_record[index]
      return np.frombuffer(record, np.int32) if self.pretokenized else record.decode("utf-8")
    if self._docs is None:  # synthetic: a random document of 16 to 4 × seq_len tokens
      rng = np.random.default_rng([self.config.seed, int(index)])
      return rng.integers(0, 256, size=int(rng.integers(16, 4 * self.config.seq_len)), dtype=np.int32)
    return self._docs[index]
