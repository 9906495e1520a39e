"""Input pipeline speed per corpus format: opening a corpus (its index built, then reused) and training tokens/s.

Run from the repository root:

  python bench/data_bench.py [--sizes 100MB,1GB,10GB] [--dir /tmp/distrib_train_data_bench]
      [--tokenizer hf:/path/tokenizer.json] [--seconds 5] [--seq_len 1024] [--batch 32] [--json out.json]
      [--convert_workers 0,1,2 [--convert_shards 4]]

For each size, a corpus of text documents (pydoc paragraphs drawn at random,
300 B to 12 KB each, every one numbered) is written once under ``--dir`` in
each format: ``.jsonl``, ``.parquet`` (row groups of 20,000 rows, pyarrow),
``.jsonl.zst`` (zstandard), ``.jsonl.gz``, a ``datasets`` directory
(``Dataset.save_to_disk``) and pre-tokenized ``.array_record`` shards
(``convert --tokenizer``, one set per tokenizer). Then, through the public
config (``DataConfig(source="text", paths=(...))``) on a 1-device mesh, it
times the first open (``DataLoader`` construction with its index built in an
emptied ``data.index_cache_dir``), the second open (the index reused) and
the shuffled, packed training tokens/s of ``DataLoader.next_local``, with
the byte tokenizer and with ``--tokenizer``, with the CPU the reading took:
the training process's per batch, and the worker processes' (``--num_workers``)
per million tokens, so that a rate below the cores' shows whether the
workers were slow or idle. A format no reader of this
checkout reads (its documents not all found) is skipped with a line saying so.
``--convert_workers`` also times ``convert`` of the JSONL with each of
those worker counts, to text records and with ``--tokenizer``, in MB/s of
text (the documents' UTF-8 bytes, 10^6 a MB); ``--formats ''`` times only that.

Not for: the trainer's data wait beside its step (``trainer_loop.py``), GPU throughput (``train_throughput.py``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

FORMATS = ("jsonl", "parquet", "jsonl.zst", "jsonl.gz", "datasets", "array_record")
ROW_GROUP = 20_000


def parse_size(text: str) -> int:
  """``100MB`` / ``1GB`` / ``5MB`` / ``300KB`` → bytes."""
  units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
  for unit, scale in units.items():
    if text.upper().endswith(unit):
      return int(float(text[:-2]) * scale)
  return int(text)


def documents(size: int, seed: int = 0):
  """Texts of pydoc paragraphs, about ``size`` bytes of them in all, in a seeded order."""
  from pydoc_data import topics

  paragraphs = [p for topic in topics.topics.values() for p in topic.split("\n\n") if p.strip()]
  rng = np.random.default_rng(seed)
  written, number = 0, 0
  while written < size:
    target = int(rng.integers(300, 12_000))
    picks = rng.integers(0, len(paragraphs), size=max(1, target // 300))
    text = f"Document {number}.\n\n" + "\n\n".join(paragraphs[i] for i in picks)[:target]
    written, number = written + len(text.encode()), number + 1
    yield text


def write_corpus(directory: str, size: int, formats, tokenizers) -> tuple[dict[str, list[str]], int]:
  """The corpus in every format (written once, reused), and its document count."""
  os.makedirs(directory, exist_ok=True)
  base = os.path.join(directory, "corpus")
  done = os.path.join(directory, "written.json")
  made = json.load(open(done)) if os.path.exists(done) else {}
  if "jsonl" not in made:
    with open(base + ".jsonl", "w", encoding="utf-8") as f:
      made["count"] = sum(f.write(json.dumps({"text": t}) + "\n") > 0 for t in documents(size))
    made["jsonl"] = [base + ".jsonl"]
  lines = lambda: open(base + ".jsonl", "rb")
  for fmt in formats:
    if fmt in ("jsonl", "array_record") or fmt in made:
      continue
    started = time.perf_counter()
    made[fmt] = write_format(fmt, base, lines)
    print(f"  wrote {fmt} in {time.perf_counter() - started:.1f} s", flush=True)
    json.dump(made, open(done, "w"))
  if "array_record" in formats:
    from distrib_train.data import record_shards
    from distrib_train.data import tokenizer as tokenizer_lib

    for spec in tokenizers:
      key = f"array_record/{spec}"
      if key not in made:
        started = time.perf_counter()
        prefix = os.path.join(directory, f"tokens-{len(made)}", "corpus")
        shards = max(1, size // (256 << 20))
        workers = (os.cpu_count() or 1) if size >= 64 << 20 else 0  # a worker takes ~0.3 s to start
        made[key] = [
          p
          for p in record_shards.convert(
            made["jsonl"], prefix, num_shards=shards, tokenizer=tokenizer_lib.load(spec), workers=workers
          )
          if p.endswith(".array_record")
        ]
        print(f"  converted ({spec}) in {time.perf_counter() - started:.1f} s", flush=True)
        json.dump(made, open(done, "w"))
  return made, made["count"]


def time_convert(directory: str, made: dict, tokenizers, worker_counts, shards: int) -> list[dict]:
  """MB/s of text of ``convert`` from the JSONL, with each worker count, to text records and with each tokenizer
  but ``bytes``."""
  from distrib_train.data import record_shards
  from distrib_train.data import tokenizer as tokenizer_lib

  with open(made["jsonl"][0], "rb") as f:  # counted here: the file is then in the page cache for every run
    text_bytes = sum(len(json.loads(line)["text"].encode()) for line in f)
  rows = []
  for spec in [None] + [t for t in tokenizers if t != "bytes"]:
    tokenizer = None if spec is None else tokenizer_lib.load(spec)
    for workers in worker_counts:
      output = os.path.join(directory, "convert-timed")
      shutil.rmtree(output, ignore_errors=True)
      started = time.perf_counter()
      record_shards.convert(
        made["jsonl"], os.path.join(output, "c"), num_shards=shards, tokenizer=tokenizer, workers=workers
      )
      seconds = time.perf_counter() - started
      shutil.rmtree(output, ignore_errors=True)
      rows.append(
        {
          "tokenizer": "text" if spec is None else spec.split(":")[0],
          "workers": workers,
          "shards": shards,
          "seconds": seconds,
          "mb_per_s": text_bytes / seconds / 1e6,
        }
      )
      print(
        f"  convert {rows[-1]['tokenizer']:<5} --workers {workers} --shards {shards}: {seconds:6.2f} s"
        f" {rows[-1]['mb_per_s']:7.1f} MB/s of text",
        flush=True,
      )
  return rows


def write_format(fmt: str, base: str, lines) -> list[str]:
  """One format from the JSONL, streaming (``lines`` opens it)."""
  if fmt == "jsonl.zst":
    import zstandard

    with lines() as src, open(base + ".jsonl.zst", "wb") as out:
      zstandard.ZstdCompressor(level=3).copy_stream(src, out)
    return [base + ".jsonl.zst"]
  if fmt == "jsonl.gz":
    with lines() as src, gzip.open(base + ".jsonl.gz", "wb", compresslevel=1) as out:
      shutil.copyfileobj(src, out, 1 << 22)
    return [base + ".jsonl.gz"]
  texts = lambda: (json.loads(line)["text"] for line in lines())
  if fmt == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(base + ".parquet", pa.schema([("text", pa.string())])) as writer:
      batch = []
      for text in texts():
        batch.append(text)
        if len(batch) == ROW_GROUP:
          writer.write_table(pa.table({"text": batch}), row_group_size=ROW_GROUP)
          batch = []
      if batch:
        writer.write_table(pa.table({"text": batch}), row_group_size=ROW_GROUP)
    return [base + ".parquet"]
  if fmt == "datasets":
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_generator(lambda: ({"text": t} for t in texts())).save_to_disk(base + "_dataset")
    return [base + "_dataset"]
  raise ValueError(f"unknown format {fmt!r}")


def children_cpu_s() -> float | None:
  """CPU seconds (user + system, all threads) of this process's live child processes, from ``/proc``; None
  where that cannot be read (not Linux)."""
  try:
    me = f"/proc/{os.getpid()}/task"
    pids = set()
    for task in os.listdir(me):
      with open(f"{me}/{task}/children") as f:
        pids.update(f.read().split())
    ticks = 0
    for pid in pids:
      with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
      ticks += int(fields[11]) + int(fields[12])  # utime and stime: fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return None


def measure(paths, count: int, tokenizer: str, args, cache_dir: str) -> dict:
  """First open, second open and training tokens/s of one format with one tokenizer."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from distrib_train import data

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  shardings = {
    k: NamedSharding(mesh, P("data", None)) for k in ("tokens", "targets", "segment_ids", "positions", "weights")
  }
  config = data.DataConfig(
    source="text",
    paths=tuple(paths),
    tokenizer=tokenizer,
    seq_len=args.seq_len,
    global_batch_size=args.batch,
    eval_fraction=0.0,
    index_cache_dir=cache_dir,
    num_workers=args.num_workers,
  )
  shutil.rmtree(cache_dir, ignore_errors=True)
  try:  # the formats another reader of this checkout may not know yet: are all their documents found?
    found = len(data.Documents(config)) if paths[0].endswith((".zst", ".gz", "_dataset")) else count
  except ValueError as e:
    return {"skipped": f"no reader for it in this checkout ({str(e)[:120]})"}
  if found != count:
    return {"skipped": f"read as {found} document(s), not {count}: no reader for this format in this checkout"}
  shutil.rmtree(cache_dir, ignore_errors=True)
  opens = []
  for _ in range(2):
    started = time.perf_counter()
    loader = data.DataLoader(config, shardings)
    opens.append(time.perf_counter() - started)
    if len(opens) == 1:
      loader.close()
  loader.next_local()  # warm up: workers started, read-ahead filled
  batches, started, cpu, workers_cpu = 0, time.perf_counter(), time.process_time(), children_cpu_s()
  while time.perf_counter() - started < args.seconds:
    loader.next_local()
    batches += 1
  tokens = batches * args.batch * args.seq_len
  rate = tokens / (time.perf_counter() - started)
  cpu = time.process_time() - cpu
  after = children_cpu_s()
  loader.close()
  return {
    "first_open_s": opens[0],
    "second_open_s": opens[1],
    "tokens_per_s": rate,
    "main_cpu_ms_per_batch": 1e3 * cpu / max(1, batches),
    "workers_cpu_s_per_m_tokens": (after - workers_cpu) / tokens * 1e6
    if args.num_workers and after is not None and workers_cpu is not None
    else None,
  }


