"""``distrib-train eval``: lm-evaluation-harness tasks on a model, offline, sharded, in one process or several.

  distrib-train eval --init_from ckpt:/tmp/distrib_train_demo --tasks demo
  distrib-train eval --init_from hf:/models/qwen3 --include_path my_tasks --tasks arc_local,wiki_ppl \\
      --num_fewshot 5 --output_path results --log_samples --mesh_config cpu-8 --cpu_devices 8

The model loads as ``run_model.load`` reads it and answers through
``harness.HarnessLM``; lm-eval (``pip install 'distrib_train[eval]'``) builds
the requests, scores them and prints its table. Each flag means what
lm-eval's flag of that name means; ``--output_path`` gets lm-eval's results
JSON (``<output_path>/<model>/results_<date>.json``) and, with
``--log_samples``, its per-sample files.

Tasks: lm-eval's task YAMLs under ``--include_path`` (or a YAML's path),
and the demo tasks that ship in ``distrib_train/configs/eval_tasks`` (group
``demo``: ``demo_choice``, ``demo_perplexity``, ``demo_completion``, built
from the pydoc corpus). Offline: a task's data must be local —
``dataset_path: json`` (or csv, parquet, arrow, text) with
``dataset_kwargs.data_files`` that exist, a local directory, or a
``custom_dataset`` function; any other task stops before the model is read,
with one line naming it and how to give its files.

Several processes (``--coordinator_address``, …): every process builds the
same requests and runs the model on them with the others (each device its
rows); process 0 prints and writes.

A mistake prints one ``error:`` line and exits with status 2, before any
model is read.

Not for: the requests themselves (``harness.py``); a training run's task
scores (``train.eval_tasks``: ``eval_hook.py``).
"""

from __future__ import annotations

import argparse
import glob
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from distrib_train.weights import load as run_model
from distrib_train.common.text import fail

DEMO_TASKS = pathlib.Path(__file__).resolve().parent.parent / "configs" / "eval_tasks"
_LOCAL_BUILDERS = ("json", "csv", "parquet", "arrow", "text", "pandas")


