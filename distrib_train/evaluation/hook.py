"""``train.eval_tasks``: lm-evaluation-harness task scores of the live model, as a hook of the training loop.

  train:
    eval_tasks: [demo_choice, demo_perplexity]   # names, or YAML paths
    eval_tasks_every: 100                        # 0: only at the last step
    eval_include_path: my_tasks                  # more task YAMLs (optional)
    eval_tasks_limit: 50                         # documents per task (optional)

``check(config)`` runs in the trainer's set-up, before anything is written:
lm-eval installed, every task known and local (``eval_tasks.resolve``). At
each due step every process scores the live state (``harness.HarnessLM``
over the run's mesh and rules, its programs compiled at the first scoring
and kept) and process 0 logs ``eval/<task>/<metric>`` to ``metrics.jsonl``
and TensorBoard. The time is the ``eval_tasks`` phase, a goodput category.

Not for: scoring a checkpoint (``distrib-train eval``, ``eval_tasks.py``).
"""

from __future__ import annotations

import os
from typing import Any


def check(config: Any) -> None:
  """Refuses, in one line, tasks that cannot run (module docstring).

  Raises:
    ValueError: lm-eval missing, an unknown task or one whose data would be downloaded (named).
  """
  t = config.train
  if not t.eval_tasks:
    return
  from distrib_train.evaluation import tasks as eval_tasks

  eval_tasks.offline()
  os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's progress bars, in the run's log
  include = [t.eval_include_path] if t.eval_include_path else []
  eval_tasks.resolve(eval_tasks.task_manager(include), list(t.eval_tasks), include, where="train.eval_tasks")


def register(loop: Any, config: Any, plan: Any, rules: Any, writer: Any, phases: Any) -> None:
  """Adds the scoring hook to ``loop`` (a ``TrainLoop``) when ``train.eval_tasks`` names tasks."""
  t = config.train
  if not t.eval_tasks:
    return
  scorer: dict[str, Any] = {}

  def score(loop: Any) -> None:
    from distrib_train.objectives import dpo as objectives
    from distrib_train.evaluation import tasks as eval_tasks

    with phases.phase("eval_tasks"):
      model = objectives.policy_of(loop.state.model)
      if "lm" not in scorer:
        from distrib_train.evaluation.harness import HarnessLM
        from distrib_train.weights.load import RunModel

        source = t.init_from[3:] if t.init_from.startswith("hf:") else None
        scorer["lm"] = HarnessLM(RunModel(config, loop.state, plan, rules, "live", loop.step, source))
        include = [t.eval_include_path] if t.eval_include_path else []
        scorer["manager"], scorer["include"] = eval_tasks.task_manager(include), include
      lm = scorer["lm"]
      lm.set_state(model)
      results = eval_tasks.evaluate(
        lm,
        list(t.eval_tasks),
        include_path=scorer["include"],
        limit=t.eval_tasks_limit or None,
        manager=scorer["manager"],
        bootstrap_iters=0,
        model_name=f"step {loop.step}",
      )
      figures = eval_tasks.scores(results)
      writer.write(loop.step, figures)
      writer.log(f"Step {loop.step}: " + ", ".join(f"{k[5:]} {v:.4g}" for k, v in sorted(figures.items())))

  loop.hooks.add_hook(score, every=t.eval_tasks_every, pauses_clock=True)
