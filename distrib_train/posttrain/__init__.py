"""The host side of post-training objectives: RL's rollouts and rewards, DPO's reference pass.

- ``rewards``: GRPO's reward functions (TRL's signature, the built-ins) and
  group advantages.
- ``records``: what a ``grpo`` run keeps and writes beside its checkpoints.
- ``rollouts``: ``RolloutSource``, the loop's batch source for ``grpo``: the
  policy's completions, sampled on the training mesh and scored.
- ``reference_pass``: DPO's reference log-probabilities precomputed in one
  pass and kept beside the data.
"""
