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
- ``context.py``: the ``context`` mesh axis. Sequences split over it in a
  load-balanced (zigzag) order; attention as ring attention (key/value
  blocks passed round by ``ppermute``, online softmax) or all-gather.

Modules here may import ``common``, ``models``, the core, ``sharding`` and
``kernels`` (their layer); recipes (reference models) import them, never the
other way round.
"""

from distrib_train.parallel.pipeline import layer_stack

__all__ = ["layer_stack"]
