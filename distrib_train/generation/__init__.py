"""Generation: the decoder's cache and cached forward (``cache``), sampling (``sampling``), and the loop that
batches prompts through prefill and decode (``engine``). The run-level side — a run's model and tokenizer,
prompts from files, ``distrib-train generate`` — is ``inference/generate.py``."""
