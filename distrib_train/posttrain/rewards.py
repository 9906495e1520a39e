"""GRPO's rewards on the host: the reward functions a config names, their scores, and the group advantages.

``grpo.reward_funcs`` lists reward functions: the built-ins by name
(``accuracy``, ``format``, ``overlong``) or any ``package.module:function``.
Each keeps the signature of TRL's ``GRPOTrainer``:
``f(prompts, completions, completion_ids, **columns) -> list[float | None]``,
one reward per completion, ``None`` where the function does not apply, each
other column of the prompt records as a keyword argument (one entry per
completion). This module

- ``resolve``s the names into ``RewardFunc`` values, refusing a bad entry in
  one line before anything runs;
- ``score``s a batch of completions with each function: an ``[N, F]`` array,
  NaN for ``None``; a function that raises or returns something other than a
  finite number per completion is a ``RewardError`` line that names the
  function and the prompt;
- ``combine``s them into one reward per completion (weighted, NaN as 0) and
  turns those into ``advantages`` the way TRL's ``GRPOTrainer`` does.

Everything here is plain Python and numpy, run between generation and the
update step.

Not for: generating the completions (``generation/``), the policy loss and
its KL term (the objective on the devices), or the GRPO loop itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import os
import re
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from distrib_train.common import extras

BUILT_INS = ("accuracy", "format", "overlong")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: advantages are divided by (std + 1e-4)
MATH_TIMEOUT_S = 5  # math-verify's own default, per parse and per comparison
_MAX_MESSAGE_CHARS = 300  # of an exception's text in a RewardError line
_CALL_ARGS = ("prompts", "completions", "completion_ids")


class RewardError(ValueError):
  """A reward function failed: one line naming the function and the prompt's index."""


@dataclasses.dataclass(frozen=True)
class RewardFunc:
  """One entry of ``grpo.reward_funcs``, ready to call.

  Attributes:
    name: as the config spells it: ``accuracy``, or ``package.module:function``.
    fn: the function, called as ``fn(prompts=..., completions=..., completion_ids=..., **columns)``.
  """

  name: str
  fn: Callable[..., Any]


def completion_text(completion: Any) -> str:
  """The text of one completion: itself, or the first message's ``content`` when it is a list of messages."""
  if isinstance(completion, str):
    return completion
  if isinstance(completion, Sequence) and completion and isinstance(completion[0], Mapping):
    return str(completion[0]["content"])
  raise TypeError(f"a completion is text or a list of messages, got {type(completion).__name__}")


def _math_timeout() -> int | None:
  """math-verify's timeout where its ``signal.alarm`` is safe (the main thread, no alarm of another pending), else None.

  math-verify's timeouts are SIGALRM: they fail outside the main thread, and cancel any interval timer already
  set (pytest-timeout's, for one). Without them a pathological expression could make sympy take long.
  """
  if threading.current_thread() is not threading.main_thread() or os.name != "posix":
    return None
  if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
    return None
  return MATH_TIMEOUT_S


def _accuracy(math_verify: Any) -> Callable[..., list[float | None]]:
  """The ``accuracy`` reward: 1.0 where the completion's answer equals the ``solution`` column's, else 0.0."""

  def accuracy(prompts, completions, completion_ids, **columns) -> list[float | None]:
    del prompts, completion_ids
    if "solution" not in columns:
      raise ValueError("accuracy needs a 'solution' column in the prompt records")
    rewards: list[float | None] = []
    for completion, solution in zip(completions, columns["solution"], strict=True):
      timeout = _math_timeout()
      gold = math_verify.parse(str(solution), parsing_timeout=timeout) if solution is not None else []
      if not gold:  # nothing to compare against: the reward does not apply
        rewards.append(None)
        continue
      answer = math_verify.parse(completion_text(completion), parsing_timeout=timeout)
      rewards.append(1.0 if math_verify.verify(gold, answer, timeout_seconds=timeout) else 0.0)
    return rewards

  return accuracy


