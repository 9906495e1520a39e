"""The run's config, composed of one section per concern, and the job it describes.

- ``run``: ``Config`` and ``load`` (YAML presets + ``--set`` overrides), each
  key and type checked before anything runs (``dt.load_config``).
- ``values``: a value parsed into its field's type; misspelled keys answered.
- ``checks``: the checks across a config's fields and sections;
  ``plan_checks``: a config against the mesh plan it runs on.
- ``job``: the job a config describes (model, optimizer, abstract train state,
  batch, axis rules), built once for the trainer and for ``podplan``.

The sections live beside the code that reads them (the optimizer's in
``optim/``, the data's in ``data/``, an objective's in ``objectives/``).
"""
