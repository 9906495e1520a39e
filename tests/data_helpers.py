"""Corpora and shardings for the data tests (also used by their workers)."""

import json
import pathlib

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import distrib_train as dt

INPUTS = ("tokens", "targets", "segment_ids", "positions", "weights")


def write_corpus(directory, documents=64):
  """A JSONL corpus whose documents start with their own id: 'doc 0042 …'."""
  path = pathlib.Path(directory) / "corpus.jsonl"
  with open(path, "w") as f:
    for i in range(documents):
      f.write(json.dumps({"text": f"doc {i:04d} " + "lorem ipsum dolor sit amet " * (1 + i % 5)}) + "\n")
  return str(path)


def write_documents(directory, lengths, seed=0):
  """A JSONL corpus of random-letter documents of the given lengths. With
  byte-level tokens a document of n letters is n tokens, and only its first
  letter is upper case: a packed row starts a document where it starts with
  a capital."""
  import string

  import numpy as np

  rng = np.random.default_rng(seed)
  lower = np.array(list(string.ascii_lowercase))
  path = pathlib.Path(directory) / "documents.jsonl"
  with open(path, "w") as f:
    for n in lengths:
      text = "".join(rng.choice(lower, size=n))
      f.write(json.dumps({"text": text[:1].upper() + text[1:]}) + "\n")
  return str(path)


def shardings(mesh, batch_axes=("data", "fsdp")):
  sharding = NamedSharding(mesh, P(batch_axes, None))
  return {name: sharding for name in INPUTS}


def doc_ids(tokens):
  """The 'doc NNNN' ids at the start of each row."""
  return [bytes(row[:8].astype("uint8")).decode() for row in tokens]


def mesh_from(config_path):
  return dt.build_mesh(dt.MeshConfig.from_yaml(config_path))


def first_local_rows(array):
  """This process's rows of a global batch, in order."""
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
  seen, rows = set(), []
  for shard in shards:
    key = (shard.index[0].start, shard.index[0].stop)
    if key not in seen:
      seen.add(key)
      rows.append(jax.device_get(shard.data))
  import numpy as np

  return np.concatenate(rows)