def offline() -> None:
  """No Hub look-up from ``datasets`` or ``huggingface_hub`` (unless the environment already says otherwise)."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")


def task_manager(include_path: Sequence[str] = (), *, defaults: bool = False):
  """lm-eval's ``TaskManager`` over the demo tasks and ``include_path`` (and lm-eval's own tasks: ``defaults``)."""
  from distrib_train.common import extras

  extras.require("lm_eval", "distrib-train eval")
  from lm_eval.tasks import TaskManager

  paths = [str(DEMO_TASKS), *(os.path.expanduser(p) for p in include_path)]
  for path in paths[1:]:
    if not os.path.exists(path):
      raise ValueError(f"--include_path {path!r} does not exist.")
  return TaskManager(include_path=paths, include_defaults=defaults)


def resolve(manager: Any, tasks: Sequence[str], include_path: Sequence[str] = (), where: str = "--tasks") -> list[str]:
  """The task names (globs expanded, YAML paths kept), each of whose tasks reads only local data.

  Raises:
    ValueError: an unknown task, or one whose data would be downloaded (named, with how to give its files).
  """
  names: list[str] = []
  for spec in tasks:
    if os.path.isfile(os.path.expanduser(spec)):
      names.append(spec)
      continue
    found = manager.match_tasks([spec]) if spec not in manager.task_index else [spec]
    if not found:
      full = task_manager(include_path, defaults=True)
      if spec not in full.task_index:
        raise ValueError(
          f"{where} {spec}: no such task in lm-eval's tasks, the demo tasks or"
          f" {'--include_path' if where == '--tasks' else 'train.eval_include_path'}."
        )
      _check_local(full, spec)  # lm-eval's own task: its data is the Hub's
      found = [spec]
    names.extend(found)
  for name in names:
    _check_local(manager, name)
  return names


def _leaf_configs(manager: Any, name: str, seen: set[str]) -> list[tuple[str, dict]]:
  from lm_eval.tasks._index import Kind

  if os.path.isfile(os.path.expanduser(name)):
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(pathlib.Path(os.path.expanduser(name)), resolve_func=False)
    return (
      [(str(config.get("task", name)), config)]
      if "task" in config and "group" not in config
      else [leaf for member in config.get("task", []) for leaf in _member(manager, member, seen)]
    )
  entry = manager.task_index.get(name)
  if entry is None or name in seen:
    return []
  seen.add(name)
  if entry.kind == Kind.TAG:
    return [leaf for member in sorted(entry.tags) for leaf in _leaf_configs(manager, member, seen)]
  if entry.kind == Kind.GROUP:
    return [leaf for member in (entry.cfg or {}).get("task", []) for leaf in _member(manager, member, seen)]
  return [(name, entry.cfg or {})]


def _member(manager: Any, member: Any, seen: set[str]) -> list[tuple[str, dict]]:
  if isinstance(member, str):
    return _leaf_configs(manager, member, seen)
  if isinstance(member, dict) and isinstance(member.get("task"), str):
    base = manager.task_index.get(member["task"])
    return [(member["task"], {**((base.cfg or {}) if base else {}), **member})]
  return []


def _check_local(manager: Any, name: str) -> None:
  for task, config in _leaf_configs(manager, name, set()):
    if config.get("custom_dataset") or "class" in config:
      continue
    path = str(config.get("dataset_path") or "")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if path and os.path.exists(os.path.expanduser(path)):
      continue
    if path in _LOCAL_BUILDERS and files:
      missing = [f for f in _files(files) if not glob.glob(os.path.expanduser(f))]
      if missing:
        raise ValueError(
          f"task {task}: its data file {missing[0]!r} does not exist (dataset_kwargs.data_files;"
          " a relative path is read from the current directory)."
        )
      continue
    raise ValueError(
      f"task {task}: its data (dataset_path: {path or '?'}) would be downloaded, and eval runs"
      " offline; give its files as a local task — dataset_path: json with dataset_kwargs:"
      " {data_files: {test: FILE.jsonl}} in a YAML under --include_path."
    )


def _files(files: Any) -> list[str]:
  if isinstance(files, str):
    return [files]
  if isinstance(files, dict):
    return [f for value in files.values() for f in _files(value)]
  return [f for value in files for f in _files(value)] if isinstance(files, list) else []


def evaluate(
  lm: Any,
  tasks: Sequence[str],
  *,
  include_path: Sequence[str] = (),
  num_fewshot: int | None = None,
  limit: float | None = None,
  log_samples: bool = False,
  apply_chat_template: bool = False,
  fewshot_as_multiturn: bool = False,
  model_name: str = "distrib_train",
  evaluation_tracker: Any = None,
  manager: Any = None,
  bootstrap_iters: int = 100000,
) -> dict[str, Any]:
  """lm-eval's ``simple_evaluate`` of ``tasks`` (local, checked: ``resolve``) on ``lm`` (a ``HarnessLM``):
  its results dict, on every process."""
  import logging

  import lm_eval

  logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on task defaults, per task and call
  manager = manager or task_manager(include_path)
  names = resolve(manager, tasks, include_path)
  return lm_eval.simple_evaluate(
    model=lm,
    model_args={"pretrained": model_name},
    tasks=names,
    num_fewshot=num_fewshot,
    limit=limit,
    log_samples=log_samples,
    task_manager=manager,
    apply_chat_template=apply_chat_template,
    fewshot_as_multiturn=fewshot_as_multiturn,
    evaluation_tracker=evaluation_tracker,
    bootstrap_iters=bootstrap_iters,
  )


def scores(results: dict[str, Any]) -> dict[str, float]:
  """``{"eval/<task>/<metric>": value}`` of each task's numeric metrics (``acc``, ``word_perplexity``, …; the
  filter's name left out where it is ``none``, stderrs left out)."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      metric, comma, kind = key.partition(",")
      if comma and isinstance(value, (int, float)) and not isinstance(value, bool) and "_stderr" not in metric:
        out[f"eval/{task}/{metric if kind == 'none' else f'{metric}_{kind}'}"] = float(value)
  return out


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="distrib-train eval", description=__doc__.split("\n\n")[0])
  parser.add_argument("--tasks", required=True, help="task, group or tag names (or YAML paths), comma-separated")
  parser.add_argument("--include_path", action="append", default=[], help="a folder of task YAMLs (repeatable)")
  parser.add_argument("--num_fewshot", type=int, help="examples in each prompt (default: the task's)")
  parser.add_argument("--limit", type=float, help="documents per task (under 1: a fraction of them)")
  parser.add_argument("--batch_size", type=int, default=8, help="packed rows per forward call")
  parser.add_argument("--max_length", type=int, help="tokens of context (default: the model's, or the run's seq_len)")
  parser.add_argument("--output_path", help="where lm-eval's results JSON (and the samples) go")
  parser.add_argument("--log_samples", action="store_true", help="also write each sample (needs --output_path)")
  parser.add_argument("--apply_chat_template", action="store_true", help="prompts through the chat template")
  parser.add_argument("--fewshot_as_multiturn", action="store_true", help="few-shot examples as chat turns")
  run_model.add_flags(parser)
  args = parser.parse_args(list(argv))
  offline()
  tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
  try:
    from distrib_train.config import run as config_lib

    if args.log_samples and not args.output_path:
      raise ValueError("--log_samples needs --output_path (where lm-eval writes the samples).")
    if args.batch_size < 1 or (args.max_length is not None and args.max_length < 2):
      raise ValueError("--batch_size must be at least 1 and --max_length at least 2.")
    if not tasks:
      raise ValueError("--tasks names no task.")
    overrides = config_lib.parse_overrides(args.overrides)
    found = run_model.source(args.init_from, dtype=args.dtype, overrides=overrides)
    manager = task_manager(args.include_path)
    resolve(manager, tasks, args.include_path)  # before any weight is read
    from distrib_train.inference.text import codec_for

    codec_for(found)
  except ValueError as e:  # ConfigError and MissingPackageError are ValueErrors
    fail(str(e))
  first, say = run_model.start(args)
  try:
    from distrib_train.evaluation.harness import HarnessLM

    lm = HarnessLM(
      run_model.load(found, step=args.step, mesh_config=args.mesh_config),
      batch_size=args.batch_size,
      max_length=args.max_length,
      log=say,
    )
    tracker = None
    if args.output_path and first:
      from lm_eval.loggers import EvaluationTracker

      tracker = EvaluationTracker(output_path=args.output_path)
    results = evaluate(
      lm,
      tasks,
      include_path=args.include_path,
      num_fewshot=args.num_fewshot,
      limit=args.limit,
      log_samples=args.log_samples,
      apply_chat_template=args.apply_chat_template,
      fewshot_as_multiturn=args.fewshot_as_multiturn,
      model_name=args.init_from,
      evaluation_tracker=tracker,
      manager=manager,
    )
  except ValueError as e:
    fail(str(e))
  if first:
    _report(results, tracker, args)
  return 0


def _report(results: dict[str, Any], tracker: Any, args: argparse.Namespace) -> None:
  """lm-eval's table printed, its results JSON and samples written, as ``lm_eval`` does."""
  from lm_eval.utils import make_table

  samples = results.pop("samples", None) if args.log_samples else None
  if tracker is not None:
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
      for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
  print(
    f"distrib_train ({args.init_from}{'' if args.step is None else f', step {args.step}'}), limit: {args.limit},"
    f" num_fewshot: {args.num_fewshot}, batch_size: {args.batch_size}"
  )
  print(make_table(results))
  if "groups" in results:
    print(make_table(results, "groups"))
