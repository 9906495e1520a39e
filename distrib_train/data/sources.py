"""Where documents come from: the pydoc corpus, text / JSONL / Parquet files, ArrayRecord.

Each source is random access (``len`` and ``[index]``), as grain's
``MapDataset.source`` wants, and lazy: a ``.jsonl`` file is indexed by the
byte offset of each document (8 bytes a document) and each line read when
the pipeline asks for it; a ``.parquet`` file is read a row group at a time;
a ``.txt`` file is one document, read when needed. A process holds only
the documents it is tokenizing, whatever the corpus size. ``write_array_record`` (also ``python -m
distrib_train.data convert IN [IN ...] OUT``) streams text or JSONL files
into ArrayRecord shards, grain's native random-access format.
"""

from __future__ import annotations

import argparse
import glob as globlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
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


def iter_text_file(path: str, field: str = "text") -> Iterator[str]:
  """The documents of one file, read as they are needed.

  A ``.jsonl`` file yields the ``field`` of each line, one line in memory at
  a time; a ``.parquet`` file the ``field`` column, one row group at a time;
  any other file is one document (blank ones yield none).

  Raises:
    ValueError: an unreadable file, text that is not UTF-8, a line that is
      not JSON or has no string ``field`` (file and line named).
  """
  if path.endswith(".parquet"):
    parquet = _ParquetFile(path, field)
    for group in range(parquet.groups):
      yield from (doc for doc in parquet.group(group) if doc.strip())
    return
  try:
    if not path.endswith(".jsonl"):
      with open(path, "rb") as f:
        text = _decode(f.read(), path, None)
      if text.strip():
        yield text
      return
    with open(path, "rb") as f:
      for number, raw in enumerate(f, 1):
        if raw.strip():
          yield _json_text(raw, path, number, field)
  except OSError as e:
    raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None


def _json_text(raw: bytes, path: str, number: int, field: str) -> str:
  line = _decode(raw, path, number)
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"Data file {path!r} line {number} is not JSON: {e.msg}.") from None
  if not isinstance(record, dict) or not isinstance(record.get(field), str):
    raise ValueError(f"Data file {path!r} line {number} has no string field {field!r} (data.text_field).")
  return record[field]


class _JsonlFile:
  """A JSONL file's documents by number: the byte offset of each non-blank line (8 bytes a document),
  each line read from disk when asked for.

  Every line is checked once, streaming, when the file is opened (JSON with
  a string ``field``): a bad line fails the loader's construction, naming
  the file and line, not a step hours later.
  """

  def __init__(self, path: str, field: str):
    self.path, self.field = path, field
    offsets, position = [], 0
    try:
      with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
          if raw.strip():
            _json_text(raw, path, number, field)
            offsets.append(position)
          position += len(raw)
    except OSError as e:
      raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None
    self.offsets = np.asarray(offsets, np.int64)

  def __len__(self) -> int:
    return len(self.offsets)

  def __getitem__(self, index: int) -> str:
    with open(self.path, "rb") as f:
      f.seek(int(self.offsets[index]))
      return _json_text(f.readline(), self.path, 0, self.field)


class _TextFile:
  """A ``.txt`` file: one document, read when asked for (none if blank)."""

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, "rb") as f:
        head = f.read(1 << 16)
      self.blank = not head.strip() and os.path.getsize(path) <= 1 << 16
      if not self.blank:
        self[0]  # not UTF-8 fails now, naming the file
    except OSError as e:
      raise ValueError(f"Cannot read data file {path!r}: {e.strerror}.") from None

  def __len__(self) -> int:
    return 0 if self.blank else 1

  def __getitem__(self, index: int) -> str:
    with open(self.path, "rb") as f:
      return _decode(f.read(), self.path, None)


