"""Conversation records through the data pipeline: whole conversations packed or padded, weighted by the
chat template's loss mask, in every format the corpus reader takes; long ones cut or left out and counted."""

import dataclasses
import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from chat_helpers import LLAMA3, bpe_tokenizer, manual_conversations, texts_of, tokenizer_dir  # noqa: E402

from distrib_train import data  # noqa: E402
from distrib_train.data.chat import ChatEncoder, ChatTemplate  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("sft")
  records = manual_conversations()
  directory = tokenizer_dir(root / "tok", bpe_tokenizer(texts_of(records), 512), "llama3", LLAMA3)
  lines = "".join(json.dumps(r) + "\n" for r in records)
  (root / "chat.jsonl").write_text(lines)
  import zstandard

  (root / "chat.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
  import pyarrow as pa
  import pyarrow.parquet as pq

  only_messages = [r for r in records if "messages" in r]
  pq.write_table(
    pa.table({"messages": [r["messages"] for r in only_messages]}), root / "chat.parquet", row_group_size=8
  )
  import datasets

  datasets.Dataset.from_list(only_messages).save_to_disk(str(root / "chat_dataset"))
  return root, records, only_messages, str(directory / "tokenizer.json")


def _shardings(config):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  return {k: NamedSharding(mesh, PartitionSpec("data")) for k in data.DataLoader.batch_schema(config)}


def _encodings(records, tokenizer, loss_on="assistant"):
  encoder = ChatEncoder(ChatTemplate.load(tokenizer), tokenizers.Tokenizer.from_file(tokenizer), loss_on)
  out = {}
  for r in records:
    ids, mask = encoder.encode(r)
    out[tuple(ids.tolist())] = mask
  return out


def _segments(batch, want):
  """Each packed row's conversations as (ids, weights of their targets, mask), found in ``want``; and the
  padding's total weight. A conversation that ends the row has its last token as the row's last target."""
  found, padding = [], 0.0
  for tokens, targets, weights, segments in zip(
    batch["tokens"], batch["targets"], batch["weights"], batch["segment_ids"]
  ):
    padding += float(weights[segments == 0].sum())
    for s in np.unique(segments[segments > 0]):
      where = np.flatnonzero(segments == s)
      ids = tuple(tokens[where].tolist())
      if ids not in want:  # it ends the row: its last token is only a target
        ids = ids + (int(targets[where[-1]]),)
        assert ids in want, "a packed segment that is no whole conversation"
        found.append((ids, weights[where], want[ids][1:]))
      else:  # its last input predicts the next conversation's first token: weight 0
        found.append((ids, weights[where], np.append(want[ids][1:], False)))
  return found, padding


@pytest.mark.parametrize("name", ["chat.jsonl", "chat.jsonl.zst", "chat.parquet", "chat_dataset"])
def test_conversations_are_packed_whole_and_weighted_by_their_assistant_tokens(name, corpus):
  root, records, only_messages, tokenizer = corpus
  config = data.DataConfig(
    source="text",
    paths=(str(root / name),),
    tokenizer=f"hf:{tokenizer}",
    seq_len=512,
    global_batch_size=4,
    loss_on="assistant",
    eval_fraction=0.0,
  )
  want = _encodings(records if "jsonl" in name else only_messages, tokenizer)
  seen = 0
  with data.DataLoader(config, _shardings(config)) as loader:
    for _ in range(4):
      found, padding = _segments(loader.next_local(), want)
      assert padding == 0.0 and len(found) > 4  # several conversations a row
      for ids, weights, mask in found:  # each a whole conversation, as the template renders it
        # A target weighs 1 where the mask reads it.
        np.testing.assert_array_equal(weights, mask.astype(np.float32))
        seen += 1
    assert loader.long_conversations == 0
  assert seen > 8


def test_without_packing_a_row_is_one_conversation_padded(corpus):
  root, records, _, tokenizer = corpus
  config = data.DataConfig(
    source="text",
    paths=(str(root / "chat.jsonl"),),
    tokenizer=f"hf:{tokenizer}",
    seq_len=256,
    global_batch_size=4,
    loss_on="completion",
    packing=False,
    eval_fraction=0.0,
  )
  want = _encodings(records, tokenizer, "completion")
  with data.DataLoader(config, _shardings(config)) as loader:
    batch = loader.next_local()
  for tokens, targets, weights in zip(batch["tokens"], batch["targets"], batch["weights"]):
    ids = np.append(tokens, targets[-1])
    match = [key for key in want if ids[: len(key)].tolist() == list(key)]
    assert len(match) == 1
    n = len(match[0])
    np.testing.assert_array_equal(weights[: n - 1], want[match[0]][1:].astype(np.float32))
    assert not weights[n - 1 :].any()


@pytest.mark.parametrize("long", ["truncate", "drop"])
def test_long_conversations_are_cut_or_left_out_and_counted(long, corpus):
  root, records, _, tokenizer = corpus
  config = data.DataConfig(
    source="text",
    paths=(str(root / "chat.jsonl"),),
    tokenizer=f"hf:{tokenizer}",
    seq_len=184,
    global_batch_size=4,
    loss_on="all",
    long_conversations=long,
    eval_fraction=0.0,
  )
  full = _encodings(records, tokenizer, "all")
  want = {k: v for k, v in full.items() if len(k) <= 185}
  want.update({k[:185]: v[:185] for k, v in full.items() if len(k) > 185 and long == "truncate"})
  with data.DataLoader(config, _shardings(config)) as loader:
    found, _ = _segments(loader.next_local(), want)
    assert loader.long_conversations > 0
  assert found and all(len(ids) <= 185 for ids, _, _ in found)
  assert any(len(ids) == 185 for ids, _, _ in found) == (long == "truncate")
  # A finite pass reads each held-out conversation once: the count is exact (the split's own checks not in it).
  config = dataclasses.replace(config, eval_fraction=0.5)
  from distrib_train.data import splits

  docs, held_out, _ = splits.split_documents(config, "eval", 1, None)
  lengths = {len(k) for k in full}
  over = sum(
    len(
      ChatEncoder(ChatTemplate.load(tokenizer), tokenizers.Tokenizer.from_file(tokenizer), "all").encode(
        json.loads(docs[int(i)])
      )[0]
    )
    > 185
    for i in held_out
  )
  assert 0 < over < len(held_out) and lengths
  with data.DataLoader(config, _shardings(config), split="eval", num_epochs=1) as loader:
    for _ in iter(loader.next_local, None):
      pass
    assert loader.long_conversations == over


def test_the_eval_pass_reads_each_held_out_conversation_once(corpus):
  root, records, _, tokenizer = corpus
  config = data.DataConfig(
    source="text",
    paths=(str(root / "chat.jsonl"),),
    tokenizer=f"hf:{tokenizer}",
    seq_len=512,
    global_batch_size=4,
    loss_on="assistant",
    eval_fraction=0.25,
  )
  want = _encodings(records, tokenizer)
  seen = []
  with data.DataLoader(config, _shardings(config), split="eval", num_epochs=1) as loader:
    for batch in iter(loader.next_local, None):
      found, padding = _segments(batch, want)
      for ids, weights, mask in found:
        np.testing.assert_array_equal(weights, mask.astype(np.float32))
        seen.append(ids)
  assert len(seen) == len(set(seen)) == round(len(records) * 0.25)


def test_the_demo_corpus_as_conversations_through_the_bytes_tokenizers_chatml():
  config = data.DataConfig(source="pydoc", seq_len=2048, global_batch_size=2, loss_on="assistant")
  with data.DataLoader(config, _shardings(config)) as loader:
    batch = loader.next_local()
  text = bytes(batch["tokens"][0].astype(np.uint8)).decode("utf-8", "replace")
  assert text.startswith("<|im_start|>user\nExplain this part of the Python documentation: ")
  scored = bytes(batch["targets"][0][batch["weights"][0] > 0].astype(np.uint8)).decode("utf-8", "replace")
  assert "<|im_start|>" not in scored and "Explain this part" not in scored and "<|im_end|>" in scored


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(loss_on="answers"), "loss_on='answers'; choose assistant, completion or all"),
    (dict(chat_template="x.jinja"), "chat_template renders conversation records; set data.loss_on"),
    (dict(loss_on="assistant", source="synthetic"), "the synthetic source holds no conversations"),
    (dict(loss_on="assistant", eos_token="</s>", tokenizer="bytes"), "leave data.bos_token and data.eos_token empty"),
    (dict(loss_on="assistant", long_conversations="wrap"), "long_conversations='wrap'; choose truncate or drop"),
  ],
)
def test_bad_conversation_settings_are_refused_by_name(changes, message):
  with pytest.raises(ValueError, match=message):
    data.DataConfig(**changes)


