"""Parallelism beyond sharding annotations: where XLA needs explicit schedules or collectives.

- ``pipeline.py``: the ``stage`` mesh axis. A model runs its repeated layers
  through ``layer_stack``; under a step whose mesh has a stage axis the
  microbatches (``train.microbatches``) flow through the stages (GPipe, or
  the circular schedule with ``train.pipeline_repeats`` > 1), stage to stage
  by collective-permute.

- ``experts.py``: the ``expert`` mesh axis. A mixture of experts' layers
  call ``dispatch``: tokens to the devices holding their experts by
  ragged all-to-all, their grouped matmuls, and back.
  Their grouped matmuls are kernels (``kernels/grouped.py``).

The ``context`` mesh axis needs no schedule of its own: its token order is
``sharding/context.py``'s, attention over it a kernel
(``kernels/attention/ring.py``: ring or all-gather).

Modules here may import ``common``, ``models``, the core, ``sharding`` and
``kernels`` (the layers below); recipes (reference models) import them, never the
other way round.
"""

from distrib_train.parallel.pipeline import layer_stack

__all__ = ["layer_stack"]
