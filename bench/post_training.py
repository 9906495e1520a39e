"""An SFT step against a pretraining step of the same shape, both through the trainer: what conversations cost.

Run from the repository root:

  python bench/post_training.py --config sft-tiny --cpu_devices 8 --steps 40        # CPU, the demo corpus
  python bench/post_training.py --config my-sft.yaml --steps 100                      # your GPU preset

Three trainer runs, one after the other (``trainer_loop.trainer_run``: the
``distrib-train`` CLI, its tokens/s from ``metrics.jsonl`` after the first
window): the preset as it is (SFT: conversation records through the chat
template, whole conversations packed, the loss on the assistant's tokens),
then the same preset with ``data.loss_on`` empty (pretraining on the same
documents' text, rows filled by the stream), then SFT again; the figure is
pretraining's step time over SFT's (the mean of the two SFT runs), with the
SFT runs' spread as the host's drift. The step itself is one program for
both (the loss weights are an input either way), so the ratio is the data
path's and the padding's, counted as steps, not tokens. With ``--lora RANK``
a fourth run trains the same SFT through LoRA adapters of that rank
(``model.lora.rank``), and the figure beside it is full fine-tuning's step
time over LoRA's.

With ``--dpo``, instead: the demo's conversations become preference pairs (the
answer chosen, another passage's answer rejected, written to a temporary
JSONL), and four runs train on the same sequences: SFT on each pair's two
sequences as prompt/completion records, DPO with the live reference (a frozen
copy), DPO with the reference precomputed (``dpo.precompute_reference``: the
pass runs before the run's clock starts counting steps, and the file is kept
beside the temporary data), and DPO through LoRA adapters (``--lora``,
default 8: the reference is the model with its adapters off); the figures
are each DPO step's time over SFT's.

Targets (issue 48): an SFT step ≥ 0.97 × a pretraining step on the same shape; a LoRA step ≥ 1.0 × a full
fine-tuning step; a DPO step ≤ 1.4 × an SFT step over the same sequences with the live reference, ≤ 1.05 × with
it precomputed.

Not for: the trainer against its bare step (``trainer_loop.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> None:
  sys.path.insert(0, str(ROOT / "bench"))
  import trainer_loop

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="sft-tiny", help="an SFT preset name or YAML file (data.loss_on set)")
  parser.add_argument("--set", action="append", help="section.key=value, as the trainer's --set (repeatable)")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--log_every", type=int, default=10)
  parser.add_argument("--cpu_devices", type=int)
  parser.add_argument("--timeout", type=float, default=1800)
  parser.add_argument("--lora", type=int, default=0, help="also time SFT through LoRA adapters of this rank")
  parser.add_argument("--dpo", action="store_true", help="time DPO against SFT over the same sequences")
  args = parser.parse_args(argv)
  if args.steps < 3 * args.log_every:
    parser.error("--steps must be at least 3 × --log_every (one warm-up window, two timed).")

  def run(sets: list[str]) -> dict:
    return trainer_loop.trainer_run(
      argparse.Namespace(
        config=args.config,
        set=[*(args.set or []), *sets],
        text=None,
        tokenizer=None,
        steps=args.steps,
        log_every=args.log_every,
        cpu_devices=args.cpu_devices,
        timeout=args.timeout,
      )
    )

  if args.dpo:
    return _dpo(args, run)
  sft_before = run([])
  pretraining = run(["data.loss_on="])
  sft_after = run([])
  sft_ms = (sft_before["step_ms"] + sft_after["step_ms"]) / 2
  spread = abs(sft_before["step_ms"] - sft_after["step_ms"]) / sft_ms
  print(f"{args.config} {' '.join(args.set or [])}".strip())
  print(
    f"  SFT          {sft_ms:9.2f} ms/step  (two runs, {spread:.1%} apart)  data wait"
    f" {(sft_before['data_wait_ms'] + sft_after['data_wait_ms']) / 2:.2f} ms"
  )
  print(f"  pretraining  {pretraining['step_ms']:9.2f} ms/step  data wait {pretraining['data_wait_ms']:.2f} ms")
  print(f"  SFT step speed / pretraining step speed: {pretraining['step_ms'] / sft_ms:.3f}")
  if args.lora:
    adapted = run([f"model.lora.rank={args.lora}"])
    print(f"  LoRA (rank {args.lora}) {adapted['step_ms']:9.2f} ms/step")
    print(f"  LoRA step speed / full fine-tuning step speed: {sft_ms / adapted['step_ms']:.3f}")


def _dpo(args: argparse.Namespace, run) -> None:
  import json
  import tempfile

  from distrib_train.data import sources

  pairs = [json.loads(r) for r in sources.pydoc_pairs(sources._pydoc_documents(sources.CONVERSATION_BYTES // 2))]
  folder = pathlib.Path(tempfile.mkdtemp(prefix="dpo-bench-"))
  (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
  (folder / "sft.jsonl").write_text(
    "".join(
      json.dumps({"prompt": p["prompt"], "completion": p[k]}) + "\n" for p in pairs for k in ("chosen", "rejected")
    )
  )
  common = ["data.source=text", "data.text_field=*", "train.eval_every=0", "train.checkpoint_every=0"]
  sft = run([*common, f"data.paths={folder / 'sft.jsonl'}", "data.loss_on=completion"])
  dpo = run([*common, f"data.paths={folder / 'pairs.jsonl'}", "train.objective=dpo", "data.loss_on="])
  kept = run(
    [
      *common,
      f"data.paths={folder / 'pairs.jsonl'}",
      "train.objective=dpo",
      "data.loss_on=",
      "dpo.precompute_reference=true",
    ]
  )
  lora = run(
    [
      *common,
      f"data.paths={folder / 'pairs.jsonl'}",
      "train.objective=dpo",
      "data.loss_on=",
      f"model.lora.rank={args.lora or 8}",
    ]
  )
  print(f"{args.config} {' '.join(args.set or [])} ({len(pairs)} pairs)".strip())
  print(f"  SFT on the pairs' sequences {sft['step_ms']:9.2f} ms/step")
  print(
    f"  DPO, live reference         {dpo['step_ms']:9.2f} ms/step  DPO / SFT step time:"
    f" {dpo['step_ms'] / sft['step_ms']:.3f}"
  )
  print(
    f"  DPO, precomputed reference  {kept['step_ms']:9.2f} ms/step  DPO / SFT step time:"
    f" {kept['step_ms'] / sft['step_ms']:.3f}"
  )
  print(
    f"  DPO, LoRA rank {args.lora or 8:<3}          {lora['step_ms']:9.2f} ms/step  DPO / SFT step time:"
    f" {lora['step_ms'] / sft['step_ms']:.3f}"
  )


if __name__ == "__main__":
  main()
