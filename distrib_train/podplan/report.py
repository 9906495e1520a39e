"""How a pod plan reads: the text ``distrib-train plan`` prints, and the same as plain data.

Not for: computing the figures (``podplan.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from distrib_train.common.text import human_bytes
from distrib_train.podplan import collectives as collectives_lib


def _seconds(s: float) -> str:
  if s < 1e-3:
    return f"{s * 1e6:.1f} µs"
  return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return [
    "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    for r in rows
  ]


def compiler_line(pod: Any) -> str:
  """Which compiler made the figures."""
  if pod.compiler == "tpu":
    return f"TPU (libtpu, for {pod.device_kind}, topology {pod.topology}; nothing runs)"
  if pod.compiler == "gpu" and pod.topology is not None:
    return f"CUDA (XLA's GPU compiler for {pod.device_kind}, {pod.topology}, without a GPU; nothing runs)"
  if pod.compiler == "cpu-emulated":
    return (
      f"CPU, emulating {pod.devices} devices (figures for {pod.kind.name} are estimates; see notes)"
      if pod.compiled
      else f"none (not compiled; {pod.devices} emulated CPU devices)"
    )
  return f"{pod.compiler} (this machine's {pod.device_kind} devices)"


def headline(pod: Any) -> str:
  params = f"{pod.param_count / 1e9:.2f} B params" if pod.param_count >= 1e8 else f"{pod.param_count:,} params"
  return (
    f"{pod.config_name or 'config'} ({params}) on {pod.devices} × {pod.kind.name} ({pod.kind.description}),"
    f" mesh {pod.mesh_source}: {pod.layout.describe()}"
  )


def memory_lines(pod: Any) -> list[str]:
  m = pod.memory
  rows = [
    ("params", human_bytes(m.params), ""),
    ("optimizer state", human_bytes(m.opt_state), ""),
    ("local state", human_bytes(m.local_state), ""),
    ("step, key, loss state", human_bytes(m.other_state), ""),
    ("batch", human_bytes(m.inputs), ""),
    (
      "step temporaries",
      human_bytes(m.temporaries),
      ""
      if m.temporaries is None
      else "what the compiler said when it refused the step (see notes)"
      if pod.collectives is None
      else "compiled step, memory_analysis()"
      if m.temporaries_scale == 1
      else f"the CPU compile's {human_bytes(m.compiled_temporaries)} × {m.temporaries_scale} (bf16, see notes)",
    ),
    ("outputs not donated", human_bytes(m.outputs_not_donated), ""),
  ]
  lines = ["Memory per device:"] + _table(rows, right=(1,))
  verdict = "FITS" if m.fits else "DOES NOT FIT"
  share = m.usable / m.capacity
  usable = (
    f"{human_bytes(m.usable)} usable ({share:.0%} of {human_bytes(m.capacity)})"
    if share < 1
    else human_bytes(m.capacity)
  )
  what = "total" if m.temporaries is not None else "state + batch (not compiled: no temporaries)"
  lines.append(
    f"  {what} {human_bytes(m.total)} of {usable}: {verdict}, headroom {human_bytes(m.headroom)}"
    f" ({m.headroom / m.usable:.0%})"
  )
  return lines


def collective_lines(pod: Any) -> list[str]:
  if pod.collectives is None:
    return []
  totals = collectives_lib.summarize(pod.collectives)
  lines = ["Collectives per step, per device (ring model; loop bodies × trip counts):"]
  if not totals:
    return lines + ["  none"]
  rows = [("kind", "mesh axes", "link", "ops", "runs", "payload", "sent")]
  rows += [
    (
      t.kind,
      t.axes,
      "DCN" if t.dcn else "ICI",
      str(t.ops),
      str(t.count),
      human_bytes(t.payload_bytes),
      human_bytes(t.wire_bytes),
    )
    for t in totals
  ]
  lines += _table(rows, right=(3, 4, 5, 6))
  wire = pod.wire_bytes()
  lines.append(
    f"  sent per step: ICI {human_bytes(wire['ici'])}, DCN {human_bytes(wire['dcn'])}; in the optimizer's"
    f" update (Muon's Newton–Schulz): {human_bytes(collectives_lib.optimizer_wire_bytes(pod.collectives))}"
  )
  if any(t.kind.endswith("*") for t in totals):
    lines.append("  * all-reduces whose result is only used sliced to 1/n: reduce-scatters, as TPU/GPU compile them")
  return lines


def pipeline_lines(pod: Any) -> list[str]:
  p = pod.pipeline()
  if p is None:
    return []
  s, m, r = p["stages"], p["microbatches"], p["repeats"]
  formula = f"(S−1)/(M+S−1) = {s - 1}/{m + s - 1}" if r == 1 else f"(S−1)/(R·M+S−1) = {s - 1}/{r * m + s - 1}"
  lines = [
    f"Pipeline: {s} stages, {m} microbatches, {'GPipe' if r == 1 else f'circular, {r} repeats'};"
    f" bubble {p['bubble_fraction']:.1%} of each stage's iterations ({formula}).",
    "  Memory above is each device's, so each stage's (every stage holds the same share).",
  ]
  if p["stage_permute_bytes"] is not None:
    lines.append(
      f"  stage to stage (collective-permute on stage): {human_bytes(p['stage_permute_bytes'])} per device"
      f" per step, {human_bytes(p['stage_permute_wire_bytes'])} sent"
    )
  return lines


def time_lines(pod: Any, efficiency: float | None = None) -> list[str]:
  t = pod.time
  if t is None:
    return []
  k = pod.kind
  lines = [
    "FLOPs and step time (model: matmul FLOPs / (peak × efficiency) + ICI bytes / ICI bandwidth"
    " + DCN bytes / DCN bandwidth, no overlap):"
  ]
  if t.model_flops_per_device:
    lines.append(
      f"  model FLOPs per device per step {t.model_flops_per_device:.3g} (PaLM count,"
      f" {pod.tokens_per_step:,} tokens per step)"
    )
  ratio = (
    f" ({t.matmul_flops_per_device / t.model_flops_per_device:.2f}× the model's)"
    if t.model_flops_per_device and t.matmul_flops_per_device
    else ""
  )
  lines.append(f"  compiled matmul FLOPs per device {t.matmul_flops_per_device:.3g}{ratio}")
  kernels = (pod.flops or {}).get("attention_kernels", 0.0)
  if kernels:
    lines.append(
      f"    of which fused attention kernels {kernels:.3g}, counted from the blocks their masks let run"
      " (a kernel's work is not in the compiled program)"
    )
  if t.xla_flops_per_device is not None:
    lines.append(f"  XLA cost_analysis FLOPs per device {t.xla_flops_per_device:.3g} (loop bodies counted once)")
  lines.append(
    f"  {k.name}: peak {k.peak_flops / 1e12:.0f} TFLOP/s, ICI {k.ici_bandwidth / 1e9:.1f} GB/s,"
    f" DCN {k.dcn_bandwidth / 1e9:.2f} GB/s per device" + (f"; efficiency {efficiency:.2f}" if efficiency else "")
  )
  mfu = f", MFU {t.mfu:.1%}" if t.mfu is not None else ""
  tokens = f", {pod.tokens_per_step / t.step_s:,.0f} tokens/s" if t.step_s else ""
  lines.append(
    f"  compute {_seconds(t.compute_s)} + ICI {_seconds(t.ici_s)} + DCN {_seconds(t.dcn_s)}"
    f" = step {_seconds(t.step_s)}{tokens}{mfu}"
  )
  return lines


def attention_lines(pod: Any) -> list[str]:
  """Each attention layer's kernel as the step was traced, why, and what its mask and gather cost."""
  if not pod.attention:
    return []
  lines = ["Attention (each layer's kernel, as the step was traced):"]
  for d in pod.attention:
    window = f", window {d.window:,}" if d.window else ""
    cost = f"; its mask's blocks {d.work:.3f}× the causal ideal" if d.work is not None else ""
    if d.gathered_bytes:
      cost += f"; gathered keys and values {human_bytes(d.gathered_bytes)} a layer, rematerialised for the backward"
    lines.append(f"  {d.kernel} ({d.length:,} tokens{window}): {d.reason}{cost}")
  return lines


