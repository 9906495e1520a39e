"""Where documents come from: the pydoc corpus, text / JSONL files, ArrayRecord.

Each source is random access (``len`` and ``[index]``), as grain's
``MapDataset.source`` wants. ``write_array_record`` (also ``python -m
distrib_train.data convert IN [IN ...] OUT``) streams text or JSONL files
into ArrayRecord shards, grain's native random-access format.
"""

from __future__ import annotations

import argparse
import glob as globlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
import numpy as np

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


def _expand(paths: Sequence[str]) -> list[str]:
  files = []
  for pattern in paths:
    matched = sorted(globlib.glob(os.path.expanduser(pattern)))
    if not matched:
      raise ValueError(f"Data path {pattern!r} matches no file.")
    files.extend(matched)
  return files


def iter_text_file(path: str) -> Iterator[str]:
  """The documents of one file, read as they are needed.

  A ``.jsonl`` file yields the ``text`` field of each line, one line in
  memory at a time; any other file is one document (blank ones yield none).

  Raises:
    ValueError: an unreadable file, text that is not UTF-8, a line that is
      not JSON or has no string ``text`` (file and line named).
  """
  try:
    if not path.endswith(".jsonl"):
      with open(path, "rb") as f:
        text = _decode(f.read(), path, None)
      if text.strip():
        yield text
      return
    with open(path, "rb") as f:
      for number, raw in enumerate(f, 1):
        line = _decode(raw, path, number)
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"Data file {path!r} line {number} is not JSON: {e.msg}.") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
          raise ValueError(f"Data file {path!r} line {number} has no string field 'text'.")
        yield record["text"]
  except OSError as e:
    raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None


def _decode(raw: bytes, path: str, line: int | None) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    where = f" line {line}" if line is not None else ""
    raise ValueError(f"Data file {path!r}{where} is not UTF-8 text (byte {e.start}).") from None


def _read_text_file(path: str) -> list[str]:
  return list(iter_text_file(path))


class Documents:
  """Random-access documents (grain ``RandomAccessDataSource``)."""

  def __init__(self, config: DataConfig):
    self.config = config
    self._array_record = None
    if config.source == "pydoc":
      self._docs = _pydoc_documents()
    elif config.source == "synthetic":
      self._docs = None
    else:
      files = _expand(config.paths)
      records = [f for f in files if f.endswith(".array_record")]
      texts = [f for f in files if not f.endswith(".array_record")]
      if records and texts:
        raise ValueError("Data paths mix .array_record shards and text files; give one kind.")
      if records:
        import grain

        for path in records:
          _check_array_record(path)
        self._array_record = grain.sources.ArrayRecordDataSource(records)
      else:
        self._docs = [doc for path in texts for doc in _read_text_file(path)]
    if len(self) == 0:
      raise ValueError(f"Data source {config.source!r} {list(config.paths) or ''} holds no documents.")

  def __len__(self) -> int:
    if self._array_record is not None:
      return len(self._array_record)
    if self._docs is None:
      return self.config.synthetic_documents
    return len(self._docs)

  def __getitem__(self, index: int) -> str | np.ndarray:
    if self._array_record is not None:
      return self._array_record[index].decode("utf-8")
    if self._docs is None:  # synthetic: a random document of 16 to 4 × seq_len tokens
      rng = np.random.default_rng([self.config.seed, int(index)])
      return rng.integers(0, 256, size=int(rng.integers(16, 4 * self.config.seq_len)), dtype=np.int32)
    return self._docs[index]


def _check_array_record(path: str) -> None:
  from array_record.python import array_record_module

  try:
    reader = array_record_module.ArrayRecordReader(path)
    reader.close()
  except Exception as e:  # the reader raises plain RuntimeErrors for bad files
    raise ValueError(f"Data file {path!r} is not a readable ArrayRecord file: {e}") from None


def write_array_record(documents: Iterable[str] | str, output: str, *, num_shards: int = 1) -> list[str]:
  """Writes documents as ArrayRecord shards, one record per document.

  Documents are streamed: a corpus larger than memory converts in memory
  bounded by its largest document. The shards appear only once all of them
  are written; a failure part way leaves nothing behind.

  Args:
    documents: texts (any iterable), or a ``.txt`` / ``.jsonl`` path or glob.
    output: path prefix; shards are ``{output}-00000-of-0000N.array_record``.
      Its directory is created if missing.
    num_shards: how many files to spread the records over.

  Returns:
    The shard paths.

  Raises:
    ValueError: no documents, a bad input file (named), or ``num_shards < 1``.
  """
  return convert([documents] if isinstance(documents, str) else documents, output, num_shards=num_shards,
                 paths=isinstance(documents, str))


def convert(inputs: Iterable[str], output: str, *, num_shards: int = 1, paths: bool = True) -> list[str]:
  """Streams the documents of ``inputs`` into ArrayRecord shards.

  Args:
    inputs: ``.txt`` / ``.jsonl`` paths or globs (``paths=True``), else texts.
    output: path prefix of the shards; its directory is created if missing.
    num_shards: how many files to spread the records over.
    paths: whether ``inputs`` name files.
  """
  from array_record.python import array_record_module

  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}.")
  inputs = list(inputs) if paths else inputs
  documents = (doc for path in _expand(inputs) for doc in iter_text_file(path)) if paths else iter(inputs)
  first = next(documents, None)
  if first is None:
    raise ValueError("No documents to write" + (f" in {', '.join(inputs)}." if paths else "."))
  directory = os.path.dirname(output)
  if directory:
    os.makedirs(directory, exist_ok=True)
  final = [f"{output}-{i:05d}-of-{num_shards:05d}.array_record" for i in range(num_shards)]
  partial = [f"{p}.partial" for p in final]
  writers = [array_record_module.ArrayRecordWriter(p, "group_size:1") for p in partial]
  try:
    for i, doc in enumerate(itertools.chain([first], documents)):
      writers[i % num_shards].write(doc.encode("utf-8"))
    for writer in writers:
      writer.close()
  except BaseException:
    for writer, path in zip(writers, partial):
      writer.close()
      if os.path.exists(path):
        os.remove(path)
    raise
  for source, target in zip(partial, final):
    os.replace(source, target)
  return final


def main(argv: Sequence[str] | None = None) -> None:
  """``convert INPUT [INPUT ...] OUTPUT [--shards N]``: text or JSONL to ArrayRecord."""
  parser = argparse.ArgumentParser(prog="python -m distrib_train.data")
  sub = parser.add_subparsers(dest="command", required=True)
  convert_parser = sub.add_parser(
      "convert", help="write .txt / .jsonl files (paths or globs) as ArrayRecord shards, streaming")
  convert_parser.add_argument("inputs", nargs="+", metavar="INPUT", help="a .txt or .jsonl file, or a glob")
  convert_parser.add_argument("output", help="path prefix of the shards (its directory is created)")
  convert_parser.add_argument("--shards", type=int, default=1)
  args = parser.parse_args(argv)
  try:
    paths = convert(args.inputs, args.output, num_shards=args.shards)
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
  print("\n".join(paths))
