"""Tokenizers named in the config: hf:, sentencepiece:, tiktoken: files (built here, never downloaded) and bytes."""

import base64
import dataclasses
import json
import pathlib

import numpy as np
import pytest
import sentencepiece as spm  # the test extra installs the three tokenizer libraries
import tiktoken  # noqa: F401
import tokenizers

import data_helpers
from distrib_train import data
from distrib_train.data import record_shards
from distrib_train.data import sources
from distrib_train.data import splits
from distrib_train.data import tokenizer as tokenizer_lib
from distrib_train.config import run as config_lib
from distrib_train.train.checks import TrainerSetupError
from distrib_train.train.trainer import Trainer

CACHE = ""


@pytest.fixture(autouse=True)
def _cache(xla_cache):
  global CACHE
  CACHE = xla_cache


def _mesh():
  import distrib_train as dt

  return dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "pydoc.txt"
  path.write_text("\n\n".join(sources._pydoc_documents()[:60]), encoding="utf-8")
  return path


@pytest.fixture(scope="module")
def hf_file(corpus, tmp_path_factory):
  """A 512-token byte-level BPE trained on part of the pydoc corpus, with <s> and </s>."""
  from tokenizers import models, pre_tokenizers, trainers, decoders

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train([str(corpus)], trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return path


@pytest.fixture(scope="module")
def sp_file(corpus, tmp_path_factory):
  prefix = tmp_path_factory.mktemp("sp") / "sp"
  spm.SentencePieceTrainer.train(
    input=str(corpus),
    model_prefix=str(prefix),
    vocab_size=300,
    model_type="bpe",
    bos_id=1,
    eos_id=2,
    unk_id=0,
    pad_id=-1,
    minloglevel=2,
  )
  return pathlib.Path(f"{prefix}.model")


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
  """Every byte, then a few merges, as tiktoken's ``base64-token rank`` lines."""
  tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"in", b" t", b"the", b" the"]
  path = tmp_path_factory.mktemp("tt") / "tiny.tiktoken"
  path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
  return path


TEXT = "The value of the expression is the object it names."


def test_each_kind_encodes_as_its_own_library_does(hf_file, sp_file, tiktoken_file):
  hf = tokenizer_lib.load(f"hf:{hf_file}")
  assert hf(TEXT) == tokenizers.Tokenizer.from_file(str(hf_file)).encode(TEXT, add_special_tokens=False).ids
  assert hf.vocab_size == 512 and hf.bos_id is None and len(hf.sha256) == 64
  sp = tokenizer_lib.load(f"sentencepiece:{sp_file}", "<s>", "</s>")
  assert sp(TEXT) == [1] + spm.SentencePieceProcessor(model_file=str(sp_file)).encode(TEXT) + [2]
  tt = tokenizer_lib.load(f"tiktoken:{tiktoken_file}")
  ids = tt(TEXT)
  assert tt.vocab_size == 262 and 261 in ids  # " the" merged
  assert b"".join(tiktoken_bytes(tiktoken_file)[i] for i in ids).decode() == TEXT
  assert tokenizer_lib.load("bytes")(TEXT) == list(TEXT.encode())
  # a model's directory, as from_pretrained takes it: its tokenizer.json
  by_directory = tokenizer_lib.load(f"hf:{hf_file.parent}")
  assert by_directory(TEXT) == hf(TEXT) and by_directory.sha256 == hf.sha256


