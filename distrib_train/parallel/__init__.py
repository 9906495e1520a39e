"""Parallelism beyond sharding annotations: where XLA needs explicit collectives.

Empty today. Each axis gets its own module here, written with ``shard_map``
and explicit collectives, composing with data / fsdp / tensor:

- ``pipeline.py``: the ``stage`` mesh axis, microbatches through stages
  (collective permutes), sharing ``train.microbatches`` with gradient
  accumulation;
- ``experts.py``: the ``expert`` mesh axis, routed tokens (all-to-all);
- ``context.py``: the ``context`` mesh axis, ring attention (collective
  permutes).

Modules here may import ``common``, ``models``, the core and ``sharding``;
recipes (reference models) import them, never the other way round.
"""
