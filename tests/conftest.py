"""Test setup: 8 emulated CPU devices, set before jax is imported."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory):
  """A persistent compilation cache shared by the tests that run the trainer
  (in this process and in subprocesses): each distinct step compiles once."""
  return str(tmp_path_factory.mktemp("xla_cache"))
