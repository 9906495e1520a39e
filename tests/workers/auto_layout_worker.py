"""Worker: mesh_config: auto's search on 2 processes × 4 CPU devices, its finalists timed (both processes run
the steps process 0 names); each process's choice as its result."""

import pathlib
import sys

import mp_harness

mp_harness.worker_init()

import jax  # noqa: E402  (after jax.distributed.initialize)

from distrib_train.podplan import auto  # noqa: E402
from distrib_train.config import run as config_lib  # noqa: E402
from distrib_train.podplan import layout_choice  # noqa: E402

config = config_lib.load(
  "tiny", ["data.seq_len=32", "data.global_batch_size=8", "mesh_config=auto", "train.layout_compiles=2"]
)
workdir = pathlib.Path(sys.argv[1]) / f"process{jax.process_index()}"  # each its own: none shared
workdir.mkdir(parents=True)
choice = auto.search(config, workdir, timed_steps=1)  # the finalists timed, as on an accelerator
layout_choice.keep(workdir, choice)  # process 0 only
again = auto.search(config, workdir)
mp_harness.write_result(
  {
    "ici": list(choice.mesh_config.ici),
    "dcn": list(choice.mesh_config.dcn),
    "names": list(choice.mesh_config.axis_names),
    "settings": dict(choice.settings),
    "line": choice.line,
    "processes": jax.process_count(),
    "again": {"reused": again.reused, "ici": list(again.mesh_config.ici)},
  }
)
