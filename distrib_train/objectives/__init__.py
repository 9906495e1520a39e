"""Training objectives, apart from the model family (``train.objective``): ``dpo`` (preference pairs)."""
