#!/usr/bin/env bash
# Issue 34's GPU checks (and issue 33's 16-core figure), in one call of the device tool (H100 or H200):
#   bash bench/gpu_runs/issue34.sh a   # the Triton grouped matmul against ragged_dot (bf16 and FP8), then the
#                                      # MoE against its dense twin at the issue's shape: B 8 in bf16 and fp8
#   bash bench/gpu_runs/issue34.sh c   # the same at B 16, bf16 (each part fits one call's 600 s); on an H100 it ran
#                                      # out of memory (both models are kept on the card); an H200 may fit it
#   bash bench/gpu_runs/issue34.sh p   # where the MoE's extra time goes: B 8, bf16, then a profile of each model
#                                      # (about 1.5 minutes; on an H100 the MoE ran at 0.688 × dense, 2026-11-27)
#   bash bench/gpu_runs/issue34.sh b   # the machine's 16 CPU cores: on-the-fly BPE tokens/s with 0, 12 and 15
#                                      # workers, and 12 with a tokenizer thread per core each (the old default)
# Needs .whl/ (grain, array-record, portpicker, tensorboardX wheels for Python 3.12) and .gpu_data/tokenizer.json
# carried along (`bash bench/gpu_runs/prepare.sh` builds both). Writes $OUT/issue34-<part>.log and the benches' JSON.
set -u
part=${1:-a}
out=${OUT:-/tmp}
log=$out/issue34-$part.log
source bench/gpu_runs/common.sh
# The shape bench/RESULTS.md compiles deviceless (16 heads of 64, 32,000 tokens). The 2026-11-27 figure (0.688 ×)
# was taken with moe_step's defaults instead: 4 heads of 256 and 4,096 tokens.
shape=(--cpu_devices 0 --d_model 1024 --layers 12 --expert_mlp_dim 2816 --seq_len 2048 --dtype bfloat16
  --heads 16 --vocab 32000)
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -1 | tee -a "$log"
if [[ $part != b ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
fi
if [[ $part == a ]]; then
  run 100 python3 bench/gpu_runs/gmm_check.py
  run 180 python3 bench/moe_step.py "${shape[@]}" --batch 8 --json "$out/moe-b8.json"
  run 180 python3 bench/moe_step.py "${shape[@]}" --batch 8 --fp8 current --json "$out/moe-b8-fp8.json"
elif [[ $part == p ]]; then
  run 150 python3 bench/moe_step.py "${shape[@]}" --batch 8 --profile /tmp/moe-profile --json "$out/moe-b8-profile.json"
elif [[ $part == c ]]; then
  run 240 python3 bench/moe_step.py "${shape[@]}" --batch 16 --json "$out/moe-b16.json"
else
  nproc | tee -a "$log"
  lscpu | grep -E 'Model name|Thread|Core|Socket' | tee -a "$log"
  bpe=(--sizes 100MB --formats jsonl --tokenizer hf:.gpu_data/tokenizer.json --dir /tmp/data-bench --seconds 10)
  for workers in 0 12 15; do
    run 150 python3 bench/data_bench.py "${bpe[@]}" --num_workers $workers --json "$out/data-w$workers.json"
  done
  # Before beside after: every worker's tokenizer with a thread per core, as before worker_thread_env (measured
  # on 2 cores with 12 threads a worker: 0.81 of one thread a worker).
  run 150 env RAYON_NUM_THREADS="$(nproc)" python3 bench/data_bench.py "${bpe[@]}" --num_workers 12 \
    --json "$out/data-w12-threads-per-core.json"
fi
echo "=== done in $((SECONDS - start)) s" | tee -a "$log"
