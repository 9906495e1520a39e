"""A failed checkpoint read or write leaves nothing behind its one error: no future, task or coroutine with an
unretrieved exception, no in-flight read that wakes a closed loop (``faults.finish_event_loops_before_closing``)."""

import asyncio
import gc
import logging
import sys
import threading

import pytest

import distrib_train as dt
from distrib_train.checkpoint import checks, faults


def _echoes(run, monkeypatch, caplog):
  """What ``run`` leaves once the garbage collector has passed: asyncio's log records and unraisable errors."""
  unraisable = []
  monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    run()
    gc.collect()
  return [r.getMessage() for r in caplog.records if r.name == "asyncio"] + [str(u.exc_value) for u in unraisable]


def _read_like_orbax():
  """orbax's shape of a read (``asyncio_utils.run_sync``): a fresh loop, a gather of arrays, the loop closed as soon
  as the first array fails. The second array fails later, from another thread, as tensorstore's futures do.

  Returns whether that thread found the loop still open."""
  loop = asyncio.new_event_loop()
  slow = loop.create_future()
  closed = []

  async def array(fail_after):
    if fail_after:
      await slow
    raise ValueError("NOT_FOUND: Error reading zarr.json")

  async def read_all():
    await asyncio.gather(array(False), asyncio.gather(array(True)))

  def tensorstore_thread():
    try:
      loop.call_soon_threadsafe(lambda: slow.done() or slow.set_result(None))
    except RuntimeError:  # "Event loop is closed": where tensorstore prints its traceback
      closed.append(True)

  thread = threading.Timer(0.05, tensorstore_thread)
  thread.start()
  try:
    with pytest.raises(ValueError, match="NOT_FOUND"):
      loop.run_until_complete(read_all())
  finally:
    loop.close()
    thread.join()
  return not closed


@pytest.fixture
def finishing_policy():
  before = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(None)
  faults.finish_event_loops_before_closing()
  yield
  asyncio.set_event_loop_policy(before)


def test_a_default_loop_closed_on_a_gathered_failure_leaves_the_other_read_in_flight():
  """The cause, shown: asyncio's own loop, closed at the first failure, leaves the other read in flight, and its
  end wakes a closed loop (tensorstore then prints "Event loop is closed"; the abandoned task and its error are
  reported whenever the collector reaches them). The finishing loop below must prevent exactly this."""
  before = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(None)
  try:
    assert _read_like_orbax() is False
  finally:
    asyncio.set_event_loop_policy(before)


def test_a_finishing_loop_retrieves_every_gathered_failure_before_it_closes(finishing_policy, monkeypatch, caplog):
  woken = []
  assert _echoes(lambda: woken.append(_read_like_orbax()), monkeypatch, caplog) == []
  assert woken == [True]  # the in-flight read ended while the loop still ran


def _a_settled_future_nobody_reads(loop):
  """tensorstore's shape of an abandoned operation: a plain future made on the loop, settled with its error after
  the task that awaited it was gone, alive (in a reference cycle, as an error's traceback makes) when the loop
  closes."""
  future = loop.create_future()
  future.set_exception(ValueError("NOT_FOUND: Error reading zarr.json"))
  cycle = [future]
  cycle.append(cycle)
  loop.close()


def test_a_settled_future_nobody_awaits_is_read_when_a_finishing_loop_closes(finishing_policy, monkeypatch, caplog):
  assert _echoes(lambda: _a_settled_future_nobody_reads(asyncio.new_event_loop()), monkeypatch, caplog) == []


def test_a_settled_future_nobody_awaits_is_reported_by_asyncios_own_loop(monkeypatch, caplog):
  """The control: asyncio's own loop leaves that future's error to the collector, which reports it."""
  echoes = _echoes(
    lambda: _a_settled_future_nobody_reads(asyncio.DefaultEventLoopPolicy().new_event_loop()), monkeypatch, caplog
  )
  assert any("Future exception was never retrieved" in e for e in echoes)


def test_a_wake_up_that_reaches_a_finishing_loop_after_it_closed_is_dropped(finishing_policy):
  """The one echo no call of ours can retrieve: tensorstore ending an operation whose awaiting task orbax had
  already cancelled, after the loop closed. asyncio's own loop raises it in tensorstore's thread."""
  loop = asyncio.new_event_loop()
  loop.close()
  assert loop.call_soon_threadsafe(lambda: None) is None
  with pytest.raises(RuntimeError, match="Event loop is closed"):
    default = asyncio.DefaultEventLoopPolicy().new_event_loop()
    default.close()
    default.call_soon_threadsafe(lambda: None)


def test_another_programs_loop_policy_is_left_as_it_is():
  class Custom(asyncio.DefaultEventLoopPolicy):
    pass

  before = asyncio.get_event_loop_policy()
  try:
    asyncio.set_event_loop_policy(Custom())
    faults.finish_event_loops_before_closing()
    assert type(asyncio.get_event_loop_policy()) is Custom
  finally:
    asyncio.set_event_loop_policy(before)


def test_a_damaged_checkpoints_metadata_read_leaves_only_its_error(
  finishing_policy, tmp_path, monkeypatch, caplog, capfd
):
  """orbax's own read of a checkpoint whose OCDBT index is gone (the CI flake of issue 56): the one CheckpointError,
  and nothing printed or logged after it, the collector run."""
  import jax.numpy as jnp
  import optax

  state = dt.TrainState.create(params={"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}, tx=optax.adam(1e-3), apply_fn=None)
  with dt.CheckpointManager(tmp_path, async_save=False) as manager:
    manager.save(2, state, force=True)
  for path in (tmp_path / "2" / "state" / "d").iterdir():
    path.unlink()

  def read():
    with pytest.raises(checks.CheckpointError, match="has unreadable array metadata"):
      checks.saved_shapes(tmp_path, 2)

  for _ in range(5):
    assert _echoes(read, monkeypatch, caplog) == []
  assert capfd.readouterr().err == ""
