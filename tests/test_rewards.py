"""GRPO's rewards: the built-in reward functions, ``module:function`` ones, scoring and its one-line errors, the
weighted sum, and TRL's group advantages against numbers worked out here by hand.

No jax: ``distrib_train.posttrain.rewards`` is plain Python and numpy.
"""

import math
import statistics
import sys
import textwrap
import threading

import numpy as np
import pytest

from distrib_train.common.extras import MissingPackageError
from distrib_train.posttrain import rewards
from distrib_train.posttrain.rewards import RewardError, advantages, combine, resolve, score

PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"
USER_MODULE = "dt_test_user_rewards"


def _resolve(names, **overrides):
  kwargs = dict(format_pattern=PATTERN, overlong_buffer=4, max_completion_length=10)
  return resolve(names, **{**kwargs, **overrides})


def _call(func, completions, completion_ids=None, **columns):
  ids = completion_ids if completion_ids is not None else [[1, 2]] * len(completions)
  return func.fn(prompts=["q"] * len(completions), completions=completions, completion_ids=ids, **columns)


def _score(funcs, completions, columns=None, prompt_index=None):
  n = len(completions)
  return score(
    funcs,
    ["q"] * n,
    completions,
    [[1, 2]] * n,
    columns or {},
    prompt_index if prompt_index is not None else list(range(n)),
  )


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  """A module of reward functions on sys.path, as a user's package would be."""
  (tmp_path / f"{USER_MODULE}.py").write_text(
    textwrap.dedent("""
      import math

      NOT_A_FUNCTION = 3

      def length(prompts, completions, completion_ids, **columns):
        return [float(len(ids)) for ids in completion_ids]

      def only_tagged(prompts, completions, completion_ids, tag, **columns):
        return [1.0 if t == "math" else None for t in tag]

      def divides(prompts, completions, completion_ids, divisor, **columns):
        return [1 / d for d in divisor]

      def multiline_error(prompts, completions, completion_ids, **columns):
        raise RuntimeError("first line\\nsecond line\\n  third")

      def batch_only_error(prompts, completions, completion_ids, **columns):
        if len(completions) > 1:
          raise MemoryError("too many at once")
        return [0.0]

      def one_short(prompts, completions, completion_ids, **columns):
        return [0.0] * (len(completions) - 1)

      def a_number(prompts, completions, completion_ids, **columns):
        return 1.0

      def nan_on_second(prompts, completions, completion_ids, **columns):
        return [0.0, math.nan] + [0.0] * (len(completions) - 2)

      def inf_first(prompts, completions, completion_ids, **columns):
        return [math.inf] * len(completions)

      def text_rewards(prompts, completions, completion_ids, **columns):
        return ["1.0"] * len(completions)
  """)
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  yield USER_MODULE
  sys.modules.pop(USER_MODULE, None)


# The built-ins.


def test_accuracy_compares_the_answer_with_the_solution_by_math_verify():
  pytest.importorskip("math_verify", reason="accuracy needs math-verify: pip install 'distrib_train[rl]'")
  [accuracy] = _resolve(["accuracy"])
  completions = ["7", "\\boxed{7}", "8", "The answer is $\\boxed{7}$.", "7", "7"]
  solutions = ["7", "7", "7", "7", "no answer here", None]
  assert _call(accuracy, completions, solution=solutions) == [1.0, 1.0, 0.0, 1.0, None, None]
  messages = [[{"role": "assistant", "content": "so \\boxed{7}"}], [{"role": "assistant", "content": "8"}]]
  assert _call(accuracy, messages, solution=["7", "7"]) == [1.0, 0.0]
  assert _call(accuracy, ["0.5"], solution=["$\\frac{1}{2}$"]) == [1.0]


def test_accuracy_works_off_the_main_thread():
  # math-verify's timeouts are SIGALRM, which only the main thread may set: elsewhere they are off, not an error.
  pytest.importorskip("math_verify", reason="accuracy needs math-verify: pip install 'distrib_train[rl]'")
  [accuracy] = _resolve(["accuracy"])
  out = {}

  def run():
    out["r"] = _call(accuracy, ["\\boxed{7}", "8"], solution=["7"] * 2)

  thread = threading.Thread(target=run)
  thread.start()
  thread.join(60)
  assert out["r"] == [1.0, 0.0]


def test_math_verify_timeouts_only_where_its_alarm_is_safe(monkeypatch):
  monkeypatch.setattr(rewards.signal, "getitimer", lambda which: (0.0, 0.0))
  assert rewards._math_timeout() == rewards.MATH_TIMEOUT_S  # the main thread, no timer set
  out = {}
  thread = threading.Thread(target=lambda: out.setdefault("timeout", rewards._math_timeout()))
  thread.start()
  thread.join(10)
  assert out == {"timeout": None}
  monkeypatch.setattr(rewards.signal, "getitimer", lambda which: (30.0, 0.0))  # pytest-timeout's, say: kept
  assert rewards._math_timeout() is None


def test_accuracy_needs_a_solution_column():
  pytest.importorskip("math_verify", reason="accuracy needs math-verify: pip install 'distrib_train[rl]'")
  [accuracy] = _resolve(["accuracy"])
  with pytest.raises(ValueError, match="accuracy needs a 'solution' column in the prompt records"):
    _call(accuracy, ["7"], answer=["7"])
  with pytest.raises(RewardError, match="^reward function 'accuracy' failed on prompt 5: ValueError: accuracy needs"):
    _score([accuracy], ["7", "8"], {"answer": ["7", "7"]}, prompt_index=[5, 5])


def test_accuracy_without_math_verify_names_the_rl_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify raises ImportError
  with pytest.raises(MissingPackageError, match=r"^grpo.reward_funcs: accuracy needs .*distrib_train\[rl\]"):
    _resolve(["format", "accuracy"])
  assert [f.name for f in _resolve(["format"])] == ["format"]  # only accuracy needs it


def test_format_matches_the_whole_completion_across_lines():
  [fmt] = _resolve(["format"])
  good = "<think>\nstep 1\nstep 2\n</think>\n<answer>7</answer>"
  assert _call(fmt, [good, good + " and more", "<answer>7</answer>", ""]) == [1.0, 0.0, 0.0, 0.0]
  assert _call(fmt, [[{"role": "assistant", "content": good}]]) == [1.0]
  with pytest.raises(ValueError, match=r"^grpo.format_pattern '\(<think>' is not a regular expression"):
    _resolve(["format"], format_pattern="(<think>")
  assert _resolve(["overlong"], format_pattern="(<think>")  # a pattern no function uses is not read


def test_overlong_is_dapos_soft_punishment():
  [overlong] = _resolve(["overlong"], overlong_buffer=4, max_completion_length=10)
  lengths = [0, 6, 7, 8, 9, 10, 11, 50]  # safe up to 10 - 4 = 6, then (6 - L) / 4 down to -1 at 10, then -1
  got = _call(overlong, ["x"] * len(lengths), completion_ids=[[0] * n for n in lengths])
  assert got == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
  [whole] = _resolve(["overlong"], overlong_buffer=10, max_completion_length=10)  # the buffer may be all of it
  assert _call(whole, ["x"] * 3, completion_ids=[[], [0] * 5, [0] * 10]) == [0.0, -0.5, -1.0]
  for bad in (0, 11, -1, 2.5, True):
    with pytest.raises(ValueError, match="^grpo.overlong_buffer must be .* from 1 to grpo.max_completion_length"):
      _resolve(["overlong"], overlong_buffer=bad)
  assert _resolve(["format"], overlong_buffer=0)  # read only for overlong


# resolve.


def test_resolve_imports_module_function(user_module):
  funcs = _resolve(["format", f"{user_module}:length", f" {user_module}:only_tagged "])
  assert [f.name for f in funcs] == ["format", f"{user_module}:length", f"{user_module}:only_tagged"]
  assert funcs[1].fn is sys.modules[user_module].length
  assert rewards.BUILT_INS == ("accuracy", "format", "overlong")


@pytest.mark.parametrize(
  "entry, message",
  [
    (
      "foo",
      "grpo.reward_funcs[1]: unknown reward function 'foo'; built-ins: accuracy, format, overlong, or give"
      " module:function",
    ),
    (
      "dt_no_such_module_xyz:f",
      "grpo.reward_funcs[1] 'dt_no_such_module_xyz:f': no module named 'dt_no_such_module_xyz'",
    ),
    (
      "dt_no_such_pkg_xyz.sub:f",
      "grpo.reward_funcs[1] 'dt_no_such_pkg_xyz.sub:f': no module named 'dt_no_such_pkg_xyz'",
    ),
    ("{m}:missing", "grpo.reward_funcs[1] '{m}:missing': module '{m}' has no function 'missing'"),
    ("{m}:NOT_A_FUNCTION", "grpo.reward_funcs[1] '{m}:NOT_A_FUNCTION': {m}.NOT_A_FUNCTION is not callable"),
    ("{m}:", "grpo.reward_funcs[1] '{m}:': give module:function"),
    ("format", "grpo.reward_funcs[1] 'format' is listed twice"),
  ],
)
def test_resolve_refuses_a_bad_entry_in_one_line(user_module, entry, message):
  entry, message = entry.format(m=user_module), message.format(m=user_module)
  with pytest.raises(ValueError) as raised:
    _resolve(["format", entry])
  assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_resolve_refuses_an_empty_list_and_a_broken_module(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="^grpo.reward_funcs is empty"):
    _resolve([])
  with pytest.raises(ValueError, match="^grpo.reward_funcs must be a list"):
    _resolve("format")
  (tmp_path / "dt_test_broken_rewards.py").write_text("import dt_no_such_dependency_xyz\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(
    ValueError,
    match="^grpo.reward_funcs\\[0\\] 'dt_test_broken_rewards:f': importing"
    " 'dt_test_broken_rewards' failed: ModuleNotFoundError: No module named"
    " 'dt_no_such_dependency_xyz'$",
  ):
    _resolve(["dt_test_broken_rewards:f"])


# score.


def test_score_is_one_column_per_function_and_none_is_nan(user_module):
  funcs = _resolve([f"{user_module}:length", f"{user_module}:only_tagged", "overlong"])
  ids = [[0] * 3, [0] * 8]
  got = score(funcs, ["p0", "p1"], ["a", "b"], ids, {"tag": ["math", "code"]}, [0, 0])
  assert got.dtype == np.float64 and got.shape == (2, 3)
  np.testing.assert_array_equal(got, [[3.0, 1.0, 0.0], [8.0, np.nan, -0.5]])
  assert _score(funcs, [], {"tag": []}, prompt_index=[]).shape == (0, 3)


def test_score_names_the_function_and_the_prompt_it_raised_on(user_module):
  funcs = _resolve(["format", f"{user_module}:divides"])
  with pytest.raises(RewardError) as raised:
    _score(funcs, ["a", "b", "c", "d"], {"divisor": [1, 2, 0, 0]}, prompt_index=[10, 10, 11, 11])
  assert str(raised.value) == (
    f"reward function '{user_module}:divides' failed on prompt 11: ZeroDivisionError: division by zero"
  )
  assert isinstance(raised.value.__cause__, ZeroDivisionError)
  assert isinstance(raised.value, ValueError)


def test_score_names_the_first_prompt_when_no_completion_fails_alone(user_module):
  funcs = _resolve([f"{user_module}:batch_only_error"])
  with pytest.raises(
    RewardError,
    match=f"^reward function '{user_module}:batch_only_error' failed on prompt 7: MemoryError: too many at once$",
  ):
    _score(funcs, ["a", "b"], prompt_index=[7, 8])


def test_a_raising_function_is_one_line(user_module):
  funcs = _resolve([f"{user_module}:multiline_error"])
  with pytest.raises(RewardError) as raised:
    _score(funcs, ["a", "b"], prompt_index=[3, 4])
  line = str(raised.value)
  assert "\n" not in line
  assert (
    line == f"reward function '{user_module}:multiline_error' failed on prompt 3: RuntimeError: first line"
    " second line third"
  )


@pytest.mark.parametrize(
  "function, row, why",
  [
    ("one_short", 0, "returned 2 rewards for 3 completions"),
    ("a_number", 0, "returned a float, not a list of 3 rewards"),
    ("nan_on_second", 1, "returned nan, not a finite number"),
    ("inf_first", 0, "returned inf, not a finite number"),
    ("text_rewards", 0, "returned '1.0', not a finite number"),
  ],
)
def test_score_refuses_what_is_not_one_finite_number_per_completion(user_module, function, row, why):
  prompt_index = [20, 21, 22]
  with pytest.raises(RewardError) as raised:
    _score(_resolve([f"{user_module}:{function}"]), ["a", "b", "c"], prompt_index=prompt_index)
  assert str(raised.value).startswith(
    f"reward function '{user_module}:{function}' failed on prompt {prompt_index[row]}: {why}"
  )
  assert "\n" not in str(raised.value)


def test_score_refuses_inputs_of_different_lengths(user_module):
  funcs = _resolve([f"{user_module}:length"])
  with pytest.raises(ValueError, match="1 column 'tag' for 2 completions"):
    _score(funcs, ["a", "b"], {"tag": ["math"]})
  with pytest.raises(ValueError, match="a column is named 'completions'"):
    _score(funcs, ["a", "b"], {"completions": ["x", "y"]})


# combine and advantages.


def test_combine_is_the_weighted_nansum():
  r = np.array([[1.0, np.nan], [np.nan, np.nan], [0.5, 2.0]])
  np.testing.assert_array_equal(combine(r, [2.0, 0.5]), [2.0, 0.0, 0.5 * 2.0 + 2.0 * 0.5])
  np.testing.assert_array_equal(combine(r, None), [1.0, 0.0, 2.5])
  with pytest.raises(ValueError, match="2 finite numbers, one per reward function"):
    combine(r, [1.0])
  with pytest.raises(ValueError, match="2 finite numbers"):
    combine(r, [1.0, math.nan])


REWARDS = [1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0, 0.0, 2.0, 4.0, 6.0]  # three prompts, four completions each


def _by_hand(scale):
  groups = [REWARDS[i : i + 4] for i in range(0, len(REWARDS), 4)]
  batch_std = statistics.stdev(REWARDS)
  adv, zero = [], []
  for group in groups:
    mean, std = statistics.mean(group), statistics.stdev(group)  # stdev: the unbiased (n - 1) one
    used = {"group": std, "batch": batch_std, "none": std}[scale]
    for r in group:
      adv.append(r - mean if scale == "none" else (r - mean) / (used + 1e-4))
      zero.append(math.isclose(used, 0.0, abs_tol=1e-8))
  return adv, zero


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl_by_hand(scale):
  adv, zero_std = advantages(np.array(REWARDS), 4, scale)
  want_adv, want_zero = _by_hand(scale)
  assert adv.dtype == np.float64 and zero_std.dtype == bool
  np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(zero_std, want_zero)


def test_advantages_of_the_first_group_spelled_out():
  adv, zero_std = advantages(np.array(REWARDS), 4, "group")
  std = math.sqrt(((1 - 0.5) ** 2 * 4) / 3)  # [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3)
  np.testing.assert_allclose(
    adv[:4], [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4)], rtol=1e-12
  )
  np.testing.assert_array_equal(adv[4:8], [0.0] * 4)  # [3, 3, 3, 3]: nothing to learn
  assert zero_std.tolist() == [False] * 4 + [True] * 4 + [False] * 4
  _, batch_zero = advantages(np.array(REWARDS), 4, "batch")
  assert not batch_zero.any()  # the batch's std is not 0, so no row is flagged under batch scaling
  _, all_same = advantages(np.full(8, 2.0), 4, "batch")
  assert all_same.all()


def test_advantages_refuse_bad_arguments():
  with pytest.raises(ValueError, match="scale_rewards must be one of group, batch, none"):
    advantages(np.zeros(4), 4, "mean")
  with pytest.raises(ValueError, match="multiple of num_generations"):
    advantages(np.zeros(6), 4, "group")
  with pytest.raises(ValueError, match="at least 2"):
    advantages(np.zeros(4), 1, "group")
  with pytest.raises(ValueError, match="finite"):
    advantages(np.array([0.0, np.nan]), 2, "group")
