"""Optimizers and learning-rate schedules from the run config's ``optimizer`` section.

- ``chain``: ``OptimizerConfig``; ``build`` (the optax chain: gradient norm,
  non-finite skip, clipping, adamw / adam / sgd / muon with an injected
  learning rate), the schedules (``wsd`` too), ``metrics_of``.
- ``muon``: Muon's matrices from the params' logical axes, Newton–Schulz over
  whole matrices spread over the mesh.
"""