def test_each_kind_decodes_as_its_own_library_does(hf_file, sp_file, tiktoken_file):
  """One tokenizer for training and generation: every kind decodes, special tokens left out."""
  hf, library = tokenizer_lib.load(f"hf:{hf_file}"), tokenizers.Tokenizer.from_file(str(hf_file))
  ids = hf.encode(TEXT)
  assert hf.decode(ids) == library.decode(ids, skip_special_tokens=True) == TEXT
  assert hf.encode(TEXT, special=True) == library.encode(TEXT, add_special_tokens=True).ids
  assert hf.decode([1, *ids, 2]) == TEXT  # <s> and </s> left out
  sp, processor = (
    tokenizer_lib.load(f"sentencepiece:{sp_file}", "<s>", "</s>"),
    spm.SentencePieceProcessor(model_file=str(sp_file)),
  )
  assert sp.decode(sp(TEXT)) == processor.decode(processor.encode(TEXT)) == TEXT  # BOS and EOS decode to nothing
  assert sp.encode(TEXT, special=True) == processor.encode(TEXT)  # a bare model file declares no specials
  tt = tokenizer_lib.load(f"tiktoken:{tiktoken_file}")
  assert tt.decode(tt(TEXT)) == TEXT and tt.decode([*tt(TEXT), 10_000]) == TEXT  # beyond the vocabulary: left out
  assert tokenizer_lib.load("bytes").decode(list("ünï".encode()) + [300]) == "ünï"


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken"])
def test_generation_encodes_and_decodes_with_the_runs_tokenizer_of_any_kind(kind, sp_file, tiktoken_file):
  """``distrib-train generate`` and lm-eval's model read a run's ``data.tokenizer`` of any kind."""
  import types

  from distrib_train.inference import text

  spec = f"sentencepiece:{sp_file}" if kind == "sentencepiece" else f"tiktoken:{tiktoken_file}"
  bos = "<s>" if kind == "sentencepiece" else ""
  data_config = types.SimpleNamespace(tokenizer=spec, bos_token=bos, eos_token="")
  codec = text.codec_for(types.SimpleNamespace(config=types.SimpleNamespace(data=data_config), hf_dir=None))
  ids = text.prompt_ids(codec, {"prompt": TEXT}, "prompts.jsonl:1")
  plain = tokenizer_lib.load(spec)(TEXT)
  assert ids == ([1] if bos else []) + plain  # the run's BOS before the text, as its documents had it
  assert codec.decode(ids) == TEXT
  assert text.truncate_at_stop(codec, plain, ["value"])[0] == TEXT[: TEXT.index("value")]


def test_a_batch_encodes_as_one_by_one_with_bos_and_eos(hf_file, sp_file, tiktoken_file):
  texts = [TEXT, "", "ünïcode and the value", TEXT * 3]
  for spec, bos, eos in (
    (f"hf:{hf_file}", "<s>", "</s>"),
    (f"sentencepiece:{sp_file}", "", "</s>"),
    (f"tiktoken:{tiktoken_file}", "", ""),
    ("bytes", "", ""),
  ):
    tok = tokenizer_lib.load(spec, bos, eos)
    batch = tok.encode_batch(texts)
    assert [ids.tolist() for ids in batch] == [tok(t) for t in texts], spec
    assert all(ids.dtype == np.int32 for ids in batch) and tok.encode_batch([]) == []


def _long_texts():
  """Documents whose first ids a prefix must give: prose of many KB, one long word, no spaces at all (CJK), a run
  of one letter that BPE merges into long tokens (few tokens per character: the first prefix is too short)."""
  prose = "\n\n".join(sources._pydoc_documents()[60:90])
  return [
    prose,
    "x" * 20_000 + " tail",
    "価値と式の名前" * 3_000,
    "a" * 60_000,
    TEXT,
    "",
    "ünïcode and the value",
    "word " * 5_000,
  ]