class _ParquetFile:
  """A Parquet file's ``field`` column by row, read one row group at a time (the last one kept)."""

  def __init__(self, path: str, field: str):
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise ValueError("Parquet data needs pyarrow: pip install pyarrow (or 'distrib_train[text]').") from None
    self.path, self.field = path, field
    try:
      self.file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError with its own text
      raise ValueError(f"Data file {path!r} is not a readable Parquet file: {e}") from None
    schema = self.file.schema_arrow
    if field not in schema.names:
      raise ValueError(f"Data file {path!r} has no column {field!r} (data.text_field); its columns:"
                       f" {', '.join(schema.names)}.")
    if str(schema.field(field).type) not in ("string", "large_string"):
      raise ValueError(f"Data file {path!r}: column {field!r} holds {schema.field(field).type}, not text.")
    meta = self.file.metadata
    self.groups = meta.num_row_groups
    self.starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(self.groups)])
    self._cached: tuple[int, list] | None = None

  def __len__(self) -> int:
    return int(self.starts[-1])

  def group(self, group: int) -> list:
    if self._cached is None or self._cached[0] != group:
      column = self.file.read_row_group(group, columns=[self.field]).column(0).to_pylist()
      bad = next((i for i, v in enumerate(column) if not isinstance(v, str)), None)
      if bad is not None:
        raise ValueError(f"Data file {self.path!r} row {int(self.starts[group]) + bad}: column {self.field!r}"
                         f" holds {type(column[bad]).__name__}, not text.")
      self._cached = (group, column)
    return self._cached[1]

  def __getitem__(self, index: int) -> str:
    group = int(np.searchsorted(self.starts, index, side="right")) - 1
    return self.group(group)[index - int(self.starts[group])]


class _Concatenated:
  """Several files' documents as one numbered sequence."""

  def __init__(self, parts: Sequence[Any]):
    self.parts = [p for p in parts if len(p)]
    self.starts = np.cumsum([0] + [len(p) for p in self.parts])

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, index: int) -> Any:
    part = int(np.searchsorted(self.starts, index, side="right")) - 1
    return self.parts[part][index - int(self.starts[part])]


def _decode(raw: bytes, path: str, line: int | None) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    where = f" line {line}" if line is not None else ""
    raise ValueError(f"Data file {path!r}{where} is not UTF-8 text (byte {e.start}).") from None


def _pretokenized(shards: Sequence[str]) -> dict[str, Any] | None:
  """The tokenizer fingerprint of pre-tokenized shards (``convert --tokenizer``), or None for text.

  Raises:
    ValueError: shards of different tokenizers, or text and tokens mixed.
  """
  found = set()
  for shard in shards:
    prefix = re.sub(r"-\d{5}-of-\d{5}\.array_record$", "", shard)
    sidecar = f"{prefix}.tokenizer.json"
    found.add(open(sidecar, encoding="utf-8").read() if os.path.exists(sidecar) else None)
  if len(found) > 1:
    raise ValueError(f"Data paths mix ArrayRecord shards of different tokenizers (or tokens and text): {shards}.")
  text = found.pop()
  return None if text is None else json.loads(text)


class Documents:
  """Random-access documents (grain ``RandomAccessDataSource``); ``pretokenized`` is the tokenizer
  fingerprint of shards that hold token ids (``convert --tokenizer``), else None."""

  def __init__(self, config: DataConfig):
    self.config = config
    self._array_record = None
    self.pretokenized: dict[str, Any] | None = None
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
        self.pretokenized = _pretokenized(records)
      else:
        field = config.text_field
        self._docs = _Concatenated([_JsonlFile(path, field) if path.endswith(".jsonl") else
                                    _ParquetFile(path, field) if path.endswith(".parquet") else _TextFile(path)
                                    for path in texts])
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
      record = self._array_record[index]
      return np.frombuffer(record, np.int32) if self.pretokenized else record.decode("utf-8")
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


def _file_records(task: tuple[str, str, Any]) -> list[bytes]:
  """One file's records (a worker process's task): UTF-8 text, or int32 token ids."""
  path, field, spec = task
  tokenizer = None
  if spec is not None:
    from distrib_train.data import tokenizer as tokenizer_lib

    tokenizer = tokenizer_lib.load(*spec)
  return [doc.encode("utf-8") if tokenizer is None else np.asarray(tokenizer(doc), np.int32).tobytes()
          for doc in iter_text_file(path, field)]


