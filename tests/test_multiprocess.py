"""The same training run in 2 real processes × 4 devices and in 1 × 8."""

import pathlib

import numpy as np

import distrib_train as dt
import helpers
import mp_harness

_WORKERS = pathlib.Path(__file__).parent / "workers"
_CONFIGS = pathlib.Path(__file__).parents[1] / "mesh_configs"


def test_two_processes_match_one_process_with_eight_devices():
  steps = 6
  results = mp_harness.run_workers(_WORKERS / "train_small_model.py", str(steps), timeout=240)
  # The in-process reference: the same mesh shape over 8 local devices.
  config = dt.MeshConfig.from_yaml(_CONFIGS / "cpu-8.yaml")
  losses, params = helpers.train_small_model(dt.build_mesh(config), steps=steps)

  for r in results:
    assert r.result["mesh_shape"] == {"data": 2, "fsdp": 2, "tensor": 2}
    np.testing.assert_allclose(r.result["losses"], losses, rtol=1e-5, atol=1e-6)
    for name, value in params.items():
      np.testing.assert_allclose(np.asarray(r.result["params"][name]), value, rtol=1e-5, atol=1e-6, err_msg=name)
  assert losses[-1] < losses[0]


def test_harness_reports_a_failing_process_with_its_output(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text(
    "import os, sys\n"
    "if os.environ['DT_TEST_PROCESS_ID'] == '1':\n"
    "    print('worker one is failing on purpose'); sys.exit(3)\n"
    "import time; time.sleep(60)\n"
  )
  try:
    mp_harness.run_workers(script, timeout=30)
  except AssertionError as e:
    message = str(e)
  else:
    raise AssertionError("the harness did not report the failing process")
  assert "worker one is failing on purpose" in message
  assert "exit 3" in message


def test_harness_enforces_its_timeout(tmp_path):
  script = tmp_path / "hang.py"
  script.write_text("import time; time.sleep(60)\n")
  try:
    mp_harness.run_workers(script, timeout=2)
  except AssertionError as e:
    assert "timed out after 2 s" in str(e)
  else:
    raise AssertionError("the harness did not time out")
