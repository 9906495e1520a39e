"""``mesh_config: auto``: the layout a search chose for a job's devices, kept in its workdir.

A run whose ``mesh_config`` is ``auto`` asks a layout search (``podplan/auto.py``, handed to the ``Trainer`` as
``layout_search``; the ``distrib-train`` command does) for a ``Choice``: a mesh config and the settings that
go with it (``model.remat``, ``model.attention``, ``model.fp8``, ``train.microbatches``). Once the step built on it has compiled and fits, the
choice is kept in ``auto_layout.json`` in the workdir with the devices and job it was made for
(``signature``), its mesh in ``auto_mesh.yaml`` (a mesh config any run loads as is). A restart on the same
devices, of the same job, reads it back (``kept``) instead of searching; on other devices it searches again,
and the checkpoint restores onto the new layout as onto any other mesh.

Not for: searching (``podplan/auto.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax

from distrib_train.sharding.mesh import MeshConfig
from distrib_train.config.run import Config

AUTO = "auto"
FILE_NAME = "auto_layout.json"
MESH_FILE_NAME = "auto_mesh.yaml"


@dataclasses.dataclass(frozen=True)
class Choice:
  """A layout for a job's devices.

  Attributes:
    mesh_config: the mesh (axes over ICI and DCN, the rules).
    settings: config keys the layout sets with it (``{"model.remat": "full", "train.microbatches": 2}``).
    line: one line for the log: what was chosen, at what estimated or measured step time, and the runner-up.
    seconds: the search's wall time (0 when read back).
    searched: candidates the search considered, dropped and compiled, for the record.
    reused: read back from the workdir (``kept``), not searched.
    signature: the devices and job it was made for (``signature``).
  """

  mesh_config: MeshConfig
  settings: Mapping[str, Any]
  line: str
  seconds: float = 0.0
  searched: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  reused: bool = False
  signature: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def apply(self, config: Config) -> Config:
    """``config`` with the layout's settings (a reference model's remat, attention kernel and FP8; the
    microbatches)."""
    model = dict(config.model.overrides)
    train = {}
    for key, value in self.settings.items():
      section, _, field = key.partition(".")
      if section == "model":
        model[field] = value
      else:
        train[field] = value
    return dataclasses.replace(
      config, model=dataclasses.replace(config.model, overrides=model), train=dataclasses.replace(config.train, **train)
    )


def signature(config: Config) -> dict[str, Any]:
  """What a choice is made for: the devices (how many, of what kind, over how many processes) and the job (a
  digest of the model, the batch and sequence sizes, the microbatches, the rules and the objective: a restart
  that changes one searches again rather than override the new settings with the old choice's)."""
  device = jax.devices()[0]
  job = {
    "model": config.to_dict()["model"],
    "seq_len": config.data.seq_len,
    "objective": config.train.objective,
    "global_batch_size": config.data.global_batch_size,
    "microbatches": config.train.microbatches,
    "fp8_allowed": config.train.layout_fp8,
    "rules": config.train.rules,
    "init_from": config.train.init_from,
  }
  return {
    "devices": jax.device_count(),
    "device_kind": str(getattr(device, "device_kind", device.platform)),
    "platform": device.platform,
    "processes": jax.process_count(),
    "job": hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:16],
  }


def kept(workdir: str | os.PathLike, config: Config) -> Choice | None:
  """The choice kept in ``workdir`` when it was made for these devices and this job, else None.

  Raises:
    ValueError: the record or its mesh file cannot be read (the file named).
  """
  path = pathlib.Path(workdir) / FILE_NAME
  try:
    record = json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); delete it to search again.") from None
  if record.get("signature") != signature(config):
    return None
  mesh = MeshConfig.from_yaml(path.with_name(MESH_FILE_NAME))
  return Choice(
    mesh, record["settings"], f"reused from {path}: {record['line']}", 0.0, record.get("searched", {}), reused=True
  )


def keep(workdir: str | os.PathLike, choice: Choice) -> None:
  """Writes a new ``choice`` into ``workdir`` (process 0; replaced atomically), once the trainer's step built on
  it has compiled and fits."""
  if jax.process_index() != 0 or choice.reused:
    return
  path = pathlib.Path(workdir) / FILE_NAME
  record = {
    "signature": dict(choice.signature),
    "settings": dict(choice.settings),
    "line": choice.line,
    "search_s": round(choice.seconds, 3),
    "searched": dict(choice.searched),
  }
  header = [
    f"Chosen by mesh_config: auto for {record['signature']['devices']} ×"
    f" {record['signature']['device_kind']}; with {', '.join(f'{k}={v}' for k, v in choice.settings.items())}"
  ]
  for name, text in ((MESH_FILE_NAME, choice.mesh_config.to_yaml(header)), (FILE_NAME, json.dumps(record, indent=1))):
    temporary = path.with_name(f".{name}.tmp")
    temporary.write_text(text.rstrip("\n") + "\n")
    os.replace(temporary, path.with_name(name))


def choose(config: Config, workdir: str | os.PathLike, search: Callable[..., Choice], model_given: bool) -> Choice:
  """``search``'s choice for ``config`` on these devices (it reads the kept one first).

  Raises:
    ValueError: the model is given as code (the search plans the config's own), or the search found nothing
      that fits.
  """
  if model_given:
    raise ValueError(
      "mesh_config: auto plans the config's reference model; a model given as code (model_fn) names its mesh config."
    )
  return search(config, workdir)