def _format(pattern: re.Pattern[str]) -> Callable[..., list[float]]:
  """The ``format`` reward: 1.0 where the whole completion matches ``pattern``, else 0.0."""

  def format_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    del prompts, completion_ids, columns
    return [1.0 if pattern.fullmatch(completion_text(c)) else 0.0 for c in completions]

  return format_reward


def _overlong(buffer: int, max_length: int) -> Callable[..., list[float]]:
  """The ``overlong`` reward: DAPO's soft punishment of completions within ``buffer`` tokens of ``max_length``."""
  safe = max_length - buffer

  def overlong(prompts, completions, completion_ids, **columns) -> list[float]:
    del prompts, completions, columns
    rewards = []
    for ids in completion_ids:
      length = len(ids)
      if length <= safe:
        rewards.append(0.0)
      elif length <= max_length:
        rewards.append((safe - length) / buffer)
      else:
        rewards.append(-1.0)
    return rewards

  return overlong


def _built_in(
  name: str, entry: str, *, format_pattern: str, overlong_buffer: int, max_completion_length: int, where: str
) -> Callable[..., Any]:
  if name == "accuracy":
    return _accuracy(extras.require("math_verify", f"{where}: accuracy"))
  if name == "format":
    try:
      pattern = re.compile(format_pattern, re.DOTALL)
    except (re.error, TypeError) as e:
      raise ValueError(
        f"grpo.format_pattern {format_pattern!r} is not a regular expression ({e}), for {entry}"
      ) from None
    return _format(pattern)
  if (
    isinstance(overlong_buffer, bool)
    or not isinstance(overlong_buffer, int)
    or not (1 <= overlong_buffer <= max_completion_length)
  ):
    raise ValueError(
      f"grpo.overlong_buffer must be a whole number of tokens from 1 to grpo.max_completion_length"
      f" ({max_completion_length}) for {entry}, got {overlong_buffer!r}"
    )
  return _overlong(overlong_buffer, max_completion_length)


def _imported(spelling: str, entry: str) -> Callable[..., Any]:
  """``module:function`` imported, or one line that says why not."""
  module_name, _, function = spelling.partition(":")
  module_name, function = module_name.strip(), function.strip()
  if not module_name or not function or ":" in function:
    raise ValueError(f"{entry}: give module:function, e.g. 'mypackage.rewards:length_penalty'")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
      raise ValueError(f"{entry}: no module named {e.name!r}") from None
    raise ValueError(f"{entry}: importing {module_name!r} failed: {_one_line(e)}") from None
  except Exception as e:  # noqa: BLE001 (a broken module of the user's: its error, in one line)
    raise ValueError(f"{entry}: importing {module_name!r} failed: {_one_line(e)}") from None
  if not hasattr(module, function):
    raise ValueError(f"{entry}: module {module_name!r} has no function {function!r}")
  fn = getattr(module, function)
  if not callable(fn):
    raise ValueError(f"{entry}: {module_name}.{function} is not callable (it is a {type(fn).__name__})")
  return fn


