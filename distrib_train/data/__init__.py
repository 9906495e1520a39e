"""Input pipelines on grain (``pipeline.py``) and document sources (``sources.py``).

Importing this package imports grain lazily: only building a ``DataLoader``
or reading ArrayRecord needs it.
"""

from distrib_train.data.pipeline import DataConfig, DataLoader, data_shard, to_global
from distrib_train.data.sources import Documents, write_array_record

__all__ = ["DataConfig", "DataLoader", "Documents", "data_shard", "to_global", "write_array_record"]