@pytest.mark.parametrize("chars_per_token", [tokenizer_lib.HEAD_CHARS_PER_TOKEN, 1])  # 1: prefixes too short
def test_heads_are_each_documents_first_ids_from_a_prefix_of_its_text(
  chars_per_token, hf_file, sp_file, tiktoken_file, monkeypatch
):
  """Without packing a sequence is a document's head: ``encode_heads`` gives the first ``count`` ids of what the
  whole text encodes to, BOS included, EOS where the document is that short, encoding only a prefix of a long
  text (again, longer, where the first held too few tokens)."""
  monkeypatch.setattr(tokenizer_lib, "HEAD_CHARS_PER_TOKEN", chars_per_token)
  texts = _long_texts()
  for spec, bos, eos in (
    (f"hf:{hf_file}", "<s>", "</s>"),
    (f"sentencepiece:{sp_file}", "", "</s>"),
    (f"tiktoken:{tiktoken_file}", "", ""),
    ("bytes", "", ""),
  ):
    tok = tokenizer_lib.load(spec, bos, eos)
    whole = tok.encode_batch(texts)
    for count in (1, 7, 64, 300, 2_000):
      heads = tok.encode_heads(texts, count)
      assert [h.tolist() for h in heads] == [w[:count].tolist() for w in whole], (spec, count)
    encoded = []
    spy = lambda batch: (encoded.extend(batch), tok.encode_texts(batch))[1]
    dataclasses.replace(tok, encode_texts=spy).encode_heads([texts[0]], 64)
    assert sum(map(len, encoded)) < len(texts[0]) / 10, spec  # 64 tokens of a 100 KB text: a prefix


def _save(tok, path):
  tok.save(str(path))
  return f"hf:{path}"


def test_tokenizers_that_segment_a_run_as_a_whole_encode_heads_from_whole_texts(tmp_path):
  """A Unigram model splits a long run of ``=`` by where it ends, and WordPiece makes a word over 100 characters
  one unknown token: for them (and SentencePiece's default, Unigram) ``encode_heads`` encodes texts whole, so a
  head is still the whole encoding's, and a document a prefix would have made long enough is still skipped."""
  from tokenizers import models

  unigram = tokenizers.Tokenizer(
    models.Unigram([("<unk>", 0.0), ("▁", -2.0), ("=", -3.0), ("==", -1.0), ("▁=", -1.0)], unk_id=0)
  )
  unigram.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
  vocab = {"[UNK]": 0, "abcdefghijklmnopqrst": 1}
  for c in "abcdefghijklmnopqrstuvwxyz":
    vocab[c], vocab[f"##{c}"] = len(vocab), len(vocab) + 1
  wordpiece = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
  wordpiece.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
  prefix = tmp_path / "uni"  # SentencePiece's default model type
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(sources._pydoc_documents()[:60]), model_prefix=str(prefix), vocab_size=300, minloglevel=2
  )
  cases = [
    (_save(unigram, tmp_path / "unigram.json"), "=" * 5001, 4),  # a prefix gives [1, 3, 3, 3]
    (
      _save(wordpiece, tmp_path / "wordpiece.json"),  # a prefix gives 64 pieces of the long word
      "abcdefghijklmnopqrst\t" * 31 + "\t" * 18 + "q" * 150,
      64,
    ),
    (f"sentencepiece:{prefix}.model", "=" * 40_001, 64),
  ]
  for spec, text, count in cases:
    tok = tokenizer_lib.load(spec)
    assert not tok.by_prefix, spec
    assert tok.encode_heads([text], count)[0].tolist() == tok.encode_batch([text])[0][:count].tolist(), spec


def test_a_tokenizer_files_truncation_and_padding_do_not_cut_or_pad_documents(hf_file, tmp_path):
  tok = tokenizers.Tokenizer.from_file(str(hf_file))
  tok.enable_truncation(8, direction="left")
  tok.enable_padding(length=32, pad_id=0)
  spec = _save(tok, tmp_path / "truncating.json")
  ids = tokenizer_lib.load(f"hf:{hf_file}")(TEXT * 4)
  loaded = tokenizer_lib.load(spec, "<s>")
  assert len(ids) > 32 and loaded(TEXT * 4) == [1] + ids
  assert loaded.encode_batch([TEXT * 4, "the"])[0].tolist() == [1] + ids
  assert loaded.encode_batch(["the"])[0].tolist() == [1] + tokenizer_lib.load(f"hf:{hf_file}")("the")
  assert [h.tolist() for h in loaded.encode_heads([TEXT * 400], 5)] == [[1] + ids[:4]]
  assert [h.tolist() for h in loaded.encode_heads([TEXT * 400, ""], 0)] == [[], []]  # no room even for BOS
  assert [h.tolist() for h in loaded.encode_heads([TEXT * 400], 1)] == [[1]]


