"""ArrayRecord shards, grain's native random-access format: writing them, and what a reader checks of them.

``write_array_record`` (also ``python -m distrib_train.data convert IN [IN ...]
OUT``) streams text, JSONL or Parquet files into shards, one record per
document: UTF-8 text, or with a tokenizer its int32 token ids and a
``{output}.tokenizer.json`` sidecar naming it. ``pretokenized`` reads that
sidecar back and ``check_readable`` opens a shard, for ``sources.Documents``.

Not for: reading the text files themselves (``text_files.py``), choosing a
source from the config (``sources.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from absl import logging

from distrib_train.data.jsonl import BadRecords, json_document, lines_before
from distrib_train.data.text_files import expand, iter_text_file


def pretokenized(shards: Sequence[str]) -> dict[str, Any] | None:
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


def check_readable(path: str) -> None:
  """Opens and closes one shard.

  Raises:
    ValueError: not a readable ArrayRecord file (named).
  """
  from array_record.python import array_record_module

  try:
    reader = array_record_module.ArrayRecordReader(path)
    reader.close()
  except Exception as e:  # the reader raises plain RuntimeErrors for bad files
    raise ValueError(f"Data file {path!r} is not a readable ArrayRecord file: {e}") from None


def write_array_record(documents: Iterable[str] | str, output: str, *, num_shards: int = 1,
                       bad_records: str = "skip") -> list[str]:
  """Writes documents as ArrayRecord shards, one record per document.

  Documents are streamed: a corpus larger than memory converts in memory
  bounded by its largest document. The shards appear only once all of them
  are written; a failure part way leaves nothing behind.

  Args:
    documents: texts (any iterable), or a ``.txt`` / ``.jsonl`` path or glob.
    output: path prefix; shards are ``{output}-00000-of-0000N.array_record``.
      Its directory is created if missing.
    num_shards: how many files to spread the records over.
    bad_records: a malformed JSONL line is skipped (``skip``: logged) or
      stops the conversion (``error``), as ``data.bad_records``.

  Returns:
    The shard paths.

  Raises:
    ValueError: no documents, a bad input file (named), or ``num_shards < 1``.
  """
  return convert([documents] if isinstance(documents, str) else documents, output, num_shards=num_shards,
                 paths=isinstance(documents, str), bad_records=bad_records)


_BATCH = 256  # documents tokenized in one call
_MIN_RANGE, _MAX_RANGE = 1 << 20, 64 << 20  # bytes of a .jsonl file one worker task reads, at least / at most


def _encoded(documents: Iterable[str], tokenizer: Any) -> Iterator[bytes]:
  """Each document's record: its UTF-8 text, or its int32 token ids, tokenized ``_BATCH`` at a time."""
  if tokenizer is None:
    yield from (doc.encode("utf-8") for doc in documents)
    return
  batch_encode = getattr(tokenizer, "encode_batch", None) or \
      (lambda texts: [np.asarray(tokenizer(t), np.int32) for t in texts])
  iterator = iter(documents)
  while batch := list(itertools.islice(iterator, _BATCH)):
    yield from (np.asarray(ids, np.int32).tobytes() for ids in batch_encode(batch))