def text(pod: Any, efficiency: float | None = None) -> str:
  """The full report of one plan."""
  timing = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in pod.timings.items())
  lines = [f"Plan: {headline(pod)}", f"  compiler: {compiler_line(pod)}; {timing}", ""]
  lines += memory_lines(pod)
  for block in (pipeline_lines(pod), attention_lines(pod), collective_lines(pod), time_lines(pod, efficiency)):
    if block:
      lines += [""] + block
  if pod.plan.skips:
    lines += ["", f"Rule skips ({len(pod.plan.skips)}):"] + [f"  {s}" for s in pod.plan.skips[:10]]
    if len(pod.plan.skips) > 10:
      lines.append(f"  … and {len(pod.plan.skips) - 10} more")
  if pod.notes:
    lines += ["", "Notes:"] + [f"  - {n}" for n in pod.notes]
  return "\n".join(lines)


def recommendation_text(rec: Any, top: int = 5) -> str:
  """The ranked table of ``podplan.recommend``'s result."""
  lines = [f"Candidates: {rec.candidates} factorisations of the devices over the mesh axes"]
  for why, n in rec.dropped.items():
    if n:
      lines.append(f"  dropped {n}: {why}")
  lines.append(
    f"  compiled {rec.compiled} (at most --max_compiles, in order of a compile-free communication"
    f" estimate); {len(rec.ranked)} fit"
    + (f", {len(rec.not_fitting_compiled)} do not" if rec.not_fitting_compiled else "")
  )
  misses = [
    f"  {p.layout.describe()}: {human_bytes(p.memory.total)} of {human_bytes(p.memory.usable)}"
    for p in rec.not_fitting_compiled
  ]
  if not rec.ranked:
    return "\n".join(lines + ["No compiled candidate fits in device memory:"] + misses)
  rows = [("#", "mesh", "state", "temps", "total", "headroom", "ICI sent", "DCN sent", "step", "MFU")]
  for i, pod in enumerate(rec.ranked[:top], 1):
    m, t, wire = pod.memory, pod.time, pod.wire_bytes()
    rows.append(
      (
        str(i),
        pod.layout.describe(),
        human_bytes(m.state),
        human_bytes(m.temporaries),
        human_bytes(m.total),
        human_bytes(m.headroom),
        human_bytes(wire["ici"]),
        human_bytes(wire["dcn"]),
        _seconds(t.step_s),
        f"{t.mfu:.1%}" if t.mfu is not None else "-",
      )
    )
  lines += ["", f"Top {min(top, len(rec.ranked))} by estimated step time (per device, per step):"]
  lines += _table(rows, right=(2, 3, 4, 5, 6, 7, 8, 9))
  if misses:
    lines += ["Compiled but over the memory:"] + misses
  return "\n".join(lines)