def test_document_heads_of_bytes_arrays_and_skipped_documents():
  plain = splits.DocumentTokenizer(data.DataConfig(tokenizer="bytes"))
  docs = ["ünïcödé " * 300, "ab", None, np.arange(5, dtype=np.int32), "ü" * 30]
  want = [ids[:50] for ids in plain.batch(docs)]
  assert [h.tolist() for h in plain.heads(docs, 50)] == [w.tolist() for w in want]


def test_unpacked_rows_are_the_same_whether_a_prefix_or_the_whole_text_is_tokenized(hf_file, tmp_path, monkeypatch):
  """Training lanes and a finite pass over documents of many KB, short ones among them (skipped): the rows made
  from documents' heads are those made, as before, from every text encoded whole."""
  corpus = tmp_path / "long.jsonl"
  texts = _long_texts() + [f"Short {i}." for i in range(5)] + sources._pydoc_documents()[:40]
  corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  config = data.DataConfig(
    source="text",
    paths=(str(corpus),),
    seq_len=63,
    global_batch_size=8,
    packing=False,
    eval_fraction=0.0,
    tokenizer=f"hf:{hf_file}",
    bos_token="<s>",
    eos_token="</s>",
  )
  rows, counts = [], []
  real = tokenizer_lib.Tokenizer.encode_heads
  monkeypatch.setattr(
    tokenizer_lib.Tokenizer,
    "encode_heads",
    lambda self, texts, count: (counts.append(count), real(self, texts, count))[1],
  )
  for heads in (True, False):
    if not heads:  # every document encoded whole, then cut
      assert set(counts) == {64}, counts  # the readers asked for heads of a row's 63 + 1 tokens
      monkeypatch.setattr(
        splits.DocumentTokenizer, "heads", lambda self, docs, count: [ids[:count] for ids in self.batch(docs)]
      )
    got = []
    for epochs in (None, 1):  # the training lanes, and a finite pass (grain's, as evaluation reads)
      loader = data.DataLoader(config, data_helpers.shardings(_mesh()), vocab_size=512, num_epochs=epochs)
      got += [loader.next_local()["tokens"] for _ in range(2 if epochs else 6)]
      loader.close()
    rows.append(np.stack(got))
  np.testing.assert_array_equal(rows[0], rows[1])


