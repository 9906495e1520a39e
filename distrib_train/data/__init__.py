"""Input pipelines on grain (``pipeline.py``), document sources (``sources.py``) and ArrayRecord shards
(``record_shards.py``).

Importing this package imports nothing else: each public name loads its module on first use (PEP 562), so
a data worker process (``lane_process.py``) reads and tokenizes documents without importing jax; grain
loads only when a ``DataLoader`` is built or ArrayRecord read.
"""

import importlib
from typing import Any

_EXPORTS = {
  "DataConfig": "distrib_train.data.pipeline",
  "DataLoader": "distrib_train.data.pipeline",
  "data_shard": "distrib_train.data.pipeline",
  "to_global": "distrib_train.data.pipeline",
  "write_array_record": "distrib_train.data.record_shards",
  "Documents": "distrib_train.data.sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'distrib_train.data' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
