"""Input pipelines on grain (``pipeline.py``), document sources (``sources.py``) and ArrayRecord shards
(``record_shards.py``).

Importing this package imports grain lazily: only building a ``DataLoader``
or reading ArrayRecord needs it.
"""

from distrib_train.data.pipeline import DataConfig, DataLoader, data_shard, to_global
from distrib_train.data.record_shards import write_array_record
from distrib_train.data.sources import Documents

__all__ = ["DataConfig", "DataLoader", "Documents", "data_shard", "to_global", "write_array_record"]