def test_tokenizing_worker_processes_share_the_hosts_cores_unless_the_user_set_the_threads(monkeypatch):
  monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
  monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
  monkeypatch.setattr(tokenizer_lib.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
  assert tokenizer_lib.worker_thread_env(12) == {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
  assert tokenizer_lib.worker_thread_env(4) == {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "4"}
  monkeypatch.setenv("RAYON_NUM_THREADS", "3")
  assert tokenizer_lib.worker_thread_env(12)["RAYON_NUM_THREADS"] == "3"
  for unset in ("0", "", "many", "-2"):  # as Rayon reads them: its default, here the host's share
    monkeypatch.setenv("RAYON_NUM_THREADS", unset)
    assert tokenizer_lib.worker_thread_env(4)["RAYON_NUM_THREADS"] == "4", unset
  monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
  assert tokenizer_lib.worker_thread_env(4)["TOKENIZERS_PARALLELISM"] == "false"


def tiktoken_bytes(path):
  return {int(rank): base64.b64decode(token) for token, rank in (line.split() for line in open(path))}


def test_bos_and_eos_surround_every_packed_document(hf_file, tmp_path):
  short = tmp_path / "short.jsonl"
  short.write_text(
    "".join(json.dumps({"text": f"Document {i} says {'the value ' * (i % 5)}once."}) + "\n" for i in range(200))
  )
  config = data.DataConfig(
    source="text",
    paths=(str(short),),
    seq_len=64,
    global_batch_size=8,
    tokenizer=f"hf:{hf_file}",
    bos_token="<s>",
    eos_token="</s>",
  )
  loader = data.DataLoader(config, data_helpers.shardings(_mesh()), vocab_size=512)
  batch = loader.next_local()
  loader.close()
  bos, eos = 1, 2
  for tokens, targets, segments in zip(batch["tokens"], batch["targets"], batch["segment_ids"]):
    starts = [i for i in range(1, len(segments)) if segments[i] != segments[i - 1] and segments[i] > 0]
    assert starts and all(tokens[i] == bos for i in starts)  # every document that starts inside a row: <s> first
    assert all(tokens[i - 1] == eos for i in starts)  # … after the previous one's </s>
  real = batch["tokens"][batch["segment_ids"] > 0]
  assert real.max() < 512 and real.min() >= 0


@pytest.mark.parametrize(
  "spec, extra, message",
  [
    ("gpt2", {}, "'gpt2' is not a tokenizer; use bytes, hf:"),
    ("hf:/nowhere/tokenizer.json", {}, "tokenizer file '/nowhere/tokenizer.json' does not exist"),
    ("HF", {"eos_token": "<eos>"}, "data.eos_token: '<eos>' is not a token of hf:"),
    ("bytes", {"bos_token": "<s>"}, "data.bos_token: '<s>' is not a token of bytes"),
  ],
)
def test_bad_tokenizer_settings_are_named(spec, extra, message, hf_file):
  spec = f"hf:{hf_file}" if spec == "HF" else spec
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    config = data.DataConfig(tokenizer=spec, **extra)
    tokenizer_lib.load(config.tokenizer, config.bos_token, config.eos_token)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_reading(hf_file):
  config = data.DataConfig(seq_len=32, global_batch_size=8, tokenizer=f"hf:{hf_file}")
  with pytest.raises(ValueError, match=r"has 512 ids but the model's vocabulary holds 256; set model.vocab_size=512"):
    data.DataLoader(config, data_helpers.shardings(_mesh()), vocab_size=256)


def test_the_config_names_a_tokenizer_from_yaml_or_set_and_records_it(hf_file, tmp_path):
  config = config_lib.load("tiny", [f"data.tokenizer=hf:{hf_file}", "data.eos_token=</s>"])
  assert config.data.tokenizer == f"hf:{hf_file}"
  assert config.to_dict()["data"]["tokenizer"] == f"hf:{hf_file}"
  (tmp_path / "run.yaml").write_text(config.to_yaml())
  assert config_lib.load(str(tmp_path / "run.yaml")).data == config.data
  with pytest.raises(ValueError, match="does not exist"):
    config_lib.load("tiny", ["data.tokenizer=sentencepiece:/missing.model"])


def _run_config(workdir_tokenizer, *overrides):
  return config_lib.load(
    "tiny",
    [
      "data.seq_len=32",
      "data.global_batch_size=8",
      "train.steps=2",
      "train.log_every=1",
      "train.eval_every=0",
      "train.checkpoint_every=2",
      "train.async_checkpoint=false",
      f"train.compilation_cache_dir={CACHE}",
      f"data.tokenizer={workdir_tokenizer}",
      *overrides,
    ],
  )


def _tree(path):
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_a_run_records_its_tokenizer_and_a_resume_with_another_is_refused(hf_file, tmp_path):
  workdir = tmp_path / "run"
  config = _run_config(f"hf:{hf_file}", "model.vocab_size=512", "data.eos_token=</s>")
  assert Trainer(config, workdir, console=False).run().status == "finished"
  assert f"tokenizer: hf:{hf_file}" in (workdir / "config.yaml").read_text()
  meta = json.loads((workdir / "checkpoints" / "2" / "meta" / "metadata").read_text())
  assert meta["run"]["tokenizer"]["spec"] == f"hf:{hf_file}" and meta["run"]["tokenizer"]["eos_id"] == 2
  before = _tree(workdir)
  for other in ("bytes", f"hf:{hf_file}"):  # another tokenizer; the same one without its EOS
    overrides = ["model.vocab_size=512", "train.steps=4"]
    with pytest.raises(TrainerSetupError, match=r"was trained with tokenizer hf:.*this run names"):
      Trainer(_run_config(other, *overrides), workdir, console=False).run()
  assert _tree(workdir) == before  # refused before anything was written
  resumed = Trainer(
    _run_config(f"hf:{hf_file}", "model.vocab_size=512", "data.eos_token=</s>", "train.steps=4"), workdir, console=False
  ).run()
  assert resumed.status == "finished" and resumed.step == 4


def test_pretokenized_shards_hold_the_tokenizers_ids_and_refuse_another_tokenizer(hf_file, tmp_path):
  import grain

  corpus = tmp_path / "docs.jsonl"
  texts = [f"Record {i}: {'the value ' * (i % 7)}ends." for i in range(120)]
  corpus.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
  record_shards.main(
    [
      "convert",
      str(corpus),
      str(tmp_path / "tok" / "corpus"),
      "--shards",
      "3",
      "--text_field",
      "body",
      "--tokenizer",
      f"hf:{hf_file}",
      "--eos_token",
      "</s>",
    ]
  )
  assert json.loads((tmp_path / "tok" / "corpus.tokenizer.json").read_text())["eos_id"] == 2
  shards = sorted(str(p) for p in (tmp_path / "tok").glob("corpus-*.array_record"))
  tok = tokenizer_lib.load(f"hf:{hf_file}", "", "</s>")
  records = grain.sources.ArrayRecordDataSource(shards)
  by_shard = [texts[k::3] for k in range(3)]  # documents go round-robin over the shards
  expected = [tok(t) for shard in by_shard for t in shard]
  assert [np.frombuffer(records[i], np.int32).tolist() for i in range(len(records))] == expected
  # Two files tokenized by 2 worker processes: the same records as in this process.
  half = tmp_path / "half.jsonl"
  half.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts[:50]))
  for workers in ("0", "2"):
    record_shards.main(
      [
        "convert",
        str(corpus),
        str(half),
        str(tmp_path / f"w{workers}" / "c"),
        "--shards",
        "2",
        "--text_field",
        "body",
        "--tokenizer",
        f"hf:{hf_file}",
        "--eos_token",
        "</s>",
        "--workers",
        workers,
      ]
    )
  read = lambda d: [bytes(r) for r in grain.sources.ArrayRecordDataSource(sorted(str(p) for p in d.glob("c-*")))]
  assert read(tmp_path / "w0") == read(tmp_path / "w2") and len(read(tmp_path / "w2")) == 170
  common = dict(
    source="text",
    paths=(str(tmp_path / "tok" / "corpus-*.array_record"),),
    seq_len=32,
    global_batch_size=8,
    eval_fraction=0.0,
  )
  shardings = data_helpers.shardings(_mesh())
  loader = data.DataLoader(
    data.DataConfig(tokenizer=f"hf:{hf_file}", eos_token="</s>", **common), shardings, vocab_size=512
  )
  tokens = loader.next_local()["tokens"]
  loader.close()
  assert tokens.max() < 512 and (tokens == 2).any()  # the shards' ids, </s> between documents
  with pytest.raises(ValueError, match=r"shards hold token ids of tokenizer hf:.*data.tokenizer says bytes"):
    data.DataLoader(data.DataConfig(**common), shardings)