def resolve(
  names: Sequence[str],
  *,
  format_pattern: str,
  overlong_buffer: int,
  max_completion_length: int,
  where: str = "grpo.reward_funcs",
) -> list[RewardFunc]:
  """The reward functions ``names`` lists: built-ins by name, any other as ``module:function``, imported.

  Args:
    names: the config's list, e.g. ``["accuracy", "format", "mypackage.rewards:length_penalty"]``.
    format_pattern: the regular expression a whole completion must match for ``format`` (``re.DOTALL``).
    overlong_buffer: ``overlong``'s buffer, in tokens: from 1 to ``max_completion_length``.
    max_completion_length: the longest completion generated, in tokens.
    where: the config key the names came from, for the error lines.

  Returns:
    One ``RewardFunc`` per name, in order.

  Raises:
    ValueError: one line naming the bad entry (``grpo.reward_funcs[1] 'mymod:f': no module named 'mymod'``), an
      empty or repeated list, a bad ``format_pattern`` or ``overlong_buffer`` for the built-in that uses it;
      ``MissingPackageError`` (a ``ValueError``) for ``accuracy`` without math-verify.
  """
  if isinstance(names, str) or not isinstance(names, Sequence):
    raise ValueError(f"{where} must be a list of reward functions, got {names!r}")
  if not names:
    raise ValueError(
      f"{where} is empty: name at least one reward function ({', '.join(BUILT_INS)}, or module:function)"
    )
  funcs: list[RewardFunc] = []
  for i, name in enumerate(names):
    if not isinstance(name, str) or not name.strip():
      raise ValueError(f"{where}[{i}] must be a reward function's name, got {name!r}")
    name = name.strip()
    entry = f"{where}[{i}] {name!r}"
    if name in (f.name for f in funcs):
      raise ValueError(f"{entry} is listed twice (each function's rewards are logged under its name)")
    if name in BUILT_INS:
      fn = _built_in(
        name,
        entry,
        format_pattern=format_pattern,
        overlong_buffer=overlong_buffer,
        max_completion_length=max_completion_length,
        where=where,
      )
    elif ":" in name:
      fn = _imported(name, entry)
    else:
      raise ValueError(
        f"{where}[{i}]: unknown reward function {name!r}; built-ins: {', '.join(BUILT_INS)}, or give module:function"
      )
    funcs.append(RewardFunc(name, fn))
  return funcs


def _one_line(error: BaseException) -> str:
  """``TypeName: message`` on one line, the message cut to a few hundred characters."""
  text = " ".join(str(error).split())
  if len(text) > _MAX_MESSAGE_CHARS:
    text = text[:_MAX_MESSAGE_CHARS] + "…"
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _call(fn: Callable[..., Any], prompts, completions, completion_ids, columns, rows: Sequence[int]) -> Any:
  """``fn`` on the completions ``rows`` (fresh lists: a function that changes them changes nothing here)."""
  return fn(
    prompts=[prompts[r] for r in rows],
    completions=[completions[r] for r in rows],
    completion_ids=[completion_ids[r] for r in rows],
    **{key: [values[r] for r in rows] for key, values in columns.items()},
  )


def _failure(name: str, prompt_index: Sequence[int]) -> Callable[[int, str], RewardError]:
  """``failed(row, why)``: the one-line error for function ``name`` on completion ``row``."""
  return lambda row, why: RewardError(f"reward function {name!r} failed on prompt {prompt_index[row]}: {why}")


def score(
  funcs: Sequence[RewardFunc],
  prompts: Sequence[Any],
  completions: Sequence[Any],
  completion_ids: Sequence[Sequence[int]],
  columns: Mapping[str, Sequence[Any]],
  prompt_index: Sequence[int],
) -> np.ndarray:
  """Each function's reward for each completion.

  Args:
    funcs: from ``resolve``.
    prompts: one per completion (text, or a list of chat messages).
    completions: text, or ``[{"role": "assistant", "content": text}]`` where the prompt was messages.
    completion_ids: each completion's token ids.
    columns: the prompt records' other columns, one entry per completion each, passed as keyword arguments.
    prompt_index: each completion's prompt's index (in the data), for the error lines.

  Returns:
    ``[N, F]`` float64: row ``i`` is completion ``i``, column ``j`` is ``funcs[j]``; NaN where it returned None.

  Raises:
    RewardError: a function raised, or returned other than one finite number (or None) per completion:
      ``reward function 'mymod:f' failed on prompt 12: ZeroDivisionError: division by zero``. Where it raised on
      the whole batch, it is called again on each completion alone, and the first that fails is the one named.
    ValueError: the inputs' lengths differ, or a column is named like one of the call's own arguments.
  """
  n = len(completions)
  for label, values in [
    ("prompts", prompts),
    ("completion_ids", completion_ids),
    ("prompt_index", prompt_index),
    *((f"column {key!r}", v) for key, v in columns.items()),
  ]:
    if len(values) != n:
      raise ValueError(f"reward scoring: {len(values)} {label} for {n} completions")
  if clash := sorted(set(columns) & set(_CALL_ARGS)):
    raise ValueError(f"reward scoring: a column is named {clash[0]!r}, a reward function's own argument")
  rewards = np.full((n, len(funcs)), np.nan, dtype=np.float64)
  if n == 0:
    return rewards
  everything = range(n)
  for j, func in enumerate(funcs):
    failed = _failure(func.name, prompt_index)
    try:
      values = _call(func.fn, prompts, completions, completion_ids, columns, everything)
    except Exception as batch_error:  # noqa: BLE001 (the user's function: find the completion and say so)
      for row in everything:
        try:
          _call(func.fn, prompts, completions, completion_ids, columns, [row])
        except Exception as error:  # noqa: BLE001
          raise failed(row, _one_line(error)) from error
      raise failed(0, _one_line(batch_error)) from batch_error
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
      raise failed(0, f"returned a {type(values).__name__}, not a list of {n} rewards")
    if len(values) != n:
      raise failed(0, f"returned {len(values)} rewards for {n} completions")
    for row, value in enumerate(values):
      if value is None:
        continue
      if not isinstance(value, numbers.Real) or not math.isfinite(value):
        text = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        raise failed(row, f"returned {text}, not a finite number (or None where the reward does not apply)")
      rewards[row, j] = float(value)
  return rewards


