"""``distrib-train plan``: estimate a job on a pod before it runs.

- ``estimate``: compile the trainer's step for N (emulated) devices, read
  memory, collectives and FLOPs (``plan_pod``, ``PodPlan``).
- ``layout``: emulated devices, mesh sizes, granules (what DCN links).
- ``memory``: bytes per device against the device kind's memory.
- ``timing``: the step-time model (compute + ICI + DCN) and MFU.
- ``search``: ``--recommend``, ranking mesh factorisations.
- ``report``: the printed tables.
- ``hlo``, ``collectives`` and ``replica_groups``: reading the compiled HLO.
- ``cpu_attention``: a CPU stand-in for cuDNN attention with its memory profile.
- ``auto``: ``mesh_config: auto``'s search on the job's own devices;
  ``layout_choice``: its choice, kept in the workdir for a restart.
- ``cli``: the subcommand's flags.

Not the sharding ``Plan`` (``distrib_train.sharding.plan``): that is what a
run uses; this is an estimate made before one.
"""
