"""ArrayRecord shards, grain's native random-access format: writing them, and what a reader checks of them.

``write_array_record`` (also ``python -m distrib_train.data convert IN [IN ...]
OUT``) streams text, JSONL or Parquet files into shards, one record per
document: UTF-8 text, or with a tokenizer its int32 token ids and a
``{output}.tokenizer.json`` sidecar naming it; ``--workers N`` reads,
tokenizes and writes in N processes (``convert_workers.py``).
``pretokenized`` reads that sidecar back and ``check_readable`` opens a
shard, for ``sources.Documents``.

Not for: reading the text files themselves (``text_files.py``), making the
records and the worker processes (``convert_workers.py``), choosing a source
from the config (``sources.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from absl import logging

from distrib_train.data import convert_workers
from distrib_train.data.jsonl import BadRecords
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


def write_array_record(
  documents: Iterable[str] | str, output: str, *, num_shards: int = 1, bad_records: str = "skip"
) -> list[str]:
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
  return convert(
    [documents] if isinstance(documents, str) else documents,
    output,
    num_shards=num_shards,
    paths=isinstance(documents, str),
    bad_records=bad_records,
  )


def convert(
  inputs: Iterable[str],
  output: str,
  *,
  num_shards: int = 1,
  paths: bool = True,
  text_field: str = "text",
  tokenizer: Any = None,
  workers: int = 0,
  bad_records: str = "skip",
) -> list[str]:
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
      the records are its token ids (int32), tokenized once here, 256
      documents to a call, and ``{output}.tokenizer.json`` says which
      tokenizer; training from the shards skips tokenizing (and refuses
      another ``data.tokenizer``).
    workers: read, tokenize and write in this many worker processes (0: in
      this process; ``convert_workers.py``): any worker reads any of the
      tasks (a ``.jsonl`` file's 8 MiB byte ranges, any other file whole),
      worker ``k`` writes shards ``k, k + workers, …``; the shards are the
      same, byte for byte. This process then holds about ``2 × workers``
      8 MiB chunks of records, each worker one.
    bad_records: ``skip`` (a malformed JSONL line is logged, the first 10
      of a file in each process, and left out) or ``error`` (it stops the
      conversion, named), as ``data.bad_records``.
  """
  policy = BadRecords(bad_records, "bad_records")  # checks the name
  if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}.")
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    raise ValueError(f"workers must be 0 or more, got {workers!r}.")
  if workers and tokenizer is not None and not hasattr(tokenizer, "spec"):
    raise ValueError("workers need a tokenizer loaded from a spec (tokenizer.load), which a worker can load again.")
  inputs = list(inputs) if paths else inputs
  final = [f"{output}-{i:05d}-of-{num_shards:05d}.array_record" for i in range(num_shards)]
  partial = [f"{p}.partial" for p in final]
  nothing = ValueError("No documents to write" + (f" in {', '.join(inputs)}." if paths else "."))
  if paths and workers > 0:
    tasks = convert_workers.ranges(expand(inputs))
    _make_directory(output)
    settings = {
      "tokenizer": None if tokenizer is None else [tokenizer.spec, *_special_tokens(tokenizer)],
      "text_field": text_field,
      "bad_records": bad_records,
    }
    try:
      count, policy.skipped = convert_workers.write_in_workers(tasks, partial, workers, settings)
      if not count:
        raise nothing
    except BaseException:
      _remove(partial)
      raise
  else:
    documents = (
      (doc for path in expand(inputs) for doc in iter_text_file(path, text_field, policy)) if paths else iter(inputs)
    )
    _write_in_process(convert_workers.encoded(documents, tokenizer), output, partial, nothing)
  if policy.skipped:
    logging.warning("Skipped %d malformed JSONL line(s) (bad_records=skip).", policy.skipped)
  if tokenizer is not None:
    with open(f"{output}.tokenizer.json", "w", encoding="utf-8") as f:
      json.dump(tokenizer.fingerprint, f)
  for source, target in zip(partial, final):
    os.replace(source, target)
  return final + ([f"{output}.tokenizer.json"] if tokenizer is not None else [])


def _special_tokens(tokenizer: Any) -> tuple[str, str]:
  """The BOS / EOS token texts a loaded tokenizer was made with (for a worker to load it again)."""
  return tokenizer.bos_token, tokenizer.eos_token


def _make_directory(output: str) -> None:
  directory = os.path.dirname(output)
  if directory:
    os.makedirs(directory, exist_ok=True)


def _remove(paths: Sequence[str]) -> None:
  for path in paths:
    if os.path.exists(path):
      os.remove(path)


def _write_in_process(records: Iterator[bytes], output: str, partial: Sequence[str], nothing: ValueError) -> None:
  """Writes record ``i`` to ``partial[i % len(partial)]``; ``nothing`` is raised, before anything is made,
  when there are no records."""
  first = next(records, None)
  if first is None:
    raise nothing
  _make_directory(output)
  writers = [convert_workers.open_writer(p) for p in partial]
  try:
    for i, record in enumerate(itertools.chain([first], records)):
      writers[i % len(partial)].write(record)
    for writer in writers:
      writer.close()
  except BaseException:
    for writer in writers:
      writer.close()
    _remove(partial)
    raise


def main(argv: Sequence[str] | None = None) -> None:
  """``convert INPUT [INPUT ...] OUTPUT [--shards N]``: text or JSONL to ArrayRecord."""
  parser = argparse.ArgumentParser(prog="python -m distrib_train.data")
  sub = parser.add_subparsers(dest="command", required=True)
  convert_parser = sub.add_parser(
    "convert", help="write .txt / .jsonl files (paths or globs) as ArrayRecord shards, streaming"
  )
  convert_parser.add_argument("inputs", nargs="+", metavar="INPUT", help="a .txt or .jsonl file, or a glob")
  convert_parser.add_argument("output", help="path prefix of the shards (its directory is created)")
  convert_parser.add_argument("--shards", type=int, default=1)
  convert_parser.add_argument("--text_field", default="text", help="the JSONL field or Parquet column of the text")
  convert_parser.add_argument(
    "--tokenizer",
    help="tokenize once, writing token ids: bytes, hf:<tokenizer.json>, sentencepiece:<model>, tiktoken:<file>",
  )
  convert_parser.add_argument("--bos_token", default="", help="with --tokenizer: a token before every document")
  convert_parser.add_argument("--eos_token", default="", help="with --tokenizer: a token after every document")
  convert_parser.add_argument(
    "--bad_records",
    choices=("skip", "error"),
    default="skip",
    help="a malformed JSONL line: skip it (logged; default) or stop",
  )
  convert_parser.add_argument(
    "--workers",
    type=int,
    default=0,
    help="worker processes reading, tokenizing and writing at once (default 0: this process); the shards are the same",
  )
  args = parser.parse_args(argv)
  try:
    tokenizer = None
    if args.tokenizer:
      from distrib_train.data import tokenizer as tokenizer_lib

      tokenizer = tokenizer_lib.load(args.tokenizer, args.bos_token, args.eos_token)
    paths = convert(
      args.inputs,
      args.output,
      num_shards=args.shards,
      text_field=args.text_field,
      tokenizer=tokenizer,
      workers=args.workers,
      bad_records=args.bad_records,
    )
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
  print("\n".join(paths))
