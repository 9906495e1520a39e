#!/usr/bin/env bash
# The local demo: the tiny Llama trained by N real processes × K emulated CPU
# devices on one machine (default 2 × 4), joined by jax.distributed through
# a coordinator on 127.0.0.1, with checkpoints in $WORKDIR. Run it again and
# it resumes from the last checkpoint (and, once done, stops at once).
#
#   bash launch/local.sh                       # creates .venv, installs the lock, trains
#   bash launch/local.sh --steps 500           # flags go to every process
#   WORKDIR=/tmp/other NPROC=1 DEVICES=8 bash launch/local.sh
#   bash launch/local.sh --dry-run             # print the commands, run nothing
#   bash launch/local.sh --install-only        # create and install the venv, train nothing
#
# Environment: VENV (default <repo>/.venv), WORKDIR (default
# /tmp/distrib_train_demo), NPROC, DEVICES, CONFIG (default tiny),
# MESH_CONFIG (default cpu-2proc for 2 processes, else cpu-8), TIMEOUT
# (seconds, default 900). Process 0 prints to the terminal; the others log
# to $WORKDIR/logs/. If one process fails, the others are stopped.
set -euo pipefail

# --dry-run, --install-only and --help count wherever they are: anywhere else
# they would reach the trainer after the venv and $WORKDIR/logs were made.
DRY_RUN=0
INSTALL_ONLY=0
trainer_args=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --install-only) INSTALL_ONLY=1 ;;
    *) trainer_args+=("$arg") ;;
  esac
done
set -- "${trainer_args[@]+"${trainer_args[@]}"}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
WORKDIR="${WORKDIR:-/tmp/distrib_train_demo}"
NPROC="${NPROC:-2}"
DEVICES="${DEVICES:-4}"
CONFIG="${CONFIG:-tiny}"
TIMEOUT="${TIMEOUT:-900}"
for name in NPROC DEVICES TIMEOUT; do
  if [[ ! "${!name}" =~ ^[1-9][0-9]*$ ]]; then
    echo "local.sh: error: $name must be a positive integer, got '${!name}'." >&2
    exit 2
  fi
done
if [[ -z "${MESH_CONFIG:-}" ]]; then
  if [[ "$NPROC" == 2 && "$DEVICES" == 4 ]]; then MESH_CONFIG=cpu-2proc; else MESH_CONFIG=cpu-8; fi
fi

start=$(date +%s)
if (( DRY_RUN )); then
  printf '%q ' python3 "$ROOT/requirements/lock.py" install base --venv "$VENV" --editable "$ROOT"; echo
  for ((i = 0; i < NPROC; i++)); do
    cmd=("$VENV/bin/python" -m distrib_train --config "$CONFIG" --mesh_config "$MESH_CONFIG"
         --workdir "$WORKDIR" --cpu_devices "$DEVICES" "$@")
    if (( NPROC > 1 )); then
      cmd+=(--coordinator_address "127.0.0.1:PORT" --num_processes "$NPROC" --process_id "$i")
    fi
    printf '%q ' timeout "$TIMEOUT" "${cmd[@]}"; echo
  done
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import distrib_train, grain, tensorboardX" 2>/dev/null; then
  # The lock of tested versions for this Python (requirements/py<X.Y>/base.txt), installed exactly, then the
  # checkout without dependencies. A lock that cannot be installed stops here in one line (lock: …).
  echo "Installing distrib_train into $VENV (the lock of tested versions, requirements/)"
  python3 "$ROOT/requirements/lock.py" install base --venv "$VENV" --editable "$ROOT" >/dev/null
fi
echo "Environment ready in $(( $(date +%s) - start )) s"
if (( INSTALL_ONLY )); then exit 0; fi

PORT="$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mkdir -p "$WORKDIR/logs"
pids=()
stop_all() {
  # ${a[@]+...}: an empty array is "unbound" to set -u in bash before 4.4.
  for pid in ${pids[@]+"${pids[@]}"}; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap 'stop_all; exit 143' TERM INT

for ((i = 0; i < NPROC; i++)); do
  args=(-m distrib_train --config "$CONFIG" --mesh_config "$MESH_CONFIG" --workdir "$WORKDIR"
        --cpu_devices "$DEVICES" "$@")
  if (( NPROC > 1 )); then
    args+=(--coordinator_address "127.0.0.1:$PORT" --num_processes "$NPROC" --process_id "$i")
  fi
  if (( i == 0 )); then
    timeout --signal=TERM --kill-after=30 "$TIMEOUT" "$VENV/bin/python" "${args[@]}" &
  else
    timeout --signal=TERM --kill-after=30 "$TIMEOUT" "$VENV/bin/python" "${args[@]}" \
      > "$WORKDIR/logs/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

status=0
for ((n = 0; n < NPROC; n++)); do
  if ! wait -n; then
    status=1
    echo "A process failed; stopping the others (logs in $WORKDIR/logs/)." >&2
    stop_all
    break
  fi
done
wait || true
echo "Finished with status $status in $(( $(date +%s) - start )) s; workdir $WORKDIR"
exit "$status"