def test_text_files_hold_no_conversations(tmp_path):
  (tmp_path / "notes.txt").write_text("plain text")
  config = data.DataConfig(source="text", paths=(str(tmp_path / "notes.txt"),), loss_on="assistant")
  with pytest.raises(ValueError, match="notes.txt' holds text, not conversation records"):
    data.DataLoader(config, _shardings(config))


def test_worker_processes_make_the_same_rows_and_count_long_conversations(corpus):
  root, _, _, tokenizer = corpus
  config = data.DataConfig(
    source="text",
    paths=(str(root / "chat.jsonl"),),
    tokenizer=f"hf:{tokenizer}",
    seq_len=184,
    global_batch_size=4,
    loss_on="assistant",
    eval_fraction=0.0,
  )
  batches = []
  for workers in (0, 1):
    with data.DataLoader(dataclasses.replace(config, num_workers=workers), _shardings(config)) as loader:
      batches.append([loader.next_local() for _ in range(3)])
      assert loader.long_conversations > 0
  for here, there in zip(*batches):
    assert sorted(here) == sorted(there)
    for name in here:
      np.testing.assert_array_equal(here[name], there[name])


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_row_takes_no_more_conversations_than_max_documents_per_row(split, corpus):
  """A conversation past the cap would weigh 0 (cuDNN's packed attention takes a fixed number a row): the row
  ends before it, and every conversation a row holds trains."""
  root, records, _, tokenizer = corpus
  config = data.DataConfig(
    source="text",
    paths=(str(root / "chat.jsonl"),),
    tokenizer=f"hf:{tokenizer}",
    seq_len=512,
    global_batch_size=4,
    loss_on="assistant",
    max_documents_per_row=1,
    eval_fraction=0.0 if split == "train" else 0.25,
  )
  want = _encodings(records, tokenizer)
  with data.DataLoader(config, _shardings(config), split=split, num_epochs=None if split == "train" else 1) as loader:
    batch = loader.next_local()
  found, padding = _segments(batch, want)
  assert padding == 0.0 and len(found) == 4  # one conversation a row, the rest padding
  for ids, weights, mask in found:
    np.testing.assert_array_equal(weights, mask.astype(np.float32))


def test_array_record_shards_hold_no_conversations(tmp_path):
  shard = tmp_path / "tokens-00000-of-00001.array_record"
  shard.write_bytes(b"")  # refused by its kind, before it is opened
  config = data.DataConfig(source="text", paths=(str(shard),), loss_on="assistant")
  with pytest.raises(ValueError, match="is an ArrayRecord shard, not conversation records"):
    data.DataLoader(config, _shardings(config))
