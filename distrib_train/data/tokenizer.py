"""Tokenizers named in the config: ``bytes``, ``hf:<tokenizer.json>``, ``sentencepiece:<model>``, ``tiktoken:<bpe>``.

``data.tokenizer`` names one (YAML or ``--set data.tokenizer=hf:/data/tok/tokenizer.json``);
``load(spec)`` reads it from a local file — nothing is ever downloaded — with
its own library, imported only then:

- ``bytes``: UTF-8 bytes, ids 0–255 (the default; no library).
- ``hf:<path>``: a Hugging Face ``tokenizer.json``, or a directory holding one (as ``from_pretrained``
  takes a model's directory) (``pip install tokenizers``).
- ``sentencepiece:<path>``: a SentencePiece ``.model`` (``pip install sentencepiece``).
- ``tiktoken:<path>``: a tiktoken BPE file of ``base64-token rank`` lines
  (``pip install tiktoken``); text is split with the cl100k pattern
  unless the spec names another after ``#`` (``tiktoken:o200k.tiktoken#o200k``).

``Tokenizer.encode_batch(texts)`` encodes many documents in one call, as
int32 arrays (the same ids as one by one): the Hugging Face library's
``encode_batch_fast`` (its Rust threads, in parallel; the ids without the
character offsets, which nothing here reads: 1.5 × the tokens a CPU-second
of ``encode_batch``), tiktoken's
``encode_ordinary_batch``, SentencePiece's list encode, and for ``bytes``
one UTF-8 buffer split with numpy. ``Tokenizer.encode_heads(texts, n)``
gives each text's first ``n`` ids from a prefix of it (the rows without
packing are documents' heads).

Special tokens: a document is encoded as plain text (no special tokens
added by the tokenizer itself, and no truncation or padding a
``tokenizer.json`` may set for a model's inputs); ``data.bos_token`` and ``data.eos_token`` name
tokens (their text, e.g. ``<s>``, ``</s>``, ``<|endoftext|>``) to put before
and after every document — with packing, the EOS is what separates documents
inside a sequence. Empty (the default): none. A name the vocabulary does not
hold is refused.

``Tokenizer.decode(ids)`` gives text back for every kind (generation's and
evaluation's, ``inference/text.py``), special tokens left out; ``Tokenizer.encode(text,
special=True)`` adds the tokenizer's own special tokens as transformers'
``tokenizer(text)`` does (a ``tokenizer.json``'s post-processor; a SentencePiece
model or a tiktoken file declares none).

``Tokenizer.fingerprint`` (the spec, a SHA-256 of the file, the vocabulary
size and the special ids) goes into ``config.yaml`` and every checkpoint's
metadata; a run that resumes with another tokenizer is refused.

Not for: reading documents (``sources.py``), batching (``pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from distrib_train.common import extras

KINDS = ("bytes", "hf", "sentencepiece", "tiktoken")
_PACKAGES = {"hf": "tokenizers", "sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}
# tiktoken's cl100k / o200k pre-tokenisation patterns are tiktoken's own; named here, not copied.
_TIKTOKEN_PATTERNS = ("cl100k_base", "o200k_base", "r50k_base", "p50k_base")


# ``Tokenizer.encode_heads``: the characters a prefix is first given per token wanted (about 4 on Python source
# or English through a 16k BPE: the guess errs long, a short one costs a second encode), and the tokens dropped
# before its cut.
HEAD_CHARS_PER_TOKEN = 6
HEAD_MARGIN = 64


def _cut(text: str, chars: int) -> int | None:
  """Where ``encode_heads`` cuts ``text`` for a prefix of about ``chars`` characters: at its last space or newline
  in the second half of them, else at ``chars``; None: the text is that short, encoded whole."""
  if len(text) <= chars:
    return None
  space = max(text.rfind(" ", chars // 2, chars), text.rfind("\n", chars // 2, chars))
  return space if space > 0 else chars


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A loaded tokenizer: ``tokenizer(text)`` → ids, with the document's BOS/EOS (``encode_batch``: many at once).

  Attributes:
    spec: what the config named (``hf:/path/tokenizer.json``).
    vocab_size: ids are in ``[0, vocab_size)``.
    bos_id, eos_id: added before / after every document (None: not added).
    sha256: of the tokenizer file (empty for ``bytes``).
    decode_ids: ids → text, special tokens left out (``decode``).
    encode_own: text → ids with the tokenizer's own special tokens (``encode(text, special=True)``).
    by_prefix: whether a prefix of a text encodes to a prefix of its ids, away from the cut (bytes, BPE:
      ``encode_heads`` encodes prefixes); a Unigram or WordPiece model segments a run of text as a whole (the
      split of a long run of ``=`` depends on where it ends; a word over WordPiece's length limit is one
      unknown token), so their texts are encoded whole.
  """

  spec: str
  vocab_size: int
  encode_text: Callable[[str], Sequence[int]] = dataclasses.field(repr=False, compare=False)
  token_id: Callable[[str], int | None] = dataclasses.field(repr=False, compare=False)
  bos_id: int | None = None
  eos_id: int | None = None
  sha256: str = ""
  bos_token: str = ""
  eos_token: str = ""
  encode_texts: Callable[[Sequence[str]], Sequence[Sequence[int]]] | None = dataclasses.field(
    default=None, repr=False, compare=False
  )
  by_prefix: bool = dataclasses.field(default=False, repr=False, compare=False)
  decode_ids: Callable[[Sequence[int]], str] | None = dataclasses.field(default=None, repr=False, compare=False)
  encode_own: Callable[[str], Sequence[int]] | None = dataclasses.field(default=None, repr=False, compare=False)

  def encode(self, text: str, special: bool = False) -> list[int]:
    """The text's ids alone (no document BOS or EOS); with ``special``, the tokenizer's own special tokens
    added as transformers' ``tokenizer(text)`` adds them."""
    return list(self.encode_own(text) if special and self.encode_own is not None else self.encode_text(text))

  def decode(self, ids: Sequence[int]) -> str:
    """The text of ``ids``, special tokens (and ids outside the vocabulary) left out."""
    if self.decode_ids is None:
      raise ValueError(f"tokenizer {self.spec} was built without a decoder (data/tokenizer.load builds one).")
    return self.decode_ids([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Each text's ids (int32), BOS and EOS as ``__call__`` adds them, encoded in one call."""
    encoded = self._plain(texts)
    if self.bos_id is None and self.eos_id is None:
      return encoded
    head, tail = self._specials()
    return [np.concatenate([head, ids, tail]) for ids in encoded]

  def encode_heads(self, texts: Sequence[str], count: int) -> list[np.ndarray]:
    """``[ids[:count] for ids in encode_batch(texts)]``, encoding only a prefix of each long text.

    A sequence without packing is the head of one document, so the rest of a long one need not be encoded
    (Python source through a 16k BPE, rows of 1025 tokens: 4 × fewer CPU-seconds). A text longer than
    ``(count + HEAD_MARGIN) × HEAD_CHARS_PER_TOKEN`` characters is cut at its last space or newline in the
    second half of those (else at their end), the prefix encoded and its last ``HEAD_MARGIN`` tokens dropped:
    with byte-level or BPE tokenizers a cut changes only the tokens of the words next to it. A prefix of too
    few tokens is tried again four times as long, up to the whole text. Where ``by_prefix`` is false
    (Unigram, WordPiece) every text is encoded whole.
    """
    if not self.by_prefix:
      return [ids[:count] for ids in self.encode_batch(texts)]
    head, tail = self._specials()
    out: list[np.ndarray | None] = [None] * len(texts)
    pending, chars = list(range(len(texts))), (count + HEAD_MARGIN) * HEAD_CHARS_PER_TOKEN
    while pending:
      cuts = [_cut(texts[i], chars) for i in pending]
      encoded = self._plain([texts[i] if cut is None else texts[i][:cut] for i, cut in zip(pending, cuts)])
      retry = []
      for i, cut, ids in zip(pending, cuts, encoded):
        if cut is None:
          out[i] = np.concatenate([head, ids, tail])[:count]
        elif len(head) + len(ids) - HEAD_MARGIN >= count:
          out[i] = np.concatenate([head, ids[: max(0, count - len(head))]])[:count]
        else:
          retry.append(i)
      pending, chars = retry, chars * 4
    return out  # type: ignore[return-value]

  def _plain(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Each text's own ids, no BOS or EOS, encoded in one call where the library has a batch encode."""
    if self.encode_texts is None:
      return [np.asarray(self.encode_text(t), np.int32) for t in texts]
    return [np.asarray(ids, np.int32) for ids in self.encode_texts(texts)] if texts else []

  def _specials(self) -> tuple[np.ndarray, np.ndarray]:
    """The ids put before and after every document (BOS, EOS; empty where there is none)."""
    return (
      np.asarray([] if self.bos_id is None else [self.bos_id], np.int32),
      np.asarray([] if self.eos_id is None else [self.eos_id], np.int32),
    )

  def __call__(self, text: str) -> list[int]:
    """The document's ids: BOS (if any), the text's tokens, EOS (if any)."""
    ids = list(self.encode_text(text))
    if self.bos_id is not None:
      ids.insert(0, self.bos_id)
    if self.eos_id is not None:
      ids.append(self.eos_id)
    return ids

  @property
  def fingerprint(self) -> dict[str, Any]:
    """What a checkpoint records to refuse a resume with another tokenizer."""
    return {
      "spec": self.spec,
      "sha256": self.sha256,
      "vocab_size": self.vocab_size,
      "bos_id": self.bos_id,
      "eos_id": self.eos_id,
    }


def parse(spec: str, where: str = "data.tokenizer") -> tuple[str, str]:
  """``(kind, path)`` of a spec, checked: a known kind, and a file that exists.

  Raises:
    ValueError: an unknown kind or a missing file (named).
  """
  text = str(spec).strip()
  kind, sep, path = text.partition(":")
  if text == "bytes":
    return "bytes", ""
  if not sep or kind not in KINDS or kind == "bytes":
    raise ValueError(
      f"{where}: {spec!r} is not a tokenizer; use bytes, hf:<tokenizer.json or its directory>,"
      " sentencepiece:<model file> or tiktoken:<bpe file> (local files; nothing is downloaded)."
    )
  file = os.path.expanduser(path.partition("#")[0] if kind == "tiktoken" else path)
  if kind == "hf" and file and os.path.isdir(file):  # a model's directory, as from_pretrained takes it
    path = file = os.path.join(file, "tokenizer.json")
  if not file or not os.path.isfile(file):
    raise ValueError(
      f"{where}: tokenizer file {file!r} does not exist (a local {kind} file is needed; nothing is downloaded)."
    )
  return kind, path


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


class _Library(NamedTuple):
  """What one tokenizer library gives ``load``."""

  encode: Callable[[str], Sequence[int]]
  token_id: Callable[[str], int | None]
  vocab_size: int
  encode_batch: Callable[[Sequence[str]], Sequence[Sequence[int]]]
  by_prefix: bool
  decode: Callable[[Sequence[int]], str]
  encode_own: Callable[[str], Sequence[int]] | None


def _import(kind: str):
  return extras.require(_PACKAGES[kind], f"data.tokenizer {kind}:")


def _hf(path: str):
  tokenizers = _import("hf")
  try:
    tok = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the library raises its own Exception type
    raise ValueError(f"data.tokenizer: {path!r} is not a Hugging Face tokenizer.json: {e}") from None
  tok.no_truncation()  # a file's truncation or padding (set for a model's inputs) would cut or pad documents
  tok.no_padding()
  encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # fast: no offsets (tokenizers >= 0.20)
  batch = lambda texts: [e.ids for e in encode(list(texts), add_special_tokens=False)]
  return _Library(
    lambda text: tok.encode(text, add_special_tokens=False).ids,
    tok.token_to_id,
    tok.get_vocab_size(with_added_tokens=True),
    batch,
    type(tok.model).__name__ == "BPE",
    lambda ids: tok.decode(list(ids), skip_special_tokens=True),
    lambda text: tok.encode(text, add_special_tokens=True).ids,
  )


def _sentencepiece(path: str):
  spm = _import("sentencepiece")
  try:
    proc = spm.SentencePieceProcessor(model_file=path)
  except Exception as e:  # RuntimeError / OSError with the library's text
    raise ValueError(f"data.tokenizer: {path!r} is not a SentencePiece model: {e}") from None
  piece = lambda token: (lambda i: None if proc.id_to_piece(i) != token else i)(proc.piece_to_id(token))
  return _Library(
    lambda text: proc.encode(text, out_type=int),
    piece,
    proc.get_piece_size(),
    lambda texts: proc.encode(list(texts), out_type=int),
    _sentencepiece_is_bpe(proc),
    lambda ids: proc.decode(list(ids)),  # control tokens (<s>, </s>) decode to nothing
    None,
  )


def _sentencepiece_is_bpe(proc: Any) -> bool:
  """Whether a SentencePiece model is BPE (its default, Unigram, segments a run of text as a whole); False
  where its model proto cannot be read (no ``protobuf``)."""
  try:
    from sentencepiece import sentencepiece_model_pb2
  except ImportError:
    return False
  model = sentencepiece_model_pb2.ModelProto()
  model.ParseFromString(proc.serialized_model_proto())
  return model.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE


def _tiktoken(path: str):
  tiktoken = _import("tiktoken")
  from tiktoken import load as tiktoken_load

  file, _, pattern = path.partition("#")
  pattern = pattern or "cl100k_base"
  if pattern not in _TIKTOKEN_PATTERNS:
    raise ValueError(f"data.tokenizer: unknown tiktoken pattern {pattern!r}; known: {', '.join(_TIKTOKEN_PATTERNS)}.")
  try:
    ranks = tiktoken_load.load_tiktoken_bpe(os.path.expanduser(file))
  except Exception as e:  # ValueError / binascii.Error with the library's text
    raise ValueError(
      f"data.tokenizer: {file!r} is not a tiktoken BPE file (base64 token, rank per line): {e}"
    ) from None
  pat_str = _tiktoken_pattern(tiktoken, pattern)
  encoding = tiktoken.Encoding(name=os.path.basename(file), pat_str=pat_str, mergeable_ranks=ranks, special_tokens={})
  by_text = {token.decode("utf-8", "replace"): rank for token, rank in ranks.items()}
  return _Library(
    lambda text: encoding.encode_ordinary(text),
    by_text.get,
    max(ranks.values()) + 1,
    lambda texts: encoding.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1),
    True,
    lambda ids: encoding.decode(list(ids), errors="replace"),
    None,
  )


def _tiktoken_pattern(tiktoken: Any, name: str) -> str:
  """The pre-tokenisation regex of one of tiktoken's own encodings (its constructor, without its file)."""
  from tiktoken_ext import openai_public

  constructor = {
    "cl100k_base": openai_public.cl100k_base,
    "o200k_base": openai_public.o200k_base,
    "r50k_base": openai_public.r50k_base,
    "p50k_base": openai_public.p50k_base,
  }[name]
  import unittest.mock

  # The constructors fetch their vocabulary; only their pattern is wanted here.
  with unittest.mock.patch.object(openai_public, "load_tiktoken_bpe", lambda *a, **k: {}):
    return constructor()["pat_str"]


@functools.lru_cache(maxsize=8)
def load(spec: str = "bytes", bos_token: str = "", eos_token: str = "") -> Tokenizer:
  """The tokenizer ``spec`` names, with ``bos_token`` / ``eos_token`` around every document.

  Raises:
    ValueError: an unknown kind, a missing or unreadable file, a missing
      library, or a special token the vocabulary does not hold (named).
  """
  kind, path = parse(spec)
  if kind == "bytes":
    library, sha = (
      _Library(
        lambda text: list(text.encode("utf-8")),
        lambda token: None,
        256,
        utf8_bytes,
        True,
        lambda ids: bytes(ids).decode("utf-8", errors="replace"),
        None,
      ),
      "",
    )
  else:
    library = {"hf": _hf, "sentencepiece": _sentencepiece, "tiktoken": _tiktoken}[kind](
      os.path.expanduser(path) if kind != "tiktoken" else path
    )
    sha = _sha256(os.path.expanduser(path.partition("#")[0] if kind == "tiktoken" else path))
  ids = {}
  for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
    if not token:
      ids[name] = None
      continue
    ids[name] = library.token_id(token)
    if ids[name] is None:
      raise ValueError(
        f"data.{name}: {token!r} is not a token of {spec} (a tokenizer's special tokens are named"
        " by their text, e.g. <s>, </s>, <|endoftext|>)."
      )
  return Tokenizer(
    spec,
    library.vocab_size,
    library.encode,
    library.token_id,
    ids["bos_token"],
    ids["eos_token"],
    sha,
    bos_token,
    eos_token,
    encode_texts=library.encode_batch,
    by_prefix=library.by_prefix,
    decode_ids=library.decode,
    encode_own=library.encode_own,
  )


def utf8_bytes(texts: Sequence[str]) -> list[np.ndarray]:
  """Each text's UTF-8 bytes as int32 ids: one buffer converted at once, then split (views into it)."""
  raw = [t.encode("utf-8") for t in texts]
  ids = np.frombuffer(b"".join(raw), np.uint8).astype(np.int32)
  return np.split(ids, np.cumsum([len(r) for r in raw[:-1]], dtype=np.int64)) if raw else []


def worker_thread_env(workers: int) -> dict[str, str]:
  """The environment of one of ``workers`` processes that this process starts to tokenize side by side: a
  Hugging Face tokenizer's own threads (``RAYON_NUM_THREADS``) get this process's cores (its CPU affinity:
  a launcher that binds each process of a host to its share gives each its share) divided by the workers,
  one each when there are as many workers as cores, rather than every worker starting a thread a core
  (idle threads of its pool spin and take cores from the others). A positive ``RAYON_NUM_THREADS`` the
  user set is kept (0, empty or not a number: as if unset, as Rayon itself reads it), and so is a
  ``TOKENIZERS_PARALLELISM`` the user set."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
  chosen = os.environ.get("RAYON_NUM_THREADS", "").strip()
  threads = int(chosen) if chosen.isdigit() and int(chosen) > 0 else max(1, cores // max(1, workers))
  return {
    "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM") or str(threads > 1).lower(),
    "RAYON_NUM_THREADS": str(threads),
  }
