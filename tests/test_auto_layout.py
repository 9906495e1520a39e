"""``mesh_config: auto``: the trainer chooses its layout by compiling candidates on the job's own devices."""

import io
import json
import pathlib

import numpy as np
import pytest

import mp_harness
from distrib_train.podplan import auto
from distrib_train.config import run as config_lib
from distrib_train.podplan import layout_choice
from distrib_train.train.trainer import Trainer, TrainerSetupError

_WORKERS = pathlib.Path(__file__).resolve().parent / "workers"


SMALL = [
  "model.remat=full",
  "data.seq_len=32",
  "data.global_batch_size=8",
  "train.steps=3",
  "train.log_every=1",
  "train.eval_every=0",
  "train.checkpoint_every=0",
  "train.async_checkpoint=false",
  "optimizer.warmup_steps=0",
  "train.layout_compiles=3",
]


@pytest.fixture
def small_config(xla_cache):
  return lambda *overrides: config_lib.load("tiny", [*SMALL, f"train.compilation_cache_dir={xla_cache}", *overrides])


def _losses(workdir):
  return [r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_auto_trains_as_the_layout_it_chose_given_by_hand_and_keeps_it_for_a_restart(tmp_path, small_config):
  said = []
  search = lambda config, workdir: auto.search(config, workdir, say=said.append)
  console = io.StringIO()
  result = Trainer(small_config("mesh_config=auto"), tmp_path / "auto", layout_search=search, console=console).run()
  assert result.status == "finished"
  kept = json.loads((tmp_path / "auto" / layout_choice.FILE_NAME).read_text())
  assert {k: v for k, v in kept["signature"].items() if k != "job"} == {
    "devices": 8,
    "device_kind": "cpu",
    "platform": "cpu",
    "processes": 1,
  }
  assert kept["searched"]["compiled"] == 3 and len(kept["searched"]["finalists"]) >= 2, kept
  assert "mesh_config: auto chose " in console.getvalue() and "runner-up" in kept["line"], console.getvalue()
  assert said[1].startswith("meshes: compiling 1/") and said[-1].startswith("settings: compiled 3/3"), said
  goodput = json.loads((tmp_path / "auto" / "goodput.json").read_text())
  assert goodput["runs"][0]["seconds"]["layout_search"] > 0
  # the same run on the chosen mesh and settings, given by hand: the same losses
  mesh_file = tmp_path / "auto" / layout_choice.MESH_FILE_NAME
  settings = [f"{k}={v}" for k, v in kept["settings"].items()]
  Trainer(small_config(f"mesh_config={mesh_file}", *settings), tmp_path / "by_hand", console=io.StringIO()).run()
  np.testing.assert_allclose(_losses(tmp_path / "auto"), _losses(tmp_path / "by_hand"), rtol=1e-6)
  # a restart on the same devices reads the choice back, no search (here through the default search, podplan's)
  console = io.StringIO()
  Trainer(small_config("mesh_config=auto", "train.steps=4"), tmp_path / "auto", console=console).run()
  assert "reused from" in console.getvalue(), console.getvalue()
  assert json.loads((tmp_path / "auto" / layout_choice.FILE_NAME).read_text()) == kept  # left as it was
  # nor after the job changes (here its sequence length), nor another machine's
  config = small_config("mesh_config=auto")
  assert layout_choice.kept(tmp_path / "auto", config) is not None
  assert layout_choice.kept(tmp_path / "auto", small_config("mesh_config=auto", "data.seq_len=64")) is None
  kept["signature"]["devices"] = 16
  (tmp_path / "auto" / layout_choice.FILE_NAME).write_text(json.dumps(kept))
  assert layout_choice.kept(tmp_path / "auto", config) is None


def test_auto_with_a_model_given_as_code_is_refused_before_the_workdir(tmp_path, small_config):
  recipe = small_config().model_recipe()
  with pytest.raises(TrainerSetupError, match="a model given as code"):
    Trainer(
      small_config("mesh_config=auto"),
      tmp_path / "run",
      model_fn=recipe.config.build,
      loss_fn=recipe.loss_fn,
      input_axes=recipe.input_axes,
      layout_search=auto.search,
    ).run()
  assert not (tmp_path / "run").exists()


def test_two_processes_agree_on_one_choice(tmp_path):
  """Both search and time the finalists process 0 names; process 0 keeps the choice in its own workdir; searching again, process 1 (whose workdir
  holds nothing) takes process 0's kept choice too."""
  results = mp_harness.run_workers(_WORKERS / "auto_layout_worker.py", str(tmp_path), timeout=300)
  first, second = (r.result for r in results)
  assert first == second and first["settings"] and first["processes"] == 2, results
  assert "measured over 1 steps each" in first["line"], first
  assert first["again"]["reused"] and first["again"]["ici"] == first["ici"], first


def test_the_settings_searched_start_from_the_presets_and_add_kernels_and_fp8_where_timed_steps_can_rank_them(
  small_config,
):
  from distrib_train.cluster import hardware

  cpu, h100, v5p = auto.device_kind(), hardware.device_kind("h100"), hardware.device_kind("v5p")
  config = small_config("model.remat=full", "train.microbatches=2")
  assert [k for k, _ in auto.dimensions(config, cpu, timing=True)] == ["model.remat", "train.microbatches"]
  assert dict(auto.dimensions(config, v5p, timing=True))["model.attention"] == ("auto", "xla")  # no FP8 on a TPU
  assert "model.fp8" not in dict(auto.dimensions(config, h100, timing=True))  # only where the preset allows it
  allowed = small_config("train.layout_fp8=true", "model.attention=cudnn")
  dims = dict(auto.dimensions(allowed, h100, timing=True))
  assert dims["model.attention"] == ("cudnn", "xla") and dims["model.fp8"] == ("none", "current")
  # the estimate cannot rank kernels or FP8 (it counts FLOPs and collectives): untimed, neither is searched
  assert [k for k, _ in auto.dimensions(allowed, h100)] == ["model.remat", "train.microbatches"]
  space = auto.settings_space(config, cpu)
  assert space[0] == {"model.remat": "full", "train.microbatches": 2}  # the preset's own first
  assert len(space) == 3 * 3 and len({json.dumps(s, sort_keys=True) for s in space}) == 9
  changed = [sum(s[k] != space[0][k] for k in s) for s in space]
  assert changed == sorted(changed), space  # fewer changes first
  timed_space = auto.settings_space(allowed, h100, timing=True)
  assert [next(k for k in s if s[k] != timed_space[0][k]) for s in timed_space[1:4]] == ["model.remat"] * 2 + [
    "model.attention"
  ], timed_space[:4]  # of single changes, the remat's first
  # not tried: what differs from settings that fit only by more microbatches or a heavier remat
  fit = {"model.remat": "dots_saveable", "model.attention": "xla", "train.microbatches": 2}
  assert auto.outrun({**fit, "model.remat": "full"}, [fit]) and auto.outrun({**fit, "train.microbatches": 4}, [fit])
  assert not auto.outrun({**fit, "model.remat": "none"}, [fit])  # lighter: it may fit too, and be faster
  assert not auto.outrun({**fit, "model.remat": "none", "train.microbatches": 4}, [fit])  # lighter, more passes
  assert not auto.outrun({**fit, "model.remat": "full", "model.attention": "cudnn"}, [fit])  # another kernel
  # timed: the best estimate of each kernel first (the estimate cannot rank kernels), then the next estimates
  finalists = [
    (name, {"model.attention": kernel, "model.remat": remat})
    for name, kernel, remat in (
      ("a", "auto", "none"),
      ("b", "auto", "full"),
      ("c", "xla", "none"),
      ("d", "auto", "dots_saveable"),
    )
  ]
  assert [name for name, _ in auto._to_time(finalists)] == ["a", "c", "b"]


def test_on_an_accelerator_the_fastest_estimates_run_timed_steps_and_the_shortest_measured_wins(tmp_path, small_config):
  """The timed path (an accelerator's) forced on the CPU devices: each of the fastest estimates runs its steps
  on its own mesh, and the choice is the shortest measured."""
  said = []
  choice = auto.search(small_config("mesh_config=auto"), tmp_path, max_compiles=3, timed_steps=2, say=said.append)
  timed = [line for line in said if line.startswith("timed: ")]
  assert len(timed) == min(auto.TIMED, len(choice.searched["finalists"])) >= 2, said
  measured = {
    line.split(": step measured ")[0].removeprefix("timed: "): float(line.split("step measured ")[1].split(" ms")[0])
    for line in timed
  }
  chosen = choice.line.removeprefix("mesh_config: auto chose ").split(": step measured ")[0]
  assert measured[chosen] == min(measured.values()), (choice.line, measured)
  assert "measured over 2 steps each" in choice.line and "runner-up" in choice.line
