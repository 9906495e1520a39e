"""A training run: its config, the loop, and what the loop needs.

- ``config``: the run config (YAML presets + ``--set`` overrides), checked once.
- ``job``: the job a config describes (model, optimizer, abstract state,
  batch, axis rules), shared with ``podplan``.
- ``trainer``: ``Trainer`` — mesh, plan, init or restore, compile, then the
  loop with its hooks (log, checkpoint, evaluation, profile).
- ``loop``: ``TrainLoop``, the step loop; ``hooks``: periodic work with an
  interval; ``window``: the metrics window between log points.
- ``goodput``: the phase clock and ``goodput.json`` (where a workdir's time
  goes, across restarts); ``watchdog``: the hang watchdog.
- ``nonfinite``: the non-finite guard (optax wrapper and skip / halt /
  rollback decision).
- ``checks``: the start-up refusals (workdir, mesh axes, batch split, token ids).
- ``optimizers``: optax optimizers from the config.
- ``metrics``: console, ``metrics.jsonl`` and TensorBoard sinks.
- ``compilation``: the persistent compilation cache, memory lines.
- ``workdir_lock``: one job per workdir.

Imported on its own (``import distrib_train`` does not load it).
"""
