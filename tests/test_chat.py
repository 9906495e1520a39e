"""Conversations through the model's chat template: ids and assistant masks equal transformers'."""

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from distrib_train.data.chat import ChatEncoder, ChatTemplate  # noqa: E402

from chat_helpers import (
  CONVERSATIONS,
  LLAMA3,
  QWEN,
  STYLES,
  bpe,  # noqa: E402,F401  (bpe: a fixture)
  tokenizer_dir as _tokenizer_dir,
)


def _reference(directory, messages, template=None):
  tok = transformers.AutoTokenizer.from_pretrained(str(directory))
  out = tok.apply_chat_template(
    messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
  )
  return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("style", sorted(STYLES))
def test_ids_and_assistant_mask_equal_transformers(style, bpe, tmp_path):
  template, marked, *_ = STYLES[style]
  directory = _tokenizer_dir(tmp_path / style, bpe, style, template, jinja_file=style == "gemma")
  encoder = ChatEncoder(
    ChatTemplate.load(str(directory / "tokenizer.json")),
    tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")),
  )
  assert encoder.template.has_generation_blocks == (template is marked)
  for messages in CONVERSATIONS:
    ids, mask = encoder.encode({"messages": messages})
    want_ids, want_mask = _reference(directory, messages, marked)
    assert ids.tolist() == want_ids
    # Without {% generation %} blocks the turns come from rendering prefixes: the marked template's mask.
    assert mask.astype(int).tolist() == want_mask
    assert ids.tolist() == _reference(directory, messages)[0]
    assert 0 < mask.sum() < len(mask)


def test_completion_and_all_and_plain_prompt_completion(bpe, tmp_path):
  directory = _tokenizer_dir(tmp_path, bpe, "qwen", QWEN)
  tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
  template = ChatTemplate.load(str(directory))
  messages = CONVERSATIONS[1]
  ids, assistant = ChatEncoder(template, tok).encode({"messages": messages})
  _, last = ChatEncoder(template, tok, loss_on="completion").encode({"messages": messages})
  _, every = ChatEncoder(template, tok, loss_on="all").encode({"messages": messages})
  assert every.all() and (last <= assistant).all() and 0 < last.sum() < assistant.sum()
  scored = tok.decode(ids[last].tolist(), skip_special_tokens=False)
  assert scored == " Twenty-three. <|im_end|>" and "Eleven" in tok.decode(ids[assistant].tolist())
  # Message-list prompt and completion: the completion's assistant turn is scored.
  _, split = ChatEncoder(template, tok, loss_on="completion").encode(
    {"prompt": messages[:4], "completion": messages[4:]}
  )
  assert split.tolist() == last.tolist()
  ids, mask = ChatEncoder(template, tok).encode({"prompt": "Question: 2 + 2?", "completion": " Answer: 4."})
  assert ids.tolist() == tok.encode("Question: 2 + 2? Answer: 4.", add_special_tokens=False).ids
  assert "Answer: 4." in tok.decode(ids[mask].tolist()) and "Question" not in tok.decode(ids[mask].tolist())


def test_bad_records_and_templates_are_refused_by_name(bpe, tmp_path):
  directory = _tokenizer_dir(tmp_path / "t", bpe, "llama3", LLAMA3)
  tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
  encoder = ChatEncoder(ChatTemplate.load(str(directory)), tok)
  with pytest.raises(ValueError, match="line 7 of chat.jsonl: message 1 has role 'robot'"):
    encoder.encode(
      {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}, "line 7 of chat.jsonl"
    )
  with pytest.raises(ValueError, match="holds 'messages', or 'prompt' and 'completion'; it has \\['text'\\]"):
    encoder.encode({"text": "x"})
  with pytest.raises(ValueError, match="data.loss_on='answers'"):
    ChatEncoder(encoder.template, tok, loss_on="answers")
  # A template that drops a past turn's reasoning: its turns cannot be found from prefixes.
  forgetful = tmp_path / "forgetful.jinja"
  forgetful.write_text(
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[past]"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
  )
  encoder = ChatEncoder(ChatTemplate.load(str(directory), override=str(forgetful)), tok)
  with pytest.raises(ValueError, match="renders assistant turn 2 otherwise once later turns follow.*generation"):
    encoder.encode({"messages": CONVERSATIONS[1]})
  (tmp_path / "none").mkdir()
  with pytest.raises(ValueError, match="has no chat template"):
    ChatTemplate.load(str(tmp_path / "none"))
