"""Worker: generate from a Hugging Face directory in 2 processes × 4 devices (fsdp and the batch span the processes).

argv: HF_DIRECTORY MESH_YAML. Writes the greedy and the sampled completions' ids (test_generation.py).
"""

import sys

import mp_harness

mp_harness.worker_init()

import numpy as np  # noqa: E402

from distrib_train.generation.engine import Generator  # noqa: E402
from distrib_train.generation.sampling import Sampling  # noqa: E402
from distrib_train.weights import load as run_model  # noqa: E402

SETTINGS = {"greedy": {}, "sampled": dict(sampling=Sampling(temperature=1.0, top_p=0.9), n=2, seed=5)}

loaded = run_model.load(f"hf:{sys.argv[1]}", mesh_config=sys.argv[2])
rng = np.random.default_rng(0)
prompts = [rng.integers(0, loaded.model_config.vocab_size, size=n).tolist() for n in (5, 13, 2)]
generator = Generator(loaded.model, mesh=loaded.mesh, rules=loaded.rules)
mp_harness.write_result(
  {name: [c.ids for c in generator.generate(prompts, max_new_tokens=8, **kwargs)] for name, kwargs in SETTINGS.items()}
)
