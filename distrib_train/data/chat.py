"""Conversations into token ids and a loss mask, through the model's own chat template.

A record is ``{"messages": [{"role": ..., "content": ...}, ...]}`` (system,
user, assistant and tool turns) or ``{"prompt": ..., "completion": ...}``
(two strings, or two lists of messages). ``ChatTemplate.load`` reads the
template a Hugging Face tokenizer directory ships — ``chat_template.jinja``,
else ``tokenizer_config.json``'s ``chat_template`` (its ``default`` when it
holds several) — with the special tokens that file names; a ``.jinja`` file
given instead overrides it. ``ChatEncoder.encode`` renders a record as
transformers' ``apply_chat_template`` does (a sandboxed jinja2 environment,
blocks trimmed, ``tojson`` unescaped, ``raise_exception``, ``strftime_now``,
``{% generation %}``, the special tokens as variables) and encodes the text
in one piece with no special tokens added, so the ids are transformers'.

The mask says which tokens the loss reads (``loss_on``):

- ``assistant``: the assistant turns. Where the template marks them with
  ``{% generation %}`` blocks, the tokens that overlap a block (as
  transformers' ``return_assistant_tokens_mask``); where it does not, turn
  ``i``'s text is what rendering ``messages[:i + 1]`` adds to rendering
  ``messages[:i]`` with the generation prompt: its content and end of turn.
  A template whose earlier turns render otherwise once later turns follow
  (Qwen3's drops a past turn's reasoning) is refused by name: give it a
  ``{% generation %}`` template (``data.chat_template``).
- ``completion``: a prompt/completion record's completion; a ``messages``
  record's last assistant turn.
- ``all``: every token.

Not for: reading records (``sources.py``), packing (``sequences.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from distrib_train.common import extras

LOSS_ON = ("assistant", "completion", "all")
_ROLES = ("system", "user", "assistant", "tool", "developer")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _token_text(value: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: its text, or a dict holding it as ``content``."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat template's text, where it came from, and the special tokens it renders with."""

  text: str
  source: str
  special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def has_generation_blocks(self) -> bool:
    return bool(_GENERATION.search(self.text))

  @classmethod
  def load(cls, tokenizer_path: str, override: str = "") -> ChatTemplate:
    """The template of the tokenizer at ``tokenizer_path`` (its ``tokenizer.json`` or its directory), or the
    ``override`` file's, with the special tokens of the tokenizer's ``tokenizer_config.json``.

    Raises:
      ValueError: no template anywhere, an unreadable file, or several templates and none named ``default``
        (each named).
    """
    path = os.path.expanduser(tokenizer_path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    tokens = special_tokens(tokenizer_path)
    if override:
      return cls(_read_text(override), override, tokens)
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
      return cls(_read_text(jinja_file), jinja_file, tokens)
    template = config.get("chat_template")
    where = os.path.join(directory, "tokenizer_config.json")
    if isinstance(template, list):
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
      if "default" not in named:
        raise ValueError(
          f"{where}: chat_template holds templates named {sorted(map(str, named))} and none is"
          " 'default'; name the one to use as a file in data.chat_template."
        )
      template = named["default"]
    if not isinstance(template, str) or not template:
      raise ValueError(
        f"{directory!r} has no chat template (neither chat_template.jinja nor a chat_template in"
        " tokenizer_config.json); name a .jinja file in data.chat_template."
      )
    return cls(template, f"{where} (chat_template)", tokens)


def special_tokens(tokenizer_path: str) -> dict[str, str]:
  """The text of each special token (``bos_token``, ``eos_token``, …) the tokenizer at ``tokenizer_path`` (its
  ``tokenizer.json`` or its directory) names in ``tokenizer_config.json`` or ``special_tokens_map.json``, as
  transformers' tokenizer reads them."""
  path = os.path.expanduser(tokenizer_path)
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  config = _read_json(os.path.join(directory, "tokenizer_config.json"))
  specials = _read_json(os.path.join(directory, "special_tokens_map.json"))
  return {
    name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name, specials.get(name)))) is not None
  }


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: not readable as JSON: {e}") from None


def _read_text(path: str) -> str:
  try:
    with open(os.path.expanduser(path), encoding="utf-8") as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"data.chat_template: {path!r} is not readable: {e}") from None


@functools.lru_cache(maxsize=8)
def _compiled(text: str):
  """The template compiled in a sandbox as transformers compiles it, with a ``{% generation %}`` tag that
  records the character spans it renders (``_Spans``)."""
  jinja2 = extras.require("jinja2", "data.loss_on")
  from jinja2 import ext, nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_mark", [nodes.ContextReference()]), [], [], body).set_lineno(lineno)

    def _mark(self, context, caller):
      text = caller()
      spans = context.get("_distrib_train_spans")
      if spans is not None:
        spans.marked(text)
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(text)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"The chat template does not parse: {e} (line {e.lineno}).") from None


