"""What the GRPO tests share: TRL's ``GRPOTrainer`` loss and advantages written out again in numpy (float64), reward
functions with TRL's signature, and reading a run's records.

The formulas follow TRL's ``GRPOTrainer`` (``_compute_loss``, ``_generate_and_score_completions``) as its docs state
them; nothing of distrib_train is used, so the tests compare two independent writings.

Used by tests/test_grpo.py, tests/test_grpo_hf.py, tests/test_generation_hf.py and tests/workers/grpo_worker.py.
"""

import json
import pathlib

import numpy as np


def trl_advantages(rewards, num_generations, scale_rewards):
  """TRL's advantages of the summed rewards [N] (groups of ``num_generations`` consecutive rows), group by group
  with the ``statistics`` module (sample standard deviations, as torch's ``std``)."""
  import statistics

  rewards = [float(r) for r in rewards]
  spread_of_all = statistics.stdev(rewards)
  out = []
  for first in range(0, len(rewards), num_generations):
    group = rewards[first : first + num_generations]
    centre = statistics.fmean(group)
    scale = {"group": statistics.stdev(group) + 1e-4, "batch": spread_of_all + 1e-4, "none": 1.0}[scale_rewards]
    out += [(r - centre) / scale for r in group]
  return np.asarray(out)


def trl_loss(
  logps, old_logps, ref_logps, advantages, mask, *, loss_type, level, beta, epsilon, epsilon_high, max_completion_length
):
  """TRL's GRPO loss of one batch: per-token ``logps`` [N, T] (the policy's, logits over the temperature),
  ``old_logps`` (the policy's at generation), ``ref_logps`` (the reference's, read when beta > 0), the row
  ``advantages`` [N] and the completion ``mask`` [N, T]."""
  logps, old, mask = (np.asarray(x, np.float64) for x in (logps, old_logps, mask))
  advantages = np.asarray(advantages, np.float64)[:, None]
  log_ratio = logps - old
  if level == "token":
    log_weight = log_ratio
  else:
    log_weight = ((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
  coef_1 = np.exp(log_weight)
  coef_2 = np.clip(coef_1, 1 - epsilon, 1 + (epsilon_high or epsilon))
  per_token = -np.minimum(coef_1 * advantages, coef_2 * advantages)
  if beta:
    ref = np.asarray(ref_logps, np.float64)
    per_token = per_token + beta * (np.exp(ref - logps) - (ref - logps) - 1)
  if loss_type == "grpo":
    return ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
  if loss_type == "dr_grpo":
    return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
  return (per_token * mask).sum() / max(mask.sum(), 1.0)  # bnpo, and dapo over one process's whole batch


# --- reward functions, with TRL's signature --------------------------------------------------------------------


def distinct_letters(prompts, completions, completion_ids, **columns):
  """A tenth of the distinct characters of each completion: a reward with a spread in every group."""
  return [len(set(c if isinstance(c, str) else c[0]["content"])) / 10 for c in completions]


def echoes_target(prompts, completions, completion_ids, target, **columns):
  """1 where the completion holds its record's ``target`` column, None where the record has none."""
  text = lambda c: c if isinstance(c, str) else c[0]["content"]
  return [None if t is None else float(t in text(c)) for c, t in zip(completions, target)]


def fails_on_seven(prompts, completions, completion_ids, **columns):
  """Raises for the prompt ``7+…``: the run must stop with one line naming this function and the prompt."""
  for p in prompts:
    if p.startswith("7+"):
      raise RuntimeError("cannot score sevens")
  return [0.0] * len(prompts)


# --- a run's records -------------------------------------------------------------------------------------------


def read_jsonl(path):
  return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def losses(workdir):
  """Every logged training loss of a run, by step (``train.log_every: 1``)."""
  return {
    r["step"]: r["loss"]
    for r in read_jsonl(pathlib.Path(workdir) / "metrics.jsonl")
    if "loss" in r and "step_time_ms" in r
  }


# --- a run on a Hugging Face directory ---------------------------------------------------------------------


def write_prompts(path, count=8):
  """Prompt records for a tiny BPE model: text prompts and, every other one, a chat's messages; most with a
  ``target`` column (None where absent)."""
  question = lambda i: f"Question {i}: why " + "so " * (i % 3)
  records = [
    {
      "prompt": question(i) if i % 2 else [{"role": "user", "content": question(i)}],
      **({"target": "e"} if i % 4 else {}),
    }
    for i in range(count)
  ]
  pathlib.Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def hf_overrides(hf_dir, prompts):
  """A GRPO run of ``grpo-tiny``'s shape on the Hugging Face model in ``hf_dir`` (fp32, XLA attention) over the
  prompts file: 4 prompts × 4 completions of up to 12 tokens a batch, 2 steps on each batch, a checkpoint each step,
  the two reward functions above."""
  return [
    f"train.init_from=hf:{hf_dir}",
    "model.dtype=float32",
    "model.attention=xla",
    "data.source=text",
    f"data.paths={prompts}",
    "data.seq_len=48",
    "data.global_batch_size=16",
    "grpo.num_generations=4",
    "grpo.max_completion_length=12",
    "grpo.temperature=0.7",
    "grpo.num_iterations=2",
    "grpo.reward_funcs=grpo_helpers:distinct_letters,grpo_helpers:echoes_target",
    "grpo.reward_weights=1.0,0.5",
    "grpo.format_pattern=.*",
    "optimizer.learning_rate=0.02",
    "optimizer.warmup_steps=0",
    "train.steps=2",
    "train.log_every=1",
    "train.checkpoint_every=1",
    "train.keep_checkpoints=3",
  ]


CHATML = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_chat_model(directory, prompts):
  """``eval_helpers``' tiny Llama made a ChatML chat model, as a fine-tune saved by transformers leaves one: its
  tokenizer's end token ``<|im_end|>`` (added, with ``<|im_start|>`` and the template), its
  ``generation_config.json`` still transformers' default ``eos_token_id`` (``<|end_of_text|>``). ``<|im_end|>``'s
  output row points along the mean final hidden state of the prompts in the file ``prompts``: at temperature 0.7
  it is the likeliest token at most steps, so a completion ends within a few tokens where ``<|im_end|>`` stops
  it, and runs on past it where it does not. Returns ``<|im_end|>``'s id."""
  import torch
  import transformers

  import eval_helpers

  eval_helpers.save_model("llama", directory)
  tok = transformers.AutoTokenizer.from_pretrained(directory)
  tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
  tok.chat_template = CHATML
  tok.save_pretrained(directory)
  net = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  states = []
  with torch.no_grad():
    for record in read_jsonl(prompts):
      prompt = record["prompt"]
      text = (
        prompt
        if isinstance(prompt, str)
        else tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
      )
      states.append(net(torch.tensor([tok(text)["input_ids"]]), output_hidden_states=True).hidden_states[-1][0])
    mean = torch.cat(states).mean(0)
    net.lm_head.weight[tok.eos_token_id] = 2.0 * mean / mean.norm()
  net.save_pretrained(directory)
  return tok.eos_token_id