def _figure(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="100MB", help="comma-separated corpus sizes: 100MB,1GB,10GB")
  parser.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "distrib_train_data_bench"))
  parser.add_argument("--formats", default=",".join(FORMATS))
  parser.add_argument("--tokenizer", default="", help="a second tokenizer to time beside bytes (hf:<tokenizer.json>)")
  parser.add_argument("--seconds", type=float, default=5.0)
  parser.add_argument("--seq_len", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--num_workers", type=int, default=0, help="data.num_workers")
  parser.add_argument("--json", default="", help="write the rows here")
  parser.add_argument("--convert_workers", default="", help="also time convert with these worker counts: 0,1,2")
  parser.add_argument("--convert_shards", type=int, default=1, help="with --convert_workers: --shards")
  args = parser.parse_args(argv)
  formats = [f for f in args.formats.split(",") if f]
  unknown = sorted(set(formats) - set(FORMATS))
  if unknown:
    parser.error(f"unknown formats {unknown}; known: {', '.join(FORMATS)}")
  tokenizers = ["bytes"] + ([args.tokenizer] if args.tokenizer else [])
  rows, converts = [], []
  print(
    f"{'size':>7} {'format':<13} {'tokenizer':<10} {'1st open s':>10} {'2nd open s':>10} {'M tokens/s':>10}"
    f"  {'CPU ms/batch':>12} {'workers CPU-s/M tokens':>22}"
  )
  for size_text in args.sizes.split(","):
    directory = os.path.join(args.dir, size_text)
    made, count = write_corpus(directory, parse_size(size_text), formats, tokenizers)
    if args.convert_workers:
      counts = [int(w) for w in args.convert_workers.split(",")]
      converts += [
        {"size": size_text, **row} for row in time_convert(directory, made, tokenizers, counts, args.convert_shards)
      ]
    for fmt in formats:
      for spec in tokenizers:
        paths = made[f"array_record/{spec}"] if fmt == "array_record" else made[fmt]
        found = measure(paths, count, spec, args, os.path.join(directory, "index-cache"))
        row = {"size": size_text, "format": fmt, "tokenizer": spec.split(":")[0], "documents": count, **found}
        rows.append(row)
        name = spec.split(":")[0]
        if "skipped" in found:
          print(f"{size_text:>7} {fmt:<13} {name:<10} skipped: {found['skipped']}", flush=True)
        else:
          print(
            f"{size_text:>7} {fmt:<13} {name:<10} {found['first_open_s']:>10.2f} {found['second_open_s']:>10.2f}"
            f" {found['tokens_per_s'] / 1e6:>10.3f}  {found['main_cpu_ms_per_batch']:>12.1f}"
            f" {_figure(found['workers_cpu_s_per_m_tokens']):>22}",
            flush=True,
          )
  result = {"seq_len": args.seq_len, "batch": args.batch, "cpus": os.cpu_count(), "rows": rows, "convert": converts}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
