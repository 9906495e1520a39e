"""A training run: its config, the loop, and what the loop needs.

- ``config``: the run config (YAML presets + ``--set`` overrides), checked once.
- ``trainer``: ``Trainer`` — mesh, plan, init or restore, the step loop,
  evaluation, checkpoints, preemption.
- ``optimizers``: optax optimizers from the config, the non-finite guard.
- ``metrics``: console, ``metrics.jsonl`` and TensorBoard sinks.
- ``compilation``: the persistent compilation cache, memory lines.
- ``workdir_lock``: one job per workdir.

Imported on its own (``import distrib_train`` does not load it).
"""
