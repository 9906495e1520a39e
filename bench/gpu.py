"""The headline measurements on your GPU, in one command, beside the figures in bench/RESULTS.md.

Run from the repository root on a machine with an NVIDIA GPU (``bash bench/gpu.sh`` runs this; the rows use
one GPU, ``--big``'s the 7b preset's eight):

  python bench/gpu.py                          # every row below (about 25 minutes on an H200)
  python bench/gpu.py --only bare,fp8          # some rows
  python bench/gpu.py --big                    # also llama-7b-gpu, auto against hand-tuned (8 GPUs: its machine)
  python bench/gpu.py --smoke                  # the same rows at toy sizes on 8 emulated CPU devices

Each row runs the bench that owns it, in its own process:

- ``bare``: the 1b's bare step (``train_throughput.py --shapes 1b``, the preset's settings: unrolled layers,
  logits kept, B 16 × 2048, bf16), tokens/s and MFU;
- ``fp8``: the same step with ``fp8=delayed``, against ``bare`` (one process, one after the other);
- ``text``: the trainer CLI on real text (``llama-124m-gpu``, packed rows, a 16k BPE, the preset's two data
  workers) against its bare step (``trainer_loop.py``). The text is the Python standard library's modules as
  JSONL, tokenized by a byte-level BPE trained on it (``tokenizers``; the bytes tokenizer without it);
- ``moe``: the mixture against its dense twin (``moe_step.py``, 12 layers, d 1024, 8 experts top 2, B 8);
- ``auto``: ``llama-1b-gpu`` as shipped (its hand-tuned layout) against ``--mesh_config auto``, each through
  the trainer CLI, tokens/s of the metric windows after the first, and the search's choice and seconds.

It prints one table: each row's figure on this card, the figure bench/RESULTS.md's headline table gives (and
the card it was taken on), and their ratio. ``--json`` writes every bench's output too.

Not for: sweeps and profiles (the benches themselves).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROWS = ("bare", "fp8", "text", "moe", "auto")
MOE_SHAPE = [
  "--d_model",
  "1024",
  "--layers",
  "12",
  "--expert_mlp_dim",
  "2816",
  "--seq_len",
  "2048",
  "--dtype",
  "bfloat16",
  "--heads",
  "16",
  "--vocab",
  "32000",
  "--batch",
  "8",
]
BARE = "scan=0,loss_remat=0,batch=16"


def _run(command: list[str], limit: float, env: dict[str, str] | None = None, capture_stderr: bool = False) -> str:
  print(f"  $ {' '.join(command)}", file=sys.stderr, flush=True)
  done = subprocess.run(
    command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=limit
  )
  if done.returncode:
    raise RuntimeError(f"exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
  return done.stdout + (done.stderr if capture_stderr else "")


def corpus(workdir: pathlib.Path, smoke: bool) -> list[str]:
  """``trainer_loop.py``'s real-text flags: the standard library's modules as JSONL, through a 16k BPE."""
  text = workdir / "corpus.jsonl"
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  total, limit = 0, 1e6 if smoke else 11.5e6
  with open(text, "w", encoding="utf-8") as out:
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
      if "site-packages" in path.parts or "test" in path.parts[-2]:
        continue
      try:
        body = path.read_text("utf-8")
      except (UnicodeDecodeError, OSError):
        continue
      out.write(json.dumps({"text": body}) + "\n")
      total += len(body.encode())
      if total > limit:
        break
  try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  except ImportError:
    print("  (no `tokenizers`: the text row reads bytes, not a 16k BPE)", file=sys.stderr)
    return ["--text", str(text), "--tokenizer", "bytes"]
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=16384,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=["<|endoftext|>"],
    show_progress=False,
  )
  tokenizer.train_from_iterator((json.loads(line)["text"] for line in open(text, encoding="utf-8")), trainer)
  tokenizer.save(str(workdir / "tokenizer.json"))
  return ["--text", str(text), "--tokenizer", f"hf:{workdir / 'tokenizer.json'}"]


def trainer_tokens(
  config: str, workdir: pathlib.Path, steps: int, extra: list[str], limit: float, env: dict[str, str] | None = None
) -> dict:
  """The trainer CLI's tokens/s: the median of its metric windows after the first (the warm-up's)."""
  command = [
    sys.executable,
    "-m",
    "distrib_train",
    "--config",
    config,
    "--workdir",
    str(workdir),
    "--steps",
    str(steps),
    "--set",
    "train.log_every=10",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.checkpoint_every=0",
    "--set",
    "data.eval_fraction=0",
    *extra,
  ]
  output = _run(command, limit, env, capture_stderr=True)
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
  windows = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
  if not windows:
    raise RuntimeError(f"{config}: no metric window after the first")
  chose = re.search(r"mesh_config: auto chose (.*)", output)
  goodput = json.loads((workdir / "goodput.json").read_text()) if (workdir / "goodput.json").exists() else {}
  search = sum(run.get("seconds", {}).get("layout_search", 0.0) for run in goodput.get("runs", []))
  return {"tokens_per_s": statistics.median(windows), "choice": chose.group(1) if chose else None, "search_s": search}


def headline() -> dict[str, tuple[str, str]]:
  """bench/RESULTS.md's headline table: row key → (figure, where measured)."""
  rows = {}
  for line in (ROOT / "bench" / "RESULTS.md").read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| `") and len(cells) >= 4:
      rows[cells[0].strip("`")] = (cells[2], cells[3])
  return rows


