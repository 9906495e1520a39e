"""A model's weights in and out of a run: ``hf:`` / ``ckpt:`` sources, a loaded model, export.

- ``init_from``: a new run's weights from a Hugging Face checkpoint or another
  run's (``train.init_from``).
- ``load``: a model loaded onto a mesh for use, not training (``RunModel``):
  generation's, evaluation's and export's one loader.
- ``export``: ``distrib-train export``, a run's params as Hugging Face's or a
  LoRA run's adapters as PEFT's.
"""
