#!/usr/bin/env bash
# Train on a Cloud TPU slice (or several, multislice) from your workstation:
# create the TPU VM or queued resource, install this checkout on every
# worker, run the same distrib-train command on all of them (JAX finds the
# other workers by itself), fetch every worker's log, and optionally delete
# the TPU. It only drives `gcloud`; it does not build images (see docker/)
# and it does not manage buckets: the workdir must be a gs:// path that the
# TPU's service account can write.
#
#   bash launch/tpu_pod.sh --name my-v4 --zone us-central2-b \
#       --accelerator-type v4-32 --config llama-1b-tpu --mesh-config tpu-v4-32 \
#       --workdir gs://my-bucket/runs/1b --dry-run
#
# `--help` lists every option; `--dry-run` prints the commands, one per line,
# shell-quoted, and runs none of them.
set -euo pipefail

PROG=tpu_pod.sh
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# On every worker: the copied checkout, the virtualenv, the run's log
# ($HOME is expanded there, not here).
# shellcheck disable=SC2016
REMOTE_SRC='$HOME/distrib_train'
# shellcheck disable=SC2016
REMOTE_VENV='$HOME/distrib_train-venv'
# shellcheck disable=SC2016
REMOTE_LOG='$HOME/distrib_train-logs/train.log'
POLL_SECONDS=30

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh --name NAME --zone ZONE --accelerator-type TYPE
           --config CONFIG --mesh-config MESH --workdir gs://BUCKET/PATH [options] [-- TRAINER_FLAGS...]

Creates a Cloud TPU VM (or a queued resource), installs this checkout on
every worker, runs distrib-train on all workers at once, copies each
worker's log back, and with --delete deletes the TPU afterwards.

TPU
  --name NAME              TPU VM / queued-resource name (lowercase, digits, '-')
  --zone ZONE              e.g. us-central2-b
  --project PROJECT        default: gcloud's configured project
  --accelerator-type TYPE  v4-32, v5litepod-256, v5p-1024, v6e-64, ... (cores for
                           v2-v4/v5p, chips for v5litepod/v6e, as gcloud counts)
  --version RUNTIME        TPU software version; default by generation:
                           v4 tpu-ubuntu2204-base, v5litepod v2-alpha-tpuv5-lite,
                           v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e
  --slices N               N > 1: a multislice queued resource of N slices
                           (--node-count); use a mesh config with a dcn axis,
                           e.g. tpu-v5p-1024-2slices (default 1)
  --queued                 ask for a queued resource even for one slice
  --spot                   Spot capacity
  --create-flag FLAG       pass FLAG to the create command (repeatable),
                           e.g. --create-flag=--network=my-net
  --reuse                  the TPU / queued resource exists already: skip creation
                           (give --queued or --slices for a queued resource)

Install (default: copy this checkout to every worker and install it over the
lock of tested versions, requirements/py<VERSION>/tpu.txt)
  --pip-spec SPEC          instead, pip install SPEC (unlocked) on every worker, e.g.
                           'distrib_train[tpu] @ git+https://github.com/ORG/distrib_train@v0.1.0'
  --python VERSION         Python for the workers' virtualenv (default 3.11);
                           made with uv, which fetches it when the image lacks it
  --skip-install           the workers are installed already

Training (the same command on every worker)
  --config CONFIG          preset (llama-1b-tpu, ...) or a YAML path in this checkout
  --mesh-config MESH       name in mesh_configs/ or a YAML path
  --workdir DIR            gs://BUCKET/PATH, storage every worker sees
  --set KEY=VALUE          config override (repeatable)
  --steps N                total steps
  --env NAME=VALUE         environment variable for the trainer (repeatable)
  -- FLAGS...              anything after -- goes to distrib-train unchanged

Afterwards
  --logs DIR               where worker logs land (default tpu_logs/NAME):
                           DIR/<worker>.log, or DIR/slice-<i>/<worker>.log
  --delete                 delete the TPU / queued resource when the run ends,
                           whatever its outcome
  --delete-only            only delete it (needs --name, --zone, and --queued or
                           --slices if it is a queued resource)

  --dry-run                print the commands, one per line, and run nothing
  -h, --help               this help

