"""Conversations through the model's chat template: ids and assistant masks equal transformers'."""

import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from distrib_train.data.chat import ChatEncoder, ChatTemplate  # noqa: E402

# Templates written in the style of each family's (not copied): Llama 3's headers, Qwen's ChatML with
# {% generation %} blocks, Gemma's turns with the system text folded into the first user turn.
LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN = ("{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
        "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
        "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
         "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
         "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
         "<start_of_turn>{{ role }}\n{{ ((first if loop.first else '') + message['content']) | trim }}<end_of_turn>\n"
         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# The same two templates with their assistant turns marked, for transformers' mask to compare with.
LLAMA3_MARKED = LLAMA3.replace(
    "{{ message['content'] | trim }}<|eot_id|>",
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}")
GEMMA_MARKED = GEMMA.replace(
    "<start_of_turn>{{ role }}\n{{ ((first if loop.first else '') + message['content']) | trim }}<end_of_turn>\n",
    "<start_of_turn>{{ role }}\n{% if role == 'model' %}{% generation %}{{ message['content'] | trim }}"
    "<end_of_turn>\n{% endgeneration %}{% else %}{{ ((first if loop.first else '') + message['content']) | trim }}"
    "<end_of_turn>\n{% endif %}")
STYLES = {
    "llama3": (LLAMA3, LLAMA3_MARKED, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
    "qwen": (QWEN, QWEN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
    "gemma": (GEMMA, GEMMA_MARKED, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
    [{"role": "system", "content": "You answer in one short line."},
     {"role": "user", "content": "Name a prime above ten."}, {"role": "assistant", "content": "Eleven."},
     {"role": "user", "content": "And one above twenty?"}, {"role": "assistant", "content": " Twenty-three. "}],
    [{"role": "user", "content": "Say héllo in ünicode ✓"}, {"role": "assistant", "content": "héllo ✓", "tool_calls": None}],
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A small byte-level BPE trained on the conversations' own text."""
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["user assistant model system"] * 20
  tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _tokenizer_dir(tmp_path, bpe, style, template, *, jinja_file=False):
  _, _, specials, bos, eos = STYLES[style]
  tok = tokenizers.Tokenizer.from_str(bpe.to_str())
  tok.add_special_tokens(specials)
  tmp_path.mkdir(parents=True, exist_ok=True)
  tok.save(str(tmp_path / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
  if bos:
    config["bos_token"] = {"__type": "AddedToken", "content": bos, "special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
  if jinja_file:
    (tmp_path / "chat_template.jinja").write_text(template)
    config["chat_template"] = "{{ 'the jinja file wins' }}"
  else:
    config["chat_template"] = template
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  return tmp_path


def _reference(directory, messages, template=None):
  tok = transformers.AutoTokenizer.from_pretrained(str(directory))
  out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
  return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("style", sorted(STYLES))
def test_ids_and_assistant_mask_equal_transformers(style, bpe, tmp_path):
  template, marked, *_ = STYLES[style]
  directory = _tokenizer_dir(tmp_path / style, bpe, style, template, jinja_file=style == "gemma")
  encoder = ChatEncoder(ChatTemplate.load(str(directory / "tokenizer.json")),
                        tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")))
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
      {"prompt": messages[:4], "completion": messages[4:]})
  assert split.tolist() == last.tolist()
  ids, mask = ChatEncoder(template, tok).encode({"prompt": "Question: 2 + 2?", "completion": " Answer: 4."})
  assert ids.tolist() == tok.encode("Question: 2 + 2? Answer: 4.", add_special_tokens=False).ids
  assert "Answer: 4." in tok.decode(ids[mask].tolist()) and "Question" not in tok.decode(ids[mask].tolist())


def test_bad_records_and_templates_are_refused_by_name(bpe, tmp_path):
  directory = _tokenizer_dir(tmp_path / "t", bpe, "llama3", LLAMA3)
  tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
  encoder = ChatEncoder(ChatTemplate.load(str(directory)), tok)
  with pytest.raises(ValueError, match="line 7 of chat.jsonl: message 1 has role 'robot'"):
    encoder.encode({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
                   "line 7 of chat.jsonl")
  with pytest.raises(ValueError, match="holds 'messages', or 'prompt' and 'completion'; it has \\['text'\\]"):
    encoder.encode({"text": "x"})
  with pytest.raises(ValueError, match="data.loss_on='answers'"):
    ChatEncoder(encoder.template, tok, loss_on="answers")
  # A template that drops a past turn's reasoning: its turns cannot be found from prefixes.
  forgetful = tmp_path / "forgetful.jinja"
  forgetful.write_text("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[past]"
                       "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}assistant: {% endif %}")
  encoder = ChatEncoder(ChatTemplate.load(str(directory), override=str(forgetful)), tok)
  with pytest.raises(ValueError, match="renders assistant turn 2 otherwise once later turns follow.*generation"):
    encoder.encode({"messages": CONVERSATIONS[1]})
  (tmp_path / "none").mkdir()
  with pytest.raises(ValueError, match="has no chat template"):
    ChatTemplate.load(str(tmp_path / "none"))