def convert(inputs: Iterable[str], output: str, *, num_shards: int = 1, paths: bool = True,
            text_field: str = "text", tokenizer: Any = None, workers: int = 0) -> list[str]:
  """Streams the documents of ``inputs`` into ArrayRecord shards.

  Args:
    inputs: ``.txt`` / ``.jsonl`` / ``.parquet`` paths or globs
      (``paths=True``), else texts.
    output: path prefix of the shards; its directory is created if missing.
    num_shards: how many files to spread the records over.
    paths: whether ``inputs`` name files.
    text_field: the JSONL field or Parquet column of the text.
    tokenizer: a ``tokenizer.Tokenizer`` (``tokenizer.load(spec, bos, eos)``):
      the records are its token ids (int32), tokenized once here, and
      ``{output}.tokenizer.json`` says which tokenizer; training from the
      shards skips tokenizing (and refuses another ``data.tokenizer``).
    workers: read and tokenize this many files at once in worker processes
      (0: in this process); the shards are the same, byte for byte, and
      memory is bounded by ``workers`` files' records.
  """
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}.")
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    raise ValueError(f"workers must be 0 or more, got {workers!r}.")
  if workers and tokenizer is not None and not hasattr(tokenizer, "spec"):
    raise ValueError("workers need a tokenizer loaded from a spec (tokenizer.load), which a worker can load again.")
  inputs = list(inputs) if paths else inputs
  encode = lambda doc: doc.encode("utf-8") if tokenizer is None else np.asarray(tokenizer(doc), np.int32).tobytes()
  pool = None
  if paths and workers > 0:
    import multiprocessing

    spec = None if tokenizer is None else (tokenizer.spec, *_special_tokens(tokenizer))
    pool = multiprocessing.get_context("spawn").Pool(workers)
    records = (r for rs in pool.imap(_file_records, [(p, text_field, spec) for p in _expand(inputs)]) for r in rs)
  else:
    documents = (doc for path in _expand(inputs) for doc in iter_text_file(path, text_field)) if paths else \
        iter(inputs)
    records = (encode(doc) for doc in documents)
  try:
    return _write_shards(records, output, num_shards, tokenizer, inputs if paths else None)
  finally:
    if pool is not None:
      pool.terminate()


def _special_tokens(tokenizer: Any) -> tuple[str, str]:
  """The BOS / EOS token texts a loaded tokenizer was made with (for a worker to load it again)."""
  return tokenizer.bos_token, tokenizer.eos_token


def _write_shards(records: Iterator[bytes], output: str, num_shards: int, tokenizer: Any,
                  inputs: Sequence[str] | None) -> list[str]:
  from array_record.python import array_record_module

  first = next(records, None)
  if first is None:
    raise ValueError("No documents to write" + (f" in {', '.join(inputs)}." if inputs else "."))
  directory = os.path.dirname(output)
  if directory:
    os.makedirs(directory, exist_ok=True)
  final = [f"{output}-{i:05d}-of-{num_shards:05d}.array_record" for i in range(num_shards)]
  partial = [f"{p}.partial" for p in final]
  writers = [array_record_module.ArrayRecordWriter(p, "group_size:1") for p in partial]
  try:
    for i, record in enumerate(itertools.chain([first], records)):
      writers[i % num_shards].write(record)
    for writer in writers:
      writer.close()
  except BaseException:
    for writer, path in zip(writers, partial):
      writer.close()
      if os.path.exists(path):
        os.remove(path)
    raise
  if tokenizer is not None:
    with open(f"{output}.tokenizer.json", "w", encoding="utf-8") as f:
      json.dump(tokenizer.fingerprint, f)
  for source, target in zip(partial, final):
    os.replace(source, target)
  return final + ([f"{output}.tokenizer.json"] if tokenizer is not None else [])


def main(argv: Sequence[str] | None = None) -> None:
  """``convert INPUT [INPUT ...] OUTPUT [--shards N]``: text or JSONL to ArrayRecord."""
  parser = argparse.ArgumentParser(prog="python -m distrib_train.data")
  sub = parser.add_subparsers(dest="command", required=True)
  convert_parser = sub.add_parser(
      "convert", help="write .txt / .jsonl files (paths or globs) as ArrayRecord shards, streaming")
  convert_parser.add_argument("inputs", nargs="+", metavar="INPUT", help="a .txt or .jsonl file, or a glob")
  convert_parser.add_argument("output", help="path prefix of the shards (its directory is created)")
  convert_parser.add_argument("--shards", type=int, default=1)
  convert_parser.add_argument("--text_field", default="text", help="the JSONL field or Parquet column of the text")
  convert_parser.add_argument("--tokenizer", help="tokenize once, writing token ids: bytes, hf:<tokenizer.json>,"
                              " sentencepiece:<model>, tiktoken:<file>")
  convert_parser.add_argument("--bos_token", default="", help="with --tokenizer: a token before every document")
  convert_parser.add_argument("--eos_token", default="", help="with --tokenizer: a token after every document")
  convert_parser.add_argument("--workers", type=int, default=0, help="files read and tokenized at once in worker"
                              " processes (default 0: in this one)")
  args = parser.parse_args(argv)
  try:
    tokenizer = None
    if args.tokenizer:
      from distrib_train.data import tokenizer as tokenizer_lib

      tokenizer = tokenizer_lib.load(args.tokenizer, args.bos_token, args.eos_token)
    paths = convert(args.inputs, args.output, num_shards=args.shards, text_field=args.text_field,
                    tokenizer=tokenizer, workers=args.workers)
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
  print("\n".join(paths))
