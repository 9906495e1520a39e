#!/usr/bin/env bash
# Issue 32's GPU checks, in one call of the device tool (H100 or H200, jax 0.11 image without grain):
#   bash bench/gpu_runs/issue32.sh a   # attention check and timings, 124m synthetic and real text, a refusal
#   bash bench/gpu_runs/issue32.sh b   # 1b as shipped in bf16 and fp8, unpacked real text
#   bash bench/gpu_runs/issue32.sh c   # what is left: real text with the lanes in worker processes, unpacked
#                                      # with four workers, FP8's policy on the small presets, attention table,
#                                      # the 1b with delayed FP8
#   bash bench/gpu_runs/issue32.sh d   # unpacked real text with only documents' heads tokenized (4 and 12
#                                      # workers); FP8 products by layout (bench/fp8_gemms.py, Triton and cuBLAS)
#   bash bench/gpu_runs/issue32.sh e   # the 1b's bare step in bf16 and FP8 (current, delayed), Triton GEMMs
#                                      # against cuBLAS (bench/NOTES.md levers 15 and 16)
#   bash bench/gpu_runs/issue32.sh f   # what is left, in one call (about 9 minutes): on-the-fly BPE on the host's
#                                      # cores (issue 33), unpacked real text with documents' heads tokenized,
#                                      # then e's settings under a shorter time budget, the likeliest first
#   bash bench/gpu_runs/issue32.sh g   # where FP8's time goes (about 6 minutes): profiles of the 1b's step in bf16
#                                      # and FP8 (delayed) at B 16 with the autotuner's choices, then the FP8
#                                      # products alone (bench/fp8_gemms.py)
#   bash bench/gpu_runs/issue32.sh h   # the 1b at B 16 in bf16 and FP8 (delayed), each with the autotuner's
#                                      # exhaustive Triton tile search and without (bench/NOTES.md lever 18)
#   bash bench/gpu_runs/issue32.sh i   # g and h in one shorter call (about 6 minutes): the FP8 products alone,
#                                      # a profile of the 1b's FP8 (delayed) step with the autotuner's choices,
#                                      # then bf16 and delayed with and without the exhaustive tile search
#   bash bench/gpu_runs/issue32.sh j   # FP8's GEMMs writing bf16 (bench/NOTES.md lever 20): the 1b at B 16 in
#                                      # bf16, delayed and current, then the trainer with delayed FP8
# Needs .whl/ (grain, array-record, portpicker, tensorboardX wheels for Python 3.12) and .gpu_data/
# (corpus.jsonl and tokenizer.json) carried along: `bash bench/gpu_runs/prepare.sh` builds both. Writes $OUT/issue32-<part>.log and the benches' JSON.
set -u
part=${1:-a}
out=${OUT:-/tmp}
log=$out/issue32-$part.log
source bench/gpu_runs/common.sh
# The bare step and the trainer compile the same program: the second reads it from this cache.
export JAX_COMPILATION_CACHE_DIR=/tmp/xla-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
text=(--text .gpu_data/corpus.jsonl --tokenizer hf:.gpu_data/tokenizer.json)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tail -1 | tee -a "$log"
if [[ $part == a ]]; then
  run 150 python3 bench/gpu_attention.py
  run 90 python3 bench/gpu_attention.py --kv_heads 4 --documents 7 --max_segments 8 --iters 5
  run 200 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 60 --json "$out/124m-synthetic.json"
  run 240 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 60 "${text[@]}" --json "$out/124m-text.json"
  run 120 python3 -m distrib_train --config llama-124m-gpu --workdir /tmp/refused --steps 5 \
    --set data.global_batch_size=512
  find /tmp/refused 2>&1 | tee -a "$log"
elif [[ $part == c ]]; then
  run 200 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 60 "${text[@]}" --json "$out/124m-text-w1.json"
  run 200 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 30 "${text[@]}" --set data.packing=false \
    --set data.num_workers=4 --json "$out/124m-unpacked-w4.json"
  run 150 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 60 --set model.fp8=current \
    --json "$out/124m-fp8.json"
  run 150 python3 bench/gpu_attention.py
  run 170 python3 bench/trainer_loop.py --config llama-1b-gpu --steps 30 --set model.fp8=delayed \
    --json "$out/1b-fp8-delayed.json"
elif [[ $part == d ]]; then
  run 100 python3 bench/fp8_gemms.py --json "$out/fp8-gemms.json"
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false run 100 python3 bench/fp8_gemms.py --json "$out/fp8-gemms-cublas.json"
  run 170 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 30 "${text[@]}" --set data.packing=false \
    --set data.num_workers=4 --json "$out/124m-unpacked-heads-w4.json"
  run 170 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 30 "${text[@]}" --set data.packing=false \
    --set data.num_workers=12 --json "$out/124m-unpacked-heads-w12.json"