Exit status: 0 when every step worked; 2 for a bad option here (nothing is
run); otherwise the failing step's: gcloud's, which for the training step
is non-zero when the trainer failed on any worker (the trainer exits 0
finished or preempted, 2 bad flags/config, 3 halted on NaN).
Multi-worker ssh needs your key in an agent first: ssh-add ~/.ssh/google_compute_engine
EOF
}

die() {
  echo "$PROG: error: $*" >&2
  exit 2
}

# The names of the YAML files in a folder, comma-separated (for error messages).
yaml_names() {
  local file names=()
  for file in "$1"/*.yaml; do
    file=${file##*/}
    names+=("${file%.yaml}")
  done
  local IFS=,
  printf '%s' "${names[*]}"
}

note() {
  echo "$PROG: $*" >&2
}

# quote / quote_all: POSIX shell quoting, shared with gke/render.sh.
# shellcheck source=launch/quote.sh
source "$(dirname "${BASH_SOURCE[0]}")/quote.sh"

# Runs a command, or with --dry-run prints it (stdout, one line).
run() {
  if ((dry_run)); then
    quote_all "$@"
    echo
    return 0
  fi
  note "+ $(quote_all "$@")"
  "$@"
}

# ---------------------------------------------------------------- options
name="" zone="" project="" accelerator="" version="" slices=1 queued=0 spot=0 reuse=0
pip_spec="" python_version=3.11 skip_install=0
config="" mesh_config="" workdir="" steps="" logs=""
delete=0 delete_only=0 dry_run=0
create_flags=() overrides=() envs=() trainer_flags=()

while (($#)); do
  opt=$1
  shift
  value="" has_value=0
  if [[ $opt == --*=* ]]; then
    value=${opt#*=}
    opt=${opt%%=*}
    has_value=1
  fi
  case $opt in
    -h | --help | --dry-run | --queued | --spot | --reuse | --skip-install | --delete | --delete-only)
      ((has_value)) && die "$opt takes no value."
      case $opt in
        -h | --help) usage; exit 0 ;;
        --dry-run) dry_run=1 ;;
        --queued) queued=1 ;;
        --spot) spot=1 ;;
        --reuse) reuse=1 ;;
        --skip-install) skip_install=1 ;;
        --delete) delete=1 ;;
        --delete-only) delete_only=1 ;;
      esac
      ;;
    --name | --zone | --project | --accelerator-type | --version | --slices | --create-flag | --pip-spec | \
      --python | --config | --mesh-config | --workdir | --set | --steps | --env | --logs)
      if ! ((has_value)); then
        if (($# == 0)) || [[ $1 == --* && $opt != --create-flag ]]; then
          die "$opt needs a value."
        fi
        value=$1
        shift
      fi
      [[ -n $value ]] || die "$opt needs a non-empty value."
      case $opt in
        --name) name=$value ;;
        --zone) zone=$value ;;
        --project) project=$value ;;
        --accelerator-type) accelerator=$value ;;
        --version) version=$value ;;
        --slices) slices=$value ;;
        --create-flag) create_flags+=("$value") ;;
        --pip-spec) pip_spec=$value ;;
        --python) python_version=$value ;;
        --config) config=$value ;;
        --mesh-config) mesh_config=$value ;;
        --workdir) workdir=$value ;;
        --set) overrides+=("$value") ;;
        --steps) steps=$value ;;
        --env) envs+=("$value") ;;
        --logs) logs=$value ;;
      esac
      ;;
    --)
      trainer_flags=("$@")
      break
      ;;
    *)
      die "unknown option '$opt' (see --help)."
      ;;
  esac
done