def _ranges(files: Sequence[str], workers: int) -> list[tuple[str, int, int]]:
  """Worker tasks: ``(file, first byte, end byte)``; a ``.jsonl`` file in byte ranges (a line belongs to the
  range it starts in), so that one large file spreads over the workers; any other file whole (end -1)."""
  tasks = []
  for path in files:
    size = os.path.getsize(path) if path.endswith(".jsonl") else 0
    step = max(_MIN_RANGE, min(_MAX_RANGE, size // (4 * workers) + 1))
    tasks.extend([(path, start, min(start + step, size)) for start in range(0, size, step)] or [(path, 0, -1)])
  return tasks


def _jsonl_range(path: str, start: int, end: int, field: str, bad_records: BadRecords) -> Iterator[str]:
  """The documents of the lines of a ``.jsonl`` file that start in ``[start, end)`` (a malformed one to
  ``bad_records``, named by its line number in the file, counted only then)."""
  with open(path, "rb") as f:
    if start:
      f.seek(start - 1)
      if f.read(1) != b"\n":
        f.readline()  # the line under way belongs to the range before
    position = f.tell()
    while position < end and (raw := f.readline()):
      at, position = position, position + len(raw)
      if raw.strip() and (doc := json_document(raw, path, lambda: lines_before(path, at) + 1, field,
                                               bad_records)) is not None:
        yield doc


def _range_records(task: tuple[str, int, int, str, Any, str]) -> list[bytes]:
  """One task's records (in a worker process): UTF-8 text, or int32 token ids."""
  path, start, end, field, spec, policy = task
  tokenizer = None
  if spec is not None:
    from distrib_train.data import tokenizer as tokenizer_lib

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism: no extra threads each
    tokenizer = tokenizer_lib.load(*spec)
  bad_records = BadRecords(policy, "bad_records")
  documents = (iter_text_file(path, field, bad_records) if end < 0 else
               _jsonl_range(path, start, end, field, bad_records))
  return list(_encoded(documents, tokenizer))


def _in_order(pool: Any, tasks: Sequence[tuple], workers: int) -> Iterator[bytes]:
  """The records of ``tasks``, in order, with at most ``2 × workers`` tasks under way or waiting to be written."""
  import collections

  pending: collections.deque = collections.deque()
  for task in tasks:
    pending.append(pool.apply_async(_range_records, (task,)))
    if len(pending) >= 2 * workers:
      yield from pending.popleft().get()
  while pending:
    yield from pending.popleft().get()


def convert(inputs: Iterable[str], output: str, *, num_shards: int = 1, paths: bool = True,
            text_field: str = "text", tokenizer: Any = None, workers: int = 0,
            bad_records: str = "skip") -> list[str]:
  """Streams the documents of ``inputs`` into ArrayRecord shards.

  Record ``i`` (the ``i``-th document of the inputs, in order) goes to shard
  ``i % num_shards``, whatever ``workers``.

  Args:
    inputs: ``.txt`` / ``.jsonl`` / ``.parquet`` paths or globs
      (``paths=True``), else texts.
    output: path prefix of the shards; its directory is created if missing.
    num_shards: how many files to spread the records over.
    paths: whether ``inputs`` name files.
    text_field: the JSONL field or Parquet column of the text.
    tokenizer: a ``tokenizer.Tokenizer`` (``tokenizer.load(spec, bos, eos)``):
      the records are its token ids (int32), tokenized once here,
      ``_BATCH`` documents to a call, and ``{output}.tokenizer.json`` says
      which tokenizer; training from the shards skips tokenizing (and
      refuses another ``data.tokenizer``).
    workers: read and tokenize in this many worker processes (0: in this
      process): files, and ``.jsonl`` files in byte ranges of at most 64 MiB,
      handed out in order; the shards are the same, byte for byte, and
      memory is bounded by ``2 × workers`` ranges' records.
    bad_records: ``skip`` (a malformed JSONL line is logged, the first 10
      of a file, and left out) or ``error`` (it stops the conversion,
      named), as ``data.bad_records``.
  """
  policy = BadRecords(bad_records, "bad_records")  # checks the name
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}.")
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    raise ValueError(f"workers must be 0 or more, got {workers!r}.")
  if workers and tokenizer is not None and not hasattr(tokenizer, "spec"):
    raise ValueError("workers need a tokenizer loaded from a spec (tokenizer.load), which a worker can load again.")
  inputs = list(inputs) if paths else inputs
  pool = None
  if paths and workers > 0:
    import multiprocessing

    spec = None if tokenizer is None else (tokenizer.spec, *_special_tokens(tokenizer))
    pool = multiprocessing.get_context("spawn").Pool(workers)
    tasks = [(*task, text_field, spec, bad_records) for task in _ranges(expand(inputs), workers)]
    records = _in_order(pool, tasks, workers)
  else:
    documents = (doc for path in expand(inputs) for doc in iter_text_file(path, text_field, policy)) if paths else \
        iter(inputs)
    records = _encoded(documents, tokenizer)
  try:
    shards = _write_shards(records, output, num_shards, tokenizer, inputs if paths else None)
    if policy.skipped:
      logging.warning("Skipped %d malformed JSONL line(s) (bad_records=skip).", policy.skipped)
    return shards
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
  convert_parser.add_argument("--bad_records", choices=("skip", "error"), default="skip",
                              help="a malformed JSONL line: skip it (logged; default) or stop")
  convert_parser.add_argument("--workers", type=int, default=0, help="worker processes reading and tokenizing files"
                              " and .jsonl byte ranges at once (default 0: this process); the shards are the same")
  args = parser.parse_args(argv)
  try:
    tokenizer = None
    if args.tokenizer:
      from distrib_train.data import tokenizer as tokenizer_lib

      tokenizer = tokenizer_lib.load(args.tokenizer, args.bos_token, args.eos_token)
    paths = convert(args.inputs, args.output, num_shards=args.shards, text_field=args.text_field,
                    tokenizer=tokenizer, workers=args.workers, bad_records=args.bad_records)
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
  print("\n".join(paths))