elif [[ $part == e ]]; then
  base="scan=0,loss_remat=0,batch=16"
  run 560 python3 bench/train_throughput.py --shapes 1b --reference none --sweep --time_budget 480 --json \
    "$out/1b-fp8-gemms.json" --settings "$base;$base,fp8=current;$base,fp8=delayed;$base,fp8=current,xla_gpu_enable_triton_gemm=false;$base,xla_gpu_enable_triton_gemm=false;$base,fp8=delayed,xla_gpu_enable_triton_gemm=false"
elif [[ $part == f ]]; then
  nproc | tee -a "$log"
  bpe=(--sizes 100MB --formats jsonl --tokenizer hf:.gpu_data/tokenizer.json --dir /tmp/data-bench --seconds 10)
  for workers in 12 15; do
    run 120 python3 bench/data_bench.py "${bpe[@]}" --num_workers $workers --json "$out/data-w$workers.json"
  done
  for workers in 4 12; do
    run 110 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 30 "${text[@]}" --set data.packing=false \
      --set data.num_workers=$workers --json "$out/124m-unpacked-heads-w$workers.json"
  done
  base="scan=0,loss_remat=0,batch=16"
  cublas=xla_gpu_enable_triton_gemm=false
  run 320 python3 bench/train_throughput.py --shapes 1b --reference none --sweep --time_budget 200 --json \
    "$out/1b-fp8-gemms.json" --settings "$base;$base,fp8=delayed;$base,fp8=current,$cublas;$base,fp8=delayed,$cublas;$base,$cublas;$base,fp8=current"
elif [[ $part == g ]]; then
  for mode in bf16 delayed; do
    settings="scan=0,loss_remat=0,batch=16"
    [[ $mode == bf16 ]] || settings="$settings,fp8=$mode"
    # the Triton configurations the autotuner picked for each GEMM fusion (deviceless, XLA takes a default one)
    XLA_FLAGS="--xla_gpu_dump_autotune_results_to=$out/autotune-1b-$mode.txt" \
      run 170 python3 bench/profile_step.py --shape 1b --settings "$settings" --steps 2 --top 40 \
      --out "/tmp/prof-$mode" --json "$out/profile-1b-$mode.json"
  done
  run 120 python3 bench/fp8_gemms.py --json "$out/fp8-gemms.json"
elif [[ $part == h ]]; then
  base="scan=0,loss_remat=0,batch=16"
  tiles=xla_gpu_exhaustive_tiling_search=true
  run 560 python3 bench/train_throughput.py --shapes 1b --reference none --sweep --time_budget 480 --json \
    "$out/1b-fp8-tiles.json" --settings "$base;$base,fp8=delayed;$base,fp8=delayed,$tiles;$base,$tiles"
elif [[ $part == i ]]; then
  run 110 python3 bench/fp8_gemms.py --json "$out/fp8-gemms.json"
  XLA_FLAGS="--xla_gpu_dump_autotune_results_to=$out/autotune-1b-delayed.txt" \
    run 140 python3 bench/profile_step.py --shape 1b --settings "scan=0,loss_remat=0,batch=16,fp8=delayed" \
    --steps 2 --top 40 --out /tmp/prof-delayed --json "$out/profile-1b-delayed.json"
  base="scan=0,loss_remat=0,batch=16"
  tiles=xla_gpu_exhaustive_tiling_search=true
  run 230 python3 bench/train_throughput.py --shapes 1b --reference none --sweep --time_budget 150 --json \
    "$out/1b-fp8-tiles.json" --settings "$base;$base,fp8=delayed;$base,fp8=delayed,$tiles;$base,$tiles"
elif [[ $part == j ]]; then
  base="scan=0,loss_remat=0,batch=16"
  run 400 python3 bench/train_throughput.py --shapes 1b --reference none --sweep --json "$out/1b-fp8-bf16-out.json" \
    --settings "$base;$base,fp8=delayed;$base,fp8=current"
  # the bare step and the trainer's subprocess each compile (about 160 s each with FP8 on an H200)
  run 420 python3 bench/trainer_loop.py --config llama-1b-gpu --steps 30 --set model.fp8=delayed \
    --json "$out/1b-trainer-fp8-delayed.json"
else
  run 200 python3 bench/trainer_loop.py --config llama-1b-gpu --steps 30 --json "$out/1b.json"
  run 120 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 60 "${text[@]}" --json "$out/124m-text.json"
  run 160 python3 bench/trainer_loop.py --config llama-1b-gpu --steps 30 --set model.fp8=current \
    --json "$out/1b-fp8.json"
  run 100 python3 bench/trainer_loop.py --config llama-124m-gpu --steps 30 "${text[@]}" --set data.packing=false \
    --json "$out/124m-unpacked.json"
fi
echo "=== done in $((SECONDS - start)) s" | tee -a "$log"