# ------------------------------------------------------------- validation
[[ -n $name ]] || die "--name is required."
[[ $name =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
  die "--name '$name': use lowercase letters, digits and '-', starting with a letter (at most 63)."
[[ -n $zone ]] || die "--zone is required (e.g. us-central2-b)."
[[ $zone =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone '$zone' is not a zone name like us-central2-b."
if [[ -n $project && ! $project =~ ^([a-z][-a-z0-9.]*:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$ ]]; then
  die "--project '$project' is not a project ID (6-30 lowercase letters, digits, '-')."
fi
[[ $slices =~ ^[1-9][0-9]*$ ]] || die "--slices '$slices': expected a positive integer."
((slices > 1)) && queued=1

if ((delete_only)); then
  if [[ -n $config || -n $mesh_config || -n $workdir || $reuse == 1 || $delete == 1 ]]; then
    die "--delete-only takes only --name, --zone, --project and --queued/--slices."
  fi
fi

generation=""
if [[ -n $accelerator ]]; then
  if [[ $accelerator =~ ^v5e-[0-9]+$ ]]; then
    die "--accelerator-type '$accelerator': Cloud TPU calls v5e 'v5litepod', e.g. v5litepod-${accelerator#v5e-}."
  fi
  [[ $accelerator =~ ^(v2|v3|v4|v5p|v5litepod|v6e)-([1-9][0-9]*)$ ]] ||
    die "--accelerator-type '$accelerator' is not a TPU type like v4-32, v5litepod-256, v5p-1024 or v6e-64."
  generation=${BASH_REMATCH[1]}
  size=${BASH_REMATCH[2]}
fi
if [[ -n $version && ! $version =~ ^[a-z0-9][-a-z0-9._]*$ ]]; then
  die "--version '$version' is not a TPU software version like tpu-ubuntu2204-base."
fi

need_create=$((!delete_only && !reuse))
need_run=$((!delete_only))
if ((need_create)); then
  [[ -n $accelerator ]] || die "--accelerator-type is required to create the TPU (or pass --reuse)."
  if [[ -z $version ]]; then
    case $generation in
      v4) version=tpu-ubuntu2204-base ;;
      v5litepod) version=v2-alpha-tpuv5-lite ;;
      v5p) version=v2-alpha-tpuv5 ;;
      v6e) version=v2-alpha-tpuv6e ;;
      *) die "--version is required for $generation (no default runtime for it here)." ;;
    esac
  fi
fi