def combine(rewards: np.ndarray, weights: Sequence[float] | None) -> np.ndarray:
  """One reward per completion: the weighted sum over functions, a NaN (None) counted as 0 (TRL's ``nansum``).

  Args:
    rewards: ``[N, F]``, from ``score``.
    weights: one per function; None weighs each 1.

  Returns:
    ``[N]`` float64.

  Raises:
    ValueError: not one finite weight per function.
  """
  rewards = np.asarray(rewards, dtype=np.float64)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must be [completions, functions], got shape {rewards.shape}")
  if weights is None:
    w = np.ones(rewards.shape[1])
  else:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (rewards.shape[1],) or not np.all(np.isfinite(w)):
      raise ValueError(
        f"reward weights must be {rewards.shape[1]} finite numbers, one per reward function, got {list(weights)}"
      )
  return np.nansum(rewards * w, axis=1)


def advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str) -> tuple[np.ndarray, np.ndarray]:
  """TRL ``GRPOTrainer``'s advantages: each reward less its group's mean, scaled by a standard deviation.

  Rows come in consecutive groups of ``num_generations``, one prompt's completions each. The standard deviation is
  the unbiased one (``ddof=1``, torch's default), and the division is by ``std + 1e-4``.

  Args:
    rewards: ``[N]``, from ``combine``; N a multiple of ``num_generations``.
    num_generations: completions per prompt, at least 2.
    scale_rewards: ``group`` (the group's std), ``batch`` (the std of all N rewards) or ``none`` (not scaled).

  Returns:
    ``(advantages, zero_std)``: ``[N]`` float64, and ``[N]`` bool, True where the std of the row (its group's for
    ``group`` and ``none``, the batch's for ``batch``) is close to 0 (``np.isclose``): rows that teach nothing.

  Raises:
    ValueError: bad ``num_generations``, ``scale_rewards``, shape, or a non-finite reward.
  """
  if scale_rewards not in SCALE_REWARDS:
    raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
  rewards = np.asarray(rewards, dtype=np.float64)
  if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
    raise ValueError(f"num_generations must be a whole number of at least 2, got {num_generations!r}")
  if rewards.ndim != 1 or rewards.shape[0] % num_generations:
    raise ValueError(
      f"rewards must be [N] with N a multiple of num_generations ({num_generations}), got shape {rewards.shape}"
    )
  if not np.all(np.isfinite(rewards)):
    raise ValueError("rewards must be finite to compute advantages")
  groups = rewards.reshape(-1, num_generations)
  mean = np.repeat(groups.mean(axis=1), num_generations)
  if scale_rewards == "batch":
    std = np.full_like(rewards, rewards.std(ddof=1))
  else:
    std = np.repeat(groups.std(axis=1, ddof=1), num_generations)
  centered = rewards - mean
  scaled = centered if scale_rewards == "none" else centered / (std + STD_EPSILON)
  return scaled, np.isclose(std, 0.0)
