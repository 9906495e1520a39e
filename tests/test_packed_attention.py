"""Packed rows for cuDNN (kernels/attention/cudnn.py), the rows the loader gives it (data/sequences.py,
data.max_documents_per_row), the GPU environment the trainer sets (cluster/gpu_environment.py) and its
memory refusals (train/checks.py).

The kernel itself runs on a Hopper GPU only: its values and gradients against XLA's are checked there by
``bench/gpu_attention.py``, and the program the CUDA compiler builds for it by
``test_podplan_gpu.py::test_packed_rows_compile_to_cudnn_packed_attention_without_a_length_by_length_array``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distrib_train.cluster import gpu_environment, hardware
from distrib_train.data import sequences
from distrib_train.kernels.attention import cudnn as cudnn_attention
from distrib_train.cluster import device_memory
from distrib_train.train import checks
from distrib_train.config import run as config_lib
from distrib_train.config import job as job_lib


def _runs(row):
  """(start, length) of each run of equal ids in a row."""
  starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
  return [(s, e - s) for s, e in zip(starts, starts[1:] + [len(row)])]


def test_segment_layout_gives_each_run_its_length_and_offset_padding_included():
  ids = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 0, 0]], np.int32)
  seqlen, offsets = jax.jit(cudnn_attention.segment_layout, static_argnums=1)(jnp.asarray(ids), 4)
  assert seqlen.shape == (3, 4) and offsets.shape == (3, 5) and seqlen.dtype == offsets.dtype == jnp.int32
  np.testing.assert_array_equal(seqlen[0], [3, 2, 1, 2])
  np.testing.assert_array_equal(offsets[0], [0, 3, 5, 6, -1])
  np.testing.assert_array_equal(seqlen[1], [8, -1, -1, -1])
  np.testing.assert_array_equal(offsets[1], [0, -1, -1, -1, -1])
  # Seven runs in four slots: the runs past the fourth join it (the loader never gives a row that many).
  np.testing.assert_array_equal(seqlen[2], [1, 1, 1, 5])
  np.testing.assert_array_equal(offsets[2], [0, 1, 2, 3, -1])


def test_random_rows_match_their_runs():
  rng = np.random.default_rng(0)
  ids = np.sort(rng.integers(0, 6, size=(16, 64)), axis=1)
  ids = np.where(ids == 0, 99, ids)  # padding last, as packed rows have it
  seqlen, offsets = cudnn_attention.segment_layout(jnp.asarray(ids), 8)
  for row, lengths, starts in zip(ids, np.asarray(seqlen), np.asarray(offsets)):
    runs = _runs(list(row))
    assert [(int(s), int(n)) for s, n in zip(starts, lengths) if n > 0] == runs
    assert (lengths[len(runs) :] == -1).all() and (starts[len(runs) :] == -1).all()


def test_the_loader_merges_documents_past_the_cap_into_one_run_of_weight_zero():
  tokens = np.arange(12, dtype=np.int32)
  segments = np.array([1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0], np.int32)
  packed = {"tokens": tokens, "tokens_segment_ids": segments, "tokens_positions": np.zeros(12, np.int32)}
  whole = sequences.shifted(packed)
  capped = sequences.shifted(packed, max_documents=3)
  np.testing.assert_array_equal(capped["segment_ids"], [1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 4])
  assert len(_runs(list(capped["segment_ids"]))) == 4  # three documents and the rest
  np.testing.assert_array_equal(capped["weights"][:6], whole["weights"][:6])  # the first three documents train
  assert not capped["weights"][6:].any()
  np.testing.assert_array_equal(sequences.shifted(packed, max_documents=5)["weights"], whole["weights"])


def test_the_trainer_keeps_rows_to_what_the_models_packed_attention_takes():
  """Only where cuDNN's packed layout runs (a Hopper GPU, attention auto or cudnn, no context axis); elsewhere
  a row holds any number of documents."""

  def cap(overrides=(), packed=True):
    config = config_lib.load("tiny", dict(overrides))
    return job_lib.data_config(config, config.model_recipe().config, packed=packed).max_documents_per_row

  assert cap() == 7 and cap(packed=False) == 0  # model.max_segments 8: 7 documents and the padding
  assert cap({"model.max_segments": "16"}) == 15
  assert cap({"data.max_documents_per_row": "3"}) == 3
  assert cap({"model.max_segments": "0"}) == 0
  assert cap({"data.packing": "false"}) == 0
  assert cap({"data.max_documents_per_row": "9"}, packed=False) == 9
  with pytest.raises(config_lib.ConfigError, match=r"data.max_documents_per_row=9 .* model.max_segments=8"):
    cap({"data.max_documents_per_row": "9"})
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  assert not job_lib.packed_attention(
    config_lib.load("tiny", {"model.attention": "cudnn"}).model_recipe().config, mesh
  )  # a CPU device
  with pytest.raises(ValueError, match="max_segments must be 0 .* or at least 2"):
    config_lib.load("tiny", {"model.max_segments": "1"}).model_recipe()


def test_the_gpu_environment_is_set_only_where_the_user_has_not():
  env = {"XLA_FLAGS": "--xla_gpu_autotune_level=2"}
  done = gpu_environment.prepare(env)
  assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == str(hardware.GPU_MEMORY_FRACTION) == "0.92"
  assert env["XLA_FLAGS"] == "--xla_gpu_autotune_level=2 --xla_gpu_enable_command_buffer=-CUDNN"
  assert len(done) == 2
  mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8", "XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
  assert gpu_environment.prepare(mine) == [] and mine == {
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8",
    "XLA_FLAGS": "--xla_gpu_enable_command_buffer=",
  }


class _Gpu:
  """A GPU's memory figures as JAX reports them (``Device.memory_stats()``), for the refusal's arithmetic."""

  platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    return {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_a_step_that_cannot_fit_the_gpu_is_refused_with_its_figures_and_the_levers():
  step = jax.jit(lambda x: (x @ x.T).sum()).lower(jnp.ones((256, 256))).compile()
  analysis = step.memory_analysis()
  need, allowance = device_memory.step_memory_need(analysis, 80 << 30)
  assert (
    allowance == int(0.03 * (80 << 30))
    and need
    == allowance
    + analysis.argument_size_in_bytes
    + (analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
    + analysis.temp_size_in_bytes
  )
  checks.check_step_fits(step, _Gpu(80 << 30))  # fits
  checks.check_step_fits(step, jax.devices()[0])  # a CPU device: no pool, nothing to check
  with pytest.raises(checks.TrainerSetupError) as refused:
    checks.check_step_fits(step, _Gpu(1 << 30))  # the allowance alone is 1 GiB
  message = str(refused.value)
  assert "\n" not in message and "does not fit NVIDIA H100 80GB HBM3" in message
  for lever in (
    "data.global_batch_size",
    "train.microbatches",
    "model.remat",
    "fsdp",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
  ):
    assert lever in message


def test_an_out_of_memory_error_mid_run_is_one_line_with_the_levers():
  error = jax.errors.JaxRuntimeError(
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 60.61GiB with"
    " allocator GPU_0_bfc.\nCurrent allocation summary follows.\n" + "chunk\n" * 50
  )
  line = device_memory.out_of_memory_message(error, 120)
  assert "\n" not in line and "at step 120" in line and "60.61GiB" in line and "last checkpoint is intact" in line
  assert "train.microbatches" in line
  assert device_memory.out_of_memory_message(ValueError("bad shape"), 3) is None
  # A storage service's quota (a checkpoint write to GCS, say) is not the device's memory.
  assert device_memory.out_of_memory_message(RuntimeError("RESOURCE_EXHAUSTED: rate limit exceeded"), 3) is None
