#!/usr/bin/env bash
# The headline measurements on your GPU, in one command, beside bench/RESULTS.md's (bench/gpu.py says what runs):
#   bash bench/gpu.sh                  # every row, about 25 minutes on an H200
#   bash bench/gpu.sh --only bare,fp8  # some rows
#   bash bench/gpu.sh --smoke          # toy sizes on 8 emulated CPU devices: checks the script, no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/gpu.py "$@"
