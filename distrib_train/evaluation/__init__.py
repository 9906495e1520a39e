"""lm-evaluation-harness over the sharded model: offline, and as a hook of a run.

- ``harness``: ``HarnessLM``, lm-eval's ``LM`` (log-likelihoods, rolling
  perplexity, generation).
- ``tasks``: ``distrib-train eval`` and its offline task checks.
- ``demo_tasks``: the demo's tasks, built from the demo corpus.
- ``hook``: ``train.eval_tasks``, task scores of the live model during a run.
"""