if ((need_run)); then
  [[ -n $config ]] || die "--config is required (a preset such as llama-1b-tpu, or a YAML path)."
  [[ -n $mesh_config ]] || die "--mesh-config is required (a name in mesh_configs/ or a YAML path)."
  [[ -n $workdir ]] || die "--workdir is required (gs://BUCKET/PATH)."
  [[ $config =~ ^[A-Za-z0-9_./~-]+$ ]] || die "--config '$config': use a preset name or a plain path."
  if [[ $config != */* && $config != *.yaml && $config != *.yml && ! -f $ROOT/distrib_train/configs/$config.yaml ]]; then
    die "--config '$config' is not a preset ($(yaml_names "$ROOT/distrib_train/configs"))."
  fi
  [[ $mesh_config =~ ^[A-Za-z0-9_./~-]+$ ]] || die "--mesh-config '$mesh_config': use a name or a plain path."
  mesh_file=""
  if [[ $mesh_config == */* || $mesh_config == *.yaml || $mesh_config == *.yml ]]; then
    [[ -f $mesh_config ]] && mesh_file=$mesh_config
  elif [[ -f $ROOT/mesh_configs/$mesh_config.yaml ]]; then
    mesh_file=$ROOT/mesh_configs/$mesh_config.yaml
  else
    die "--mesh-config '$mesh_config' is not in mesh_configs/ ($(yaml_names "$ROOT/mesh_configs"))."
  fi
  if [[ $workdir != gs://?* ]]; then
    [[ $workdir == /* ]] || die "--workdir '$workdir': every worker must see it; use gs://BUCKET/PATH."
    note "note: --workdir $workdir must be a file system mounted on every worker (NFS, Filestore)."
  fi
  [[ $workdir =~ ^[A-Za-z0-9_./:=@+-]+$ ]] || die "--workdir '$workdir' has characters outside [A-Za-z0-9_./:=@+-]."
  if [[ -n $steps && ! $steps =~ ^[1-9][0-9]*$ ]]; then
    die "--steps '$steps': expected a positive integer."
  fi
  for item in ${overrides[@]+"${overrides[@]}"}; do
    [[ $item =~ ^[A-Za-z_][A-Za-z0-9_.]*= ]] || die "--set '$item': expected KEY=VALUE, e.g. --set train.steps=100."
  done
  for item in ${envs[@]+"${envs[@]}"}; do
    [[ $item =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env '$item': expected NAME=VALUE, e.g. --env LIBTPU_INIT_ARGS=..."
  done
  [[ $python_version =~ ^3\.[0-9]+$ ]] || die "--python '$python_version': expected a version like 3.11."

  # The mesh must cover the job's devices: catch a mismatch before paying for a TPU.
  if [[ -n $mesh_file && -n $generation ]]; then
    mesh_devices=$(sed -n 's/^devices:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$mesh_file" | head -n 1)
    mesh_granules=$(sed -n 's/^granules:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$mesh_file" | head -n 1)
    case $generation in
      v4 | v5p) per_slice=$((size / 2)) ;;  # one JAX device per chip (megacore), two cores per chip
      *) per_slice=$size ;;
    esac
    if [[ -n $mesh_devices ]] && ((mesh_devices != per_slice * slices)); then
      die "--mesh-config $mesh_config is for $mesh_devices devices, but $slices x $accelerator has $((per_slice * slices))."
    fi
    if [[ ${mesh_granules:-1} != "$slices" ]]; then
      die "--mesh-config $mesh_config is for ${mesh_granules:-1} slice(s) (granules) but --slices is $slices."
    fi
  fi
fi

# --------------------------------------------------------------- commands
location=(--zone="$zone")
[[ -n $project ]] && location+=(--project="$project")
if ((queued)); then
  kind=(queued-resources)
  targets=(--node=all --worker=all)
else
  kind=(tpu-vm)
  targets=(--worker=all)
fi
logs=${logs:-tpu_logs/$name}
tarball="${TMPDIR:-/tmp}/distrib_train-$name.tar.gz"

create() {
  local cmd
  if ((queued)); then
    cmd=(gcloud compute tpus queued-resources create "$name" "${location[@]}"
      --accelerator-type="$accelerator" --runtime-version="$version")
    if ((slices > 1)); then
      cmd+=(--node-count="$slices" --node-prefix="$name")
    else
      cmd+=(--node-id="$name")
    fi
  else
    cmd=(gcloud compute tpus tpu-vm create "$name" "${location[@]}"
      --accelerator-type="$accelerator" --version="$version")
  fi
  ((spot)) && cmd+=(--spot)
  run "${cmd[@]}" ${create_flags[@]+"${create_flags[@]}"} || return
  ((queued)) || return 0
  wait_until_active
}

# A queued resource is accepted at once and provisioned later; poll its state.
wait_until_active() {
  local describe=(gcloud compute tpus queued-resources describe "$name" "${location[@]}" --format='value(state.state)')
  if ((dry_run)); then
    run "${describe[@]}"
    return 0
  fi
  local state last=""
  note "waiting for queued resource $name to become ACTIVE (polling every $POLL_SECONDS s)"
  while true; do
    state=$("${describe[@]}") || return
    if [[ $state != "$last" ]]; then
      note "queued resource $name: $state"
      last=$state
    fi
    case $state in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDED) note "queued resource $name is $state; see: gcloud compute tpus queued-resources describe $name --zone=$zone"; return 1 ;;
    esac
    sleep "$POLL_SECONDS"
  done
}

install() {
  local venv_python="$REMOTE_VENV/bin/python"
  local make_venv="[ -x \"$venv_python\" ] || { { python3 -m pip install --user --quiet uv || python3 -m pip install --user --quiet --break-system-packages uv; } && \"\$HOME/.local/bin/uv\" venv --seed --python $python_version \"$REMOTE_VENV\"; }"
  local script
  if [[ -n $pip_spec ]]; then
    script="set -e; $make_venv; \"$REMOTE_VENV/bin/pip\" install --quiet --upgrade pip; \"$REMOTE_VENV/bin/pip\" install --quiet $(quote "$pip_spec")"
  else
    run tar -czf "$tarball" --exclude=.git --exclude=.venv --exclude='.ci-venv*' --exclude=.ci-tools --exclude=.ci-upgrade --exclude=.pytest-xla-cache --exclude='.ci-install-*.log' --exclude=__pycache__ \
      --exclude='*.egg-info' --exclude=.pytest_cache --exclude=./build --exclude=./dist --exclude=./tpu_logs \
      -C "$ROOT" . || return
    run gcloud compute tpus "${kind[@]}" scp "$tarball" "$name:distrib_train.tar.gz" "${location[@]}" "${targets[@]}" || return
    script="set -e; rm -rf \"$REMOTE_SRC\"; mkdir -p \"$REMOTE_SRC\"; tar -xzf \"\$HOME/distrib_train.tar.gz\" -C \"$REMOTE_SRC\"; $make_venv; \"$REMOTE_VENV/bin/python\" \"$REMOTE_SRC/requirements/lock.py\" install tpu --venv \"$REMOTE_VENV\"; \"$REMOTE_VENV/bin/pip\" install --quiet --no-deps \"$REMOTE_SRC\""
  fi
  run gcloud compute tpus "${kind[@]}" ssh "$name" "${location[@]}" "${targets[@]}" --command="$script"
}

train() {
  local trainer=(--config="$config" --mesh_config="$mesh_config" --workdir="$workdir")
  local item
  for item in ${overrides[@]+"${overrides[@]}"}; do trainer+=(--set="$item"); done
  [[ -n $steps ]] && trainer+=(--steps="$steps")
  trainer+=(${trainer_flags[@]+"${trainer_flags[@]}"})
  local env_prefix=""
  ((${#envs[@]})) && env_prefix="env $(quote_all "${envs[@]}") "
  # cd into the checkout so mesh_configs/ and relative config paths resolve;
  # pipefail so the trainer's exit status, not tee's, comes back.
  local script
  script="set -o pipefail; mkdir -p \"\$HOME/distrib_train-logs\"; cd \"$REMOTE_SRC\" 2>/dev/null || cd; ${env_prefix}\"$REMOTE_VENV/bin/distrib-train\" $(quote_all "${trainer[@]}") 2>&1 | tee \"$REMOTE_LOG\""
  run gcloud compute tpus "${kind[@]}" ssh "$name" "${location[@]}" "${targets[@]}" --command="$script"
}

# Each worker's log, through gcloud's --output-directory (one <worker>.log per worker).
fetch_logs() {
  local fetch="cat \"$REMOTE_LOG\""
  if ((slices == 1)); then
    run mkdir -p "$logs" || return
    run gcloud compute tpus "${kind[@]}" ssh "$name" "${location[@]}" "${targets[@]}" --command="$fetch" \
      --output-directory="$logs"
    return
  fi
  local i
  for ((i = 0; i < slices; i++)); do
    run mkdir -p "$logs/slice-$i" || return
    run gcloud compute tpus queued-resources ssh "$name" "${location[@]}" --node="$i" --worker=all \
      --command="$fetch" --output-directory="$logs/slice-$i" || return
  done
}

teardown() {
  if ((queued)); then
    # --force also deletes the TPU nodes the queued resource made.
    run gcloud compute tpus queued-resources delete "$name" "${location[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$name" "${location[@]}" --quiet
  fi
}

# ------------------------------------------------------------------- flow
if ((delete_only)); then
  teardown
  exit
fi

status=0
if ((need_create)); then
  create || status=$?
  if ((status)); then
    note "creating $name failed (status $status)."
    if ((delete)); then teardown || true; fi
    exit "$status"
  fi
fi
if ((!skip_install)); then
  install || status=$?
  ((status)) && note "installing on $name failed (status $status)."
fi
if ((!status)); then
  train || status=$?
  ((status)) && note "the trainer exited with status $status on some worker."
  fetch_logs || note "could not fetch the logs (status $?)."
  ((dry_run)) || note "worker logs are in $logs/"
fi
if ((delete)); then
  teardown || note "deleting $name failed (status $?); delete it by hand: $PROG --delete-only --name $name --zone $zone"
fi
exit "$status"
