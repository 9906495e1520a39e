"""``distrib-train export``: a run's params as a Hugging Face checkpoint, or a LoRA run's as a PEFT adapter.

  distrib-train export --workdir runs/ft --out hf/ft            # the newest checkpoint
  distrib-train export --workdir runs/ft --out hf/ft --step 1000
  distrib-train export --workdir runs/lora --out hf/lora --adapter
  distrib-train export --workdir runs/mtp --out hf/mtp --drop_mtp   # without the MTP modules

Reads the run's ``config.yaml``, restores the params of one checkpoint
(params only: the optimizer state is not read) onto this host's first device
and writes ``config.json`` and float32 safetensors (``checkpoint/hf.py``),
which ``transformers.AutoModelForCausalLM.from_pretrained`` loads. The host
needs the params' size in memory (4 bytes a parameter). The reference
decoders only (``model.name: llama`` or ``moe``), written as the family they
were read from (``train.init_from: hf:…``), else as Llama, Qwen2, Mixtral or
Qwen2-MoE by their variants (``recipes/hf_shape.family_of``). A LoRA run's
adapters are merged into their weights, or, with ``--adapter``, written alone
as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
``checkpoint/peft_adapter.py``) on the checkpoint the run started from
(``base_model_name_or_path``: ``init_from``'s ``hf:`` directory, else null).
A run with multi-token prediction (``model.mtp_depth``) writes its modules as
DeepSeek-V3 does, as the layers after the last with
``num_nextn_predict_layers``; ``--drop_mtp`` leaves them out (and writes 0).

A mistake prints one ``error:`` line and exits with status 2; nothing is
written then.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Sequence

from distrib_train.common.text import fail


def export(
  workdir: str | os.PathLike, out: str, step: int | None = None, adapter: bool = False, drop_mtp: bool = False
) -> list[str]:
  """Writes the params of ``workdir``'s checkpoint ``step`` (default: the newest) to ``out`` as a Hugging Face
  checkpoint, or with ``adapter`` a LoRA run's adapters as a PEFT adapter; returns the files written. With
  ``drop_mtp`` the multi-token-prediction modules are left out.

  Raises:
    ValueError: no such run or step, another model than llama, ``adapter`` for a run without LoRA (named).
  """
  import jax

  from distrib_train.checkpoint import hf
  from distrib_train.config import run as config_lib
  from distrib_train.weights import load as run_model

  workdir = pathlib.Path(workdir)
  if not (workdir / "config.yaml").exists():
    raise ValueError(f"{str(workdir)!r} is not a distrib_train run (no config.yaml).")
  config = config_lib.load(str(workdir / "config.yaml"))
  if config.model.name not in ("llama", "moe"):
    raise ValueError(
      f"export writes the llama and moe models as Hugging Face's; this run's model is {config.model.name!r}."
    )
  recipe = config.model_recipe()
  if adapter and not getattr(recipe.config, "lora_rank", 0):
    raise ValueError(
      "--adapter writes a LoRA run's adapters; this run has none (model.lora.rank is 0): export it without --adapter."
    )
  if not (workdir / "checkpoints").is_dir() or not any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir()):
    raise ValueError(f"{str(workdir / 'checkpoints')!r} holds no checkpoint.")
  # The params onto this host's first device; the merged model's frozen weights too (LoRA's base from its source).
  state = run_model.load(f"ckpt:{workdir}", step=step, devices=jax.devices()[:1], frozen=not adapter).state
  if adapter:  # with LoRA the params are the adapters
    from distrib_train.checkpoint import peft_adapter

    kind, _, base = config.train.init_from.partition(":")
    return peft_adapter.save(state.params, recipe.config, out, base=os.path.expanduser(base) if kind == "hf" else None)
  model_config = recipe.config
  if drop_mtp:  # the model without its MTP modules: the tables then name none of their tensors
    import dataclasses

    model_config = dataclasses.replace(model_config, mtp_depth=0)
  return hf.save(_weights(state, recipe.config), model_config, out, local_state=state.local_state)


def _weights(state, config) -> dict:
  """The model's weights by Hugging Face's param names, ``{segment: {name: array}}`` and the top-level ones,
  whether trained or frozen (a DPO run's policy, not its reference); a LoRA model's adapters added into their
  weights (``recipes/lora.merged``)."""
  import jax

  from distrib_train.checkpoint import hf
  from distrib_train.recipes import lora

  nested: dict = {}
  for tree in (state.model_without_params, state.params):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if hf.is_reference(path):  # a preference run's frozen reference: the policy is the model
        continue
      keys = hf.path_keys(path)
      if len(keys) == 1:
        nested[keys[0]] = leaf
      elif len(keys) == 2:
        nested.setdefault(keys[0], {})[keys[1]] = leaf
  if getattr(config, "lora_rank", 0):
    for segment, stack in list(nested.items()):
      if isinstance(stack, dict):
        nested[segment] = lora.merged(config, stack, stack)
  return nested


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="distrib-train export", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="the run's directory")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write (created)")
  parser.add_argument("--step", type=int, help="the checkpoint step (default: the newest)")
  parser.add_argument(
    "--adapter",
    action="store_true",
    help="a LoRA run: write its adapters alone as a PEFT adapter (adapter_config.json +"
    " adapter_model.safetensors) on the checkpoint it started from, not the merged model",
  )
  parser.add_argument(
    "--drop_mtp",
    action="store_true",
    help="leave the multi-token-prediction modules (model.mtp_depth) out: config.json's"
    " num_nextn_predict_layers is then 0",
  )
  args = parser.parse_args(list(argv))
  try:
    written = export(args.workdir, args.out, args.step, args.adapter, args.drop_mtp)
  except ValueError as e:  # CheckpointError and HfCheckpointError are ValueErrors
    fail(str(e))
  print(f"wrote {', '.join(written)} to {args.out}")
  return 0
