"""A training run: the ``Trainer``, its step loop and what the loop needs.

- ``trainer``: ``Trainer`` (``dt.Trainer``): mesh, plan, init or restore,
  compile, then the loop with its hooks.
- ``loop``: ``TrainLoop``, the step loop; ``hooks``: periodic work with an
  interval; ``window``: the metrics window between log points.
- ``eval_pass``: the held-out split and one pass over it.
- ``goodput``: the phase clock and ``goodput.json``; ``watchdog``: the hang
  watchdog; ``nonfinite``: the non-finite guard's decisions.
- ``checks``: the start-up refusals; ``compilation``: the persistent
  compilation cache and memory lines; ``workdir_lock``: one job per workdir.
- ``wsd``: a finished warmup-stable-decay run extended from its last stable step.
- ``metrics``: console, ``metrics.jsonl`` and TensorBoard sinks.
"""
