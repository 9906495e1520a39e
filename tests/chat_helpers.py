"""Chat templates, conversations and a tokenizer directory for the chat and SFT tests (nothing downloaded)."""

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")

# Templates written in the style of each family's (not copied): Llama 3's headers, Qwen's ChatML with
# {% generation %} blocks, Gemma's turns with the system text folded into the first user turn.
LLAMA3 = (
  "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
  "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
  "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN = (
  "{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
  "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
  "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
  "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
  "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
  "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
  "<start_of_turn>{{ role }}\n{{ ((first if loop.first else '') + message['content']) | trim }}<end_of_turn>\n"
  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# The same two templates with their assistant turns marked, for transformers' mask to compare with.
LLAMA3_MARKED = LLAMA3.replace(
  "{{ message['content'] | trim }}<|eot_id|>",
  "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
  "{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}",
)
GEMMA_MARKED = GEMMA.replace(
  "<start_of_turn>{{ role }}\n{{ ((first if loop.first else '') + message['content']) | trim }}<end_of_turn>\n",
  "<start_of_turn>{{ role }}\n{% if role == 'model' %}{% generation %}{{ message['content'] | trim }}"
  "<end_of_turn>\n{% endgeneration %}{% else %}{{ ((first if loop.first else '') + message['content']) | trim }}"
  "<end_of_turn>\n{% endif %}",
)
STYLES = {
  "llama3": (
    LLAMA3,
    LLAMA3_MARKED,
    ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "<|begin_of_text|>",
    "<|eot_id|>",
  ),
  "qwen": (QWEN, QWEN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>"),
  "gemma": (GEMMA, GEMMA_MARKED, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
}
CONVERSATIONS = [
  [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
  [
    {"role": "system", "content": "You answer in one short line."},
    {"role": "user", "content": "Name a prime above ten."},
    {"role": "assistant", "content": "Eleven."},
    {"role": "user", "content": "And one above twenty?"},
    {"role": "assistant", "content": " Twenty-three. "},
  ],
  [
    {"role": "user", "content": "Say héllo in ünicode ✓"},
    {"role": "assistant", "content": "héllo ✓", "tool_calls": None},
  ],
]


def bpe_tokenizer(texts, vocab_size=400):
  """A small byte-level BPE trained on ``texts``."""
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
    texts, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  )
  return tok


@pytest.fixture(scope="module")
def bpe():
  """A BPE trained on the conversations' own text."""
  return bpe_tokenizer([m["content"] for c in CONVERSATIONS for m in c] * 20 + ["user assistant model system"] * 20)


def tokenizer_dir(tmp_path, bpe, style, template, *, jinja_file=False):
  _, _, specials, bos, eos = STYLES[style]
  tok = tokenizers.Tokenizer.from_str(bpe.to_str())
  tok.add_special_tokens(specials)
  tmp_path.mkdir(parents=True, exist_ok=True)
  tok.save(str(tmp_path / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
  if bos:
    config["bos_token"] = {
      "__type": "AddedToken",
      "content": bos,
      "special": True,
      "lstrip": False,
      "rstrip": False,
      "normalized": False,
      "single_word": False,
    }
  if jinja_file:
    (tmp_path / "chat_template.jinja").write_text(template)
    config["chat_template"] = "{{ 'the jinja file wins' }}"
  else:
    config["chat_template"] = template
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  return tmp_path


def manual_conversations(n=48):
  """Conversations about paragraphs of the pydoc corpus: messages records (some with a system turn) and
  prompt/completion records of message lists."""
  from distrib_train.data import sources

  paragraphs = [p for p in sources._pydoc_documents(300) if 40 < len(p) < 400][:n]
  records = []
  for i, text in enumerate(paragraphs):
    turns = [
      {"role": "user", "content": f"Question {i}: what does the manual say?"},
      {"role": "assistant", "content": text},
    ]
    if i % 3 == 0:
      turns = [{"role": "system", "content": "Answer from the manual."}] + turns
    records.append({"prompt": turns[:-1], "completion": turns[-1:]} if i % 4 == 1 else {"messages": turns})
  return records


def texts_of(records):
  """Every turn's text of ``records`` (to train a tokenizer on)."""
  return [m["content"] for r in records for m in r.get("messages", []) + r.get("prompt", []) + r.get("completion", [])]