class _Spans:
  """The character spans ``{% generation %}`` blocks render, found by streaming the template's output."""

  def __init__(self):
    self.blocks: list[str] = []
    self.spans: list[tuple[int, int]] = []

  def marked(self, text: str) -> None:
    start = sum(map(len, self.blocks))
    self.spans.append((start, start + len(text)))


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
  if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
    raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects.")
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or "role" not in m:
      raise ValueError(f"{where}: message {i} is not a {{'role', 'content'}} object: {str(m)[:80]!r}.")
    if m["role"] not in _ROLES:
      raise ValueError(f"{where}: message {i} has role {m['role']!r}; the roles are {', '.join(_ROLES)}.")
  return [_normalized(m) for m in messages]


_REASONING = ("reasoning_content", "thinking", "reasoning")


def _normalized(message: Mapping[str, Any]) -> dict[str, Any]:
  """A message as transformers hands it to a template: keys holding None dropped (a template tests for a
  missing key), and its reasoning under each name templates read (Qwen's ``reasoning_content``, gpt-oss's
  ``thinking``)."""
  message = {key: value for key, value in message.items() if value is not None}
  reasoning = next((message[key] for key in _REASONING if key in message), None)
  if reasoning is not None:
    message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
  return message


@dataclasses.dataclass(frozen=True)
class ChatEncoder:
  """Records into ``(ids, mask)`` through ``template`` and a Hugging Face ``tokenizers.Tokenizer``.

  Attributes:
    template: the chat template.
    tokenizer: a ``tokenizers.Tokenizer`` (ids and character offsets of one text).
    loss_on: ``assistant``, ``completion`` or ``all`` (``LOSS_ON``).
  """

  template: ChatTemplate
  tokenizer: Any
  loss_on: str = "assistant"

  def __post_init__(self):
    if self.loss_on not in LOSS_ON:
      raise ValueError(f"data.loss_on={self.loss_on!r}: choose one of {', '.join(LOSS_ON)}.")

  def render(
    self,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    spans: _Spans | None = None,
    where: str = "a conversation",
  ) -> str:
    """The template's text for ``messages``, as ``apply_chat_template(..., tokenize=False)`` renders it."""
    jinja2 = extras.require("jinja2", "data.loss_on")

    variables = {
      **self.template.special_tokens,
      "messages": messages,
      "tools": None,
      "documents": None,
      "add_generation_prompt": add_generation_prompt,
      "_distrib_train_spans": spans,
    }
    try:
      if spans is None:
        return _compiled(self.template.text).render(**variables)
      for block in _compiled(self.template.text).generate(**variables):
        spans.blocks.append(block)
      return "".join(spans.blocks)
    except jinja2.TemplateError as e:
      raise ValueError(f"{where}: the chat template of {self.template.source} failed: {e}") from None

  def encode(self, record: Mapping[str, Any], where: str = "record") -> tuple[np.ndarray, np.ndarray]:
    """A record's token ids (int32) and loss mask (bool), both as long as the rendered conversation."""
    if "messages" in record:
      messages = check_messages(record["messages"], where)
      return self._encode_messages(
        messages, first_scored=self._last_assistant(messages, where) if self.loss_on == "completion" else 0, where=where
      )
    if "prompt" in record and "completion" in record:
      prompt, completion = record["prompt"], record["completion"]
      if isinstance(prompt, str) and isinstance(completion, str):
        return self._encode_text(prompt, completion)
      prompt = check_messages(prompt, f"{where} (prompt)")
      completion = check_messages(completion, f"{where} (completion)")
      return self._encode_messages(
        prompt + completion, first_scored=len(prompt) if self.loss_on != "all" else 0, where=where
      )
    raise ValueError(
      f"{where}: a conversation record holds 'messages', or 'prompt' and 'completion'; it has {sorted(record)[:8]}."
    )

  def _last_assistant(self, messages: list[dict[str, Any]], where: str) -> int:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
      raise ValueError(f"{where}: data.loss_on=completion scores the last assistant turn, and there is none.")
    return turns[-1]

  def _encode_text(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """A plain prompt and completion: their text encoded in one piece; the completion's tokens scored."""
    encoding = self.tokenizer.encode(prompt + completion, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    if self.loss_on == "all":
      return ids, np.ones(len(ids), bool)
    return ids, _overlapping(encoding.offsets, [(len(prompt), len(prompt) + len(completion))])

  def _encode_messages(
    self, messages: list[dict[str, Any]], *, first_scored: int, where: str
  ) -> tuple[np.ndarray, np.ndarray]:
    spans = _Spans()
    text = self.render(messages, spans=spans, where=where)
    encoding = self.tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    if self.loss_on == "all":
      return ids, np.ones(len(ids), bool)
    if self.template.has_generation_blocks:
      turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
      if first_scored == 0:
        chosen = spans.spans
      elif len(spans.spans) == len(turns):  # block k is the k-th assistant turn
        chosen = [span for turn, span in zip(turns, spans.spans) if turn >= first_scored]
      else:
        raise ValueError(
          f"{where}: the chat template of {self.template.source} renders {len(spans.spans)}"
          f" generation blocks for {len(turns)} assistant turns, so the completion's cannot be told"
          " apart; set data.loss_on=assistant or all."
        )
    else:
      chosen = [
        self._turn_span(messages, i, text, where)
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and i >= first_scored
      ]
    return ids, _overlapping(encoding.offsets, chosen)

  def _turn_span(self, messages: list[dict[str, Any]], i: int, text: str, where: str) -> tuple[int, int]:
    """Assistant turn ``i``'s characters in ``text``: what it adds to its prefix with the generation prompt."""
    before = self.render(messages[:i], add_generation_prompt=True, where=where) if i else ""
    through = self.render(messages[: i + 1], where=where)
    if not (through.startswith(before) and text.startswith(through)):
      raise ValueError(
        f"{where}: the chat template of {self.template.source} renders assistant turn {i} otherwise once later"
        " turns follow, so its tokens cannot be found by rendering prefixes; give data.chat_template a"
        " template that marks assistant turns with {% generation %} blocks, or set data.loss_on=all."
      )
    return len(before), len(through)


def _overlapping(offsets: Any, spans: Sequence[tuple[int, int]]) -> np.ndarray:
  """Tokens whose characters overlap a span (the spans apart, as rendered): transformers' assistant mask."""
  offsets = np.asarray(offsets, np.int64).reshape(-1, 2)
  mask = np.zeros(len(offsets), bool)
  for start, end in spans:
    mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
  return mask


# A conversation's tokens as the lanes carry them: each token's id and whether the loss reads it.
SCORED_TOKENS = np.dtype([("ids", np.int32), ("loss", np.int32)])

# The ``bytes`` tokenizer's template (it has no file of its own): ChatML turns, assistant turns marked.
CHATML = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
  "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
  "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _Encoding:
  def __init__(self, ids: np.ndarray, offsets: np.ndarray):
    self.ids, self.offsets = ids, offsets


class Utf8Bytes:
  """The ``bytes`` tokenizer with ``tokenizers``' interface: a text's UTF-8 bytes, each with its character."""

  def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
    del add_special_tokens
    ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    widths = np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text))
    char = np.repeat(np.arange(len(text), dtype=np.int64), widths)
    return _Encoding(ids, np.stack([char, char + 1], axis=1))


