"""What the evaluation tests share: a tiny model with a BPE tokenizer saved as transformers saves it, and local
lm-eval tasks of the three kinds (JSONL files, ``dataset_path: json``) built from the demo tasks' documents.

Used by tests/test_eval_tasks.py, tests/test_eval_tasks_hf.py, tests/workers/eval_worker.py and
bench/evaluation.py (each imports it from tests/).
"""

import json
import pathlib

CONTEXT = 64  # the model's max_position_embeddings: lm-eval's max_length, so long texts roll over windows
TASKS = ("local_choice", "local_perplexity", "local_completion")
# A Llama 3 style template (its headers plain text here: the BPE knows no such tokens).
CHAT_TEMPLATE = (
  "{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>\n{{ message['content'] | trim }}"
  "{% if not loop.last or add_generation_prompt %}\n{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<assistant>\n{% endif %}"
)
_YAML = {
  "local_choice": """task: local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""",
  "local_perplexity": """task: local_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
  "local_completion": """task: local_completion
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def write_tasks(directory: pathlib.Path, documents: int = 12) -> pathlib.Path:
  """The three local tasks (``TASKS``) in ``directory``: YAMLs and their JSONL data, ``documents`` each."""
  from distrib_train.evaluation import demo_tasks

  directory.mkdir(parents=True, exist_ok=True)
  builders = {
    "local_choice": demo_tasks.choice,
    "local_perplexity": demo_tasks.perplexity,
    "local_completion": demo_tasks.completion,
  }
  for name, build in builders.items():
    records = list(build()["test"])[:documents]
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / f"{name}.yaml").write_text(_YAML[name].format(data=data))
  return directory


def save_model(family: str, directory: pathlib.Path, context: int = CONTEXT, **changes):
  """``test_hf``'s tiny ``family`` (fp32, random weights, ``context`` positions; ``changes``: other config
  fields) with a byte-level BPE of 472 ids whose BOS the tokenizer adds (a Llama 3 tokenizer's habit), saved
  together: the transformers model."""
  import test_hf
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  from distrib_train.evaluation import demo_tasks

  reference = test_hf._save(family, directory, vocab_size=512, max_position_embeddings=context, **changes)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(
    list(demo_tasks._paragraphs()) * 2,
    trainers.BpeTrainer(vocab_size=470, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
  )
  bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
  tok.add_special_tokens([bos, eos])
  tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "model_max_length": context,
        "chat_template": CHAT_TEMPLATE,
      }
    )
  )
  eos_id = tok.token_to_id(eos)
  for name in ("config.json", "generation_config.json"):
    path = directory / name
    if path.exists():
      config = json.loads(path.read_text())
      config.update(bos_token_id=tok.token_to_id(bos), eos_token_id=eos_id)
      path.write_text(json.dumps(config))
  return reference