def _topology(topology: Any) -> dict[str, Any] | None:
  if topology is None:
    return None
  if hasattr(topology, "num_slices"):  # a TPU topology
    return {"name": topology.name, "slices": topology.num_slices, "chips": topology.devices}
  return {"name": str(topology), "devices": topology.devices, "per_host": topology.per_host}


def as_dict(pod: Any) -> dict[str, Any]:
  """The plan's figures as JSON-able data."""
  m, t = pod.memory, pod.time
  out: dict[str, Any] = {
    "config": pod.config_name,
    "mesh_config": pod.mesh_source,
    "devices": pod.devices,
    "compiler": pod.compiler,
    "device_kind": pod.device_kind or pod.kind.name,
    "kind": pod.kind.name,
    "topology": _topology(pod.topology),
    "emulated": pod.emulated,
    "mesh": {n: {"ici": i, "dcn": d} for n, i, d in zip(pod.layout.axis_names, pod.layout.ici, pod.layout.dcn)},
    "granules": pod.layout.granules,
    "param_count": pod.param_count,
    "tokens_per_step": pod.tokens_per_step,
    "memory": {**dataclasses.asdict(m), "state": m.state, "total": m.total, "headroom": m.headroom, "fits": m.fits},
    "timings": dict(pod.timings),
    "notes": list(pod.notes),
    "rule_skips": [str(s) for s in pod.plan.skips],
  }
  if pod.pipeline() is not None:
    out["pipeline"] = pod.pipeline()
  if pod.custom_calls:
    out["custom_calls"] = list(pod.custom_calls)
  if pod.attention:
    out["attention"] = [dataclasses.asdict(d) for d in pod.attention]
  if pod.flops is not None:
    out["flops"] = dict(pod.flops)
  if pod.estimated_cycles is not None:
    out["estimated_cycles"] = pod.estimated_cycles
  if pod.collectives is not None:
    out["collectives"] = collectives_lib.as_dicts(collectives_lib.summarize(pod.collectives))
    out["wire_bytes"] = pod.wire_bytes()
    out["optimizer_wire_bytes"] = collectives_lib.optimizer_wire_bytes(pod.collectives)
  if t is not None:
    out["time"] = {**dataclasses.asdict(t), "step_s": t.step_s, "mfu": t.mfu}
  return out
