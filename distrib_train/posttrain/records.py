"""What a ``grpo`` run keeps and writes beside its checkpoints (``rollouts.py``'s source makes them).

- **The kept batch.** With ``grpo.num_iterations`` > 1 a batch of completions trains several steps; process 0
  keeps it (the rows and the policy's log-probabilities at generation time) in
  ``<workdir>/rollouts_batch/<step>/`` as raw arrays and a JSON of their dtypes and shapes (no pickle), for a
  run that resumes mid-way. The batches back to the oldest checkpoint's stay. Every process reads them: the
  workdir is shared, as the checkpoints' is.
- **``rollouts.jsonl``**: one line per completion (``LINE_KEYS``); a resumed run first drops the lines of the
  steps it trains again.
- **The figures** of a batch (``rollout/…`` in ``metrics.jsonl``).

Not for: making the batches (``rollouts.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LINE_KEYS = (
  "step",
  "prompt_index",
  "prompt",
  "completion",
  "completion_ids",
  "rewards",
  "reward",
  "advantage",
  "length",
  "truncated",
)


def _batch_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, "rollouts_batch", str(step))


def keep(workdir: str, step: int, host: Mapping[str, np.ndarray], oldest: int) -> None:
  """Writes the batch made at ``step`` whole or not at all (process 0), and removes the kept batches older than
  both ``step`` and ``oldest`` (the window of the oldest step a checkpoint tier may restore)."""
  final = _batch_path(workdir, step)
  temporary = final + ".tmp"
  shutil.rmtree(temporary, ignore_errors=True)
  os.makedirs(temporary)
  for name, value in host.items():
    np.ascontiguousarray(value).tofile(os.path.join(temporary, f"{name}.bin"))
  with open(os.path.join(temporary, "arrays.json"), "w", encoding="utf-8") as f:
    json.dump({name: [str(value.dtype), list(value.shape)] for name, value in host.items()}, f)
  shutil.rmtree(final, ignore_errors=True)
  os.replace(temporary, final)
  directory = os.path.dirname(final)
  for name in os.listdir(directory):
    if name.isdigit() and int(name) < min(oldest, step):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def read(workdir: str, step: int, num_iterations: int) -> dict[str, np.ndarray]:
  """The batch kept at ``step``.

  Raises:
    ValueError: it is missing (named).
  """
  path = _batch_path(workdir, step)
  if not os.path.isfile(os.path.join(path, "arrays.json")):
    raise ValueError(
      f"{path}: the rollouts of step {step} this run resumes within (grpo.num_iterations={num_iterations}) are missing."
    )
  with open(os.path.join(path, "arrays.json"), encoding="utf-8") as f:
    layout = json.load(f)
  return {
    name: np.fromfile(os.path.join(path, f"{name}.bin"), np.dtype(dtype)).reshape(shape)
    for name, (dtype, shape) in layout.items()
  }


def trim(workdir: str, step: int) -> None:
  """``rollouts.jsonl`` without the lines of the steps after ``step`` (a resumed run trains them again)."""
  path = os.path.join(workdir, "rollouts.jsonl")
  if not os.path.isfile(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
  if len(kept) != len(lines):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(path + ".tmp", path)


def figures(
  names: Sequence[str],
  values: np.ndarray,
  reward: np.ndarray,
  zero_std: np.ndarray,
  lengths: np.ndarray,
  truncated: np.ndarray,
  generated: float,
  seconds: float,
) -> dict[str, float]:
  """A batch's figures: the rewards (overall and per function, a function's ``None`` left out), the completions'
  lengths, the truncated share, the groups without spread, the sampler's time and tokens per second."""
  out = {
    "reward/mean": float(np.mean(reward)),
    "reward/std": float(np.std(reward, ddof=1)) if len(reward) > 1 else 0.0,
    "completions/mean_length": float(lengths.mean()),
    "completions/min_length": int(lengths.min()),
    "completions/max_length": int(lengths.max()),
    "completions/clipped_ratio": float(truncated.mean()),
    "frac_reward_zero_std": float(np.mean(zero_std)),
    "generation_seconds": generated,
    "generation_tokens_per_s": float(lengths.sum() / max(generated, 1e-9)),
    "seconds": seconds,
  }
  for j, name in enumerate(names):
    present = values[:, j][~np.isnan(values[:, j])]
    out[f"rewards/{name}/mean"] = float(present.mean()) if present.size else float("nan")
    out[f"rewards/{name}/std"] = float(present.std(ddof=1)) if present.size > 1 else 0.0
  return {f"rollout/{k}": v for k, v in out.items()}


def write_lines(workdir: str, lines: Sequence[Mapping[str, Any]]) -> None:
  """Appends ``lines`` (each with ``LINE_KEYS``) to ``rollouts.jsonl``."""
  with open(os.path.join(workdir, "rollouts.jsonl"), "a", encoding="utf-8") as f:
    for line in lines:
      f.write(json.dumps(dict(line)) + "\n")