class ConversationTokenizer:
  """A conversation record (JSON text) → its tokens as ``SCORED_TOKENS``, cut at (or, as the data config
  says, left out past) ``seq_len + 1``; ``long`` counts those."""

  def __init__(self, config: Any):
    from distrib_train.data import tokenizer as tokenizer_lib

    kind, path = tokenizer_lib.parse(config.tokenizer)
    if kind == "hf":
      tokenizers = extras.require("tokenizers", "data.tokenizer hf:")
      tok = tokenizers.Tokenizer.from_file(os.path.expanduser(path))
      tok.no_truncation()
      tok.no_padding()
      template = ChatTemplate.load(path, config.chat_template)
    else:
      tok = Utf8Bytes()
      template = (
        ChatTemplate(_read_text(config.chat_template), config.chat_template)
        if config.chat_template
        else ChatTemplate(CHATML, "the bytes tokenizer's ChatML template")
      )
    self.encoder = ChatEncoder(template, tok, config.loss_on)
    self.dtype = SCORED_TOKENS
    self.limit, self.drop, self.long = config.seq_len + 1, config.long_conversations == "drop", 0

  def __call__(self, doc: str) -> np.ndarray:
    try:
      record = json.loads(doc)
    except ValueError:
      raise ValueError(f"A conversation record is not JSON: {doc[:80]!r}.") from None
    ids, mask = self.encoder.encode(record, where=f"The conversation record {doc[:100]!r}…")
    if len(ids) > self.limit:
      self.long += 1
      if self.drop:
        return np.zeros(0, self.dtype)
      ids, mask = ids[: self.limit], mask[: self.limit]
    out = np.empty(len(ids), SCORED_TOKENS)
    out["ids"], out["loss"] = ids, mask
    return out