def _number(text: str) -> float | None:
  match = re.search(r"[\d,]*\.?\d+", text.replace("**", ""))
  return float(match.group(0).replace(",", "")) if match else None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
  parser.add_argument(
    "--big",
    action="store_true",
    help="also llama-7b-gpu in the auto row, on the machine its preset names (8 × H100: gpu-1x8xh100)",
  )
  parser.add_argument("--smoke", action="store_true", help="toy sizes on 8 emulated CPU devices (checks the script)")
  parser.add_argument("--json", help="write every figure here")
  args = parser.parse_args(argv)
  only = [r for r in args.only.split(",") if r]
  unknown = set(only) - set(ROWS)
  if unknown:
    parser.error(f"--only: unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
  py = sys.executable
  smoke = args.smoke
  # the one-GPU rows see one GPU (the 1b preset's mesh is gpu-1), on a machine with more
  one = {} if smoke else {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
  cpu = ["--cpu_devices", "8"] if smoke else []
  got: dict[str, tuple[str, float | None]] = {}
  out: dict[str, object] = {}
  work = pathlib.Path(tempfile.mkdtemp(prefix="gpu-bench-"))
  start = time.perf_counter()

  def row(key: str, label: str, body) -> None:
    print(f"[{time.perf_counter() - start:5.0f} s] {label}", file=sys.stderr, flush=True)
    try:
      got[key] = body()
    except Exception as e:  # noqa: BLE001 - a row that fails says why; the table goes on
      lines = [line for line in str(e).splitlines() if line.strip()]
      got[key] = (f"failed: {lines[-1][:100] if lines else type(e).__name__}", None)
      if key == "bare" and "fp8" in only:
        got["fp8"] = got[key]

  if {"bare", "fp8"} & set(only):

    def bare():
      path = work / "bare.json"
      settings = BARE + (f";{BARE},fp8=delayed" if "fp8" in only else "")
      shapes = ["--shapes", "tiny", "--steps", "3", "--warmup", "1"] if smoke else ["--shapes", "1b"]
      _run(
        [
          py,
          "bench/train_throughput.py",
          *shapes,
          "--reference",
          "none",
          "--sweep",
          "--settings",
          settings,
          "--json",
          str(path),
        ],
        1500,
        {"JAX_PLATFORMS": "cpu"} if smoke else one,
      )
      rows = json.loads(path.read_text())["rows"]
      out["train_throughput"] = rows
      base = next(r for r in rows if "fp8=" not in r["setting"] and r.get("tokens_per_s"))
      if "fp8" in only:
        fp8 = next(r for r in rows if "fp8=delayed" in r["setting"] and r.get("tokens_per_s"))
        got["fp8"] = (f"{fp8['tokens_per_s'] / base['tokens_per_s']:.3f} ×", fp8["tokens_per_s"] / base["tokens_per_s"])
      mfu = f", MFU {base['mfu']:.1%}" if base.get("mfu") else ""
      return f"{base['tokens_per_s']:,.0f} tokens/s{mfu}", base["tokens_per_s"]

    row("bare", "the 1b's bare step" + (" and FP8" if "fp8" in only else ""), bare)
  if "text" in only:

    def text():
      path = work / "text.json"
      config = (
        ["--config", "tiny", "--steps", "30", "--set", "data.seq_len=256", "--set", "model.vocab_size=16384"]
        if smoke
        else ["--config", "llama-124m-gpu", "--steps", "60"]
      )
      _run([py, "bench/trainer_loop.py", *config, *cpu, *corpus(work, smoke), "--json", str(path)], 1200, one)
      result = json.loads(path.read_text())
      out["trainer_loop"] = result
      return f"{result['ratio']:.3f}", result["ratio"]

    row("text", "the trainer on real text against its bare step", text)
  if "moe" in only:

    def moe():
      path = work / "moe.json"
      shape = (
        [
          "--cpu_devices",
          "8",
          "--d_model",
          "64",
          "--layers",
          "2",
          "--expert_mlp_dim",
          "128",
          "--seq_len",
          "64",
          "--vocab",
          "256",
          "--steps",
          "2",
          "--rounds",
          "1",
        ]
        if smoke
        else ["--cpu_devices", "0", *MOE_SHAPE]
      )
      _run([py, "bench/moe_step.py", *shape, "--json", str(path)], 900, one)
      results = json.loads(path.read_text())["results"]
      out["moe_step"] = results
      ratio = results["moe"]["tokens_per_s"] / results["dense"]["tokens_per_s"]
      return f"{ratio:.3f} ×", ratio

    row("moe", "the mixture against its dense twin", moe)
  if "auto" in only:
    presets = ["tiny"] if smoke else ["llama-1b-gpu"] + (["llama-7b-gpu"] if args.big else [])
    for preset in presets:

      def auto(preset=preset):
        steps = 30 if smoke else 60
        env = one if preset != "llama-7b-gpu" else {}
        hand = trainer_tokens(preset, work / f"{preset}-hand", steps, cpu, 1800, env)
        auto = trainer_tokens(preset, work / f"{preset}-auto", steps, cpu + ["--mesh_config", "auto"], 2400, env)
        out[f"auto {preset}"] = {"hand": hand, "auto": auto}
        ratio = auto["tokens_per_s"] / hand["tokens_per_s"]
        print(f"  auto chose {auto['choice']} in {auto['search_s']:.0f} s", file=sys.stderr)
        return f"{ratio:.3f} × (search {auto['search_s']:.0f} s)", ratio

      row("auto" if preset in ("tiny", "llama-1b-gpu") else "auto-7b", f"{preset}: auto against hand-tuned", auto)

  results = headline()
  device = "8 emulated CPU devices (--smoke)" if smoke else _device()
  print(f"\nOn {device}, {time.perf_counter() - start:.0f} s in all:\n")
  print("| row | here | bench/RESULTS.md | measured there on | here / there |")
  print("| --- | --- | --- | --- | --- |")
  for key, (figure, value) in sorted(got.items(), key=lambda item: [*ROWS, "auto-7b"].index(item[0])):
    there, where = results.get(key, ("—", "—"))
    theirs = _number(there)
    ratio = f"{value / theirs:.3f}" if value is not None and theirs and not smoke else "—"
    print(f"| `{key}` | {figure} | {there} | {where} | {ratio} |")
  if args.json:
    pathlib.Path(args.json).write_text(
      json.dumps({"device": device, "rows": {k: v[0] for k, v in got.items()}, "benches": out}, indent=1, default=str)
    )
  return 0 if all(v is not None for _, v in got.values()) else 1


def _device() -> str:
  try:
    return (
      subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
      ).stdout.strip()
      or "this machine"
    )
  except (OSError, subprocess.TimeoutExpired):
    return "this machine"


if __name__ == "__main__":
  sys.exit(main())
