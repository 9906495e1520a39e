#!/usr/bin/env bash
# Fill in launch/gke/jobset-{tpu,gpu}.yaml for one run and, with --apply,
# hand it to kubectl. It checks what it fills in (names, the image, a gs://
# workdir, the mesh config against the slice or the node count) so a typo
# fails here and not after the pods are scheduled.
#
#   launch/gke/render.sh tpu --image IMAGE --workdir gs://BUCKET/run | kubectl apply -f -
#   launch/gke/render.sh gpu --image IMAGE --workdir gs://BUCKET/run --nodes 2 \
#       --mesh-config gpu-1x8xh100 --out run.yaml --apply --dry-run
#
# `--help` lists every option.
set -euo pipefail

PROG=render.sh
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

usage() {
  cat <<'EOF'
Usage: launch/gke/render.sh tpu|gpu --image IMAGE --workdir gs://BUCKET/PATH [options]

Prints the JobSet manifest for one run (or writes it to --out), with the
placeholders of launch/gke/jobset-tpu.yaml or jobset-gpu.yaml filled in.

  --image IMAGE            the image built from docker/Dockerfile.tpu or .gpu (required)
  --workdir DIR            gs://BUCKET/PATH the pods can write (required)
  --name NAME              JobSet name (default distrib-train-tpu / distrib-train-gpu)
  --config CONFIG          preset or YAML path inside the image
                           (default llama-7b-tpu / llama-7b-gpu)
  --mesh-config MESH       name in mesh_configs/ or a YAML path inside the image
                           (default tpu-v5e-256 / gpu-16x8xh100)
  --set KEY=VALUE          config override for the trainer (repeatable)
  --steps N                total steps

TPU (one slice, one pod per TPU host)
  --tpu v4|v5e|v5p|v6e     TPU generation of the node pool (default v5e)
  --topology TOPOLOGY      the node pool's topology: AxB for v5e/v6e, AxBxC for
                           v4/v5p (default 16x16, 256 chips on 64 hosts)

GPU (one pod per node, all its GPUs)
  --nodes N                nodes, one process each (default 16)
  --gpus-per-node G        GPUs per node (default 8)
  --gpu-type TYPE          the node label cloud.google.com/gke-accelerator
                           (default nvidia-h100-80gb)

  --out FILE               write the manifest to FILE instead of stdout
  --namespace NS           kubectl namespace for --apply
  --apply                  then run kubectl apply -f FILE (needs --out)
  --dry-run                run no command: print them (kubectl apply ...), one
                           per line; the manifest is still written to --out
  -h, --help               this help
EOF
}

die() {
  echo "$PROG: error: $*" >&2
  exit 2
}

# quote / quote_all: POSIX shell quoting, shared with tpu_pod.sh.
# shellcheck source=launch/quote.sh
source "$(dirname "${BASH_SOURCE[0]}")/../quote.sh"

run() {
  local out
  out=$(quote_all "$@")
  if ((dry_run)); then
    echo "$out"
    return 0
  fi
  echo "$PROG: + $out" >&2
  "$@"
}

# One YAML double-quoted scalar.
yaml_string() {
  local s=${1//\\/\\\\}
  printf '"%s"' "${s//\"/\\\"}"
}

# ---------------------------------------------------------------- options
(($#)) || die "name the target first: render.sh tpu|gpu --image IMAGE --workdir gs://BUCKET/PATH (see --help)."
case $1 in
  -h | --help) usage; exit 0 ;;
  tpu | gpu) target=$1; shift ;;
  *) die "unknown target '$1': expected tpu or gpu (see --help)." ;;
esac

image="" workdir="" name="" config="" mesh_config="" steps="" out="" namespace=""
tpu=v5e topology=16x16 nodes=16 gpus_per_node=8 gpu_type=nvidia-h100-80gb
apply=0 dry_run=0
overrides=()

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
    -h | --help | --apply | --dry-run)
      ((has_value)) && die "$opt takes no value."
      case $opt in
        -h | --help) usage; exit 0 ;;
        --apply) apply=1 ;;
        --dry-run) dry_run=1 ;;
      esac
      ;;
    --image | --workdir | --name | --config | --mesh-config | --set | --steps | --out | --namespace | \
      --tpu | --topology | --nodes | --gpus-per-node | --gpu-type)
      if ! ((has_value)); then
        if (($# == 0)) || [[ $1 == --* ]]; then
          die "$opt needs a value."
        fi
        value=$1
        shift
      fi
      [[ -n $value ]] || die "$opt needs a non-empty value."
      if [[ $target == tpu && $opt =~ ^--(nodes|gpus-per-node|gpu-type)$ ]] ||
        [[ $target == gpu && $opt =~ ^--(tpu|topology)$ ]]; then
        die "$opt is not an option for the $target manifest."
      fi
      case $opt in
        --image) image=$value ;;
        --workdir) workdir=$value ;;
        --name) name=$value ;;
        --config) config=$value ;;
        --mesh-config) mesh_config=$value ;;
        --set) overrides+=("$value") ;;
        --steps) steps=$value ;;
        --out) out=$value ;;
        --namespace) namespace=$value ;;
        --tpu) tpu=$value ;;
        --topology) topology=$value ;;
        --nodes) nodes=$value ;;
        --gpus-per-node) gpus_per_node=$value ;;
        --gpu-type) gpu_type=$value ;;
      esac
      ;;
    *)
      die "unknown option '$opt' (see --help)."
      ;;
  esac
done

# ------------------------------------------------------------- validation
name=${name:-distrib-train-$target}
# Pod host names (<name>-workers-0-<i>) must stay within 63 characters.
[[ $name =~ ^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$ ]] ||
  die "--name '$name': use lowercase letters, digits and '-', starting with a letter (at most 40)."
[[ -n $image ]] || die "--image is required (the image you pushed, built from docker/Dockerfile.$target)."
[[ $image =~ ^[a-z0-9][A-Za-z0-9._/:@-]*$ ]] ||
  die "--image '$image' is not an image reference like us-docker.pkg.dev/PROJECT/REPO/distrib-train:TAG."
[[ -n $workdir ]] || die "--workdir is required (gs://BUCKET/PATH)."
[[ $workdir =~ ^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9](/[A-Za-z0-9_./=@+-]*)?$ ]] ||
  die "--workdir '$workdir': expected gs://BUCKET/PATH, storage every pod sees."
if [[ $target == tpu ]]; then
  config=${config:-llama-7b-tpu}
  mesh_config=${mesh_config:-tpu-v5e-256}
else
  config=${config:-llama-7b-gpu}
  mesh_config=${mesh_config:-gpu-16x8xh100}
fi
[[ $config =~ ^[A-Za-z0-9_./-]+$ ]] || die "--config '$config': use a preset name or a plain path."
[[ $mesh_config =~ ^[A-Za-z0-9_./-]+$ ]] || die "--mesh-config '$mesh_config': use a name or a plain path."
if [[ $config != */* && $config != *.yaml && ! -f $ROOT/distrib_train/configs/$config.yaml ]]; then
  die "--config '$config' is not a preset in distrib_train/configs/."
fi
mesh_file=""
if [[ $mesh_config != */* && $mesh_config != *.yaml ]]; then
  mesh_file=$ROOT/mesh_configs/$mesh_config.yaml
  [[ -f $mesh_file ]] || die "--mesh-config '$mesh_config' is not in mesh_configs/."
fi
if [[ -n $steps && ! $steps =~ ^[1-9][0-9]*$ ]]; then
  die "--steps '$steps': expected a positive integer."
fi
for item in ${overrides[@]+"${overrides[@]}"}; do
  [[ $item =~ ^[A-Za-z_][A-Za-z0-9_.]*= ]] || die "--set '$item': expected KEY=VALUE, e.g. --set train.steps=100."
done
if [[ -n $namespace && ! $namespace =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]]; then
  die "--namespace '$namespace' is not a Kubernetes namespace name."
fi
if ((apply)) && [[ -z $out ]]; then
  die "--apply needs --out FILE, so that what was applied is kept."
fi

if [[ $target == tpu ]]; then
  case $tpu in
    v4) accelerator="tpu-v4-podslice" dims=3 ;;
    v5e) accelerator="tpu-v5-lite-podslice" dims=2 ;;
    v5p) accelerator="tpu-v5p-slice" dims=3 ;;
    v6e) accelerator="tpu-v6e-slice" dims=2 ;;
    *) die "--tpu '$tpu': expected v4, v5e, v5p or v6e." ;;
  esac
  if ((dims == 2)); then
    [[ $topology =~ ^([1-9][0-9]*)x([1-9][0-9]*)$ ]] || die "--topology '$topology': $tpu takes AxB, e.g. 16x16."
    chips=$((BASH_REMATCH[1] * BASH_REMATCH[2]))
  else
    [[ $topology =~ ^([1-9][0-9]*)x([1-9][0-9]*)x([1-9][0-9]*)$ ]] ||
      die "--topology '$topology': $tpu takes AxBxC, e.g. 2x2x4."
    chips=$((BASH_REMATCH[1] * BASH_REMATCH[2] * BASH_REMATCH[3]))
  fi
  # Multi-host slices have 4 chips per host; a v5e/v6e host can hold up to 8.
  if ((chips <= 4)) || { ((dims == 2)) && ((chips <= 8)); }; then
    hosts=1 chips_per_host=$chips
  else
    ((chips % 4 == 0)) || die "--topology '$topology' has $chips chips, not a multiple of 4 hosts' worth."
    hosts=$((chips / 4)) chips_per_host=4
  fi
  devices=$chips processes=1  # one slice: the mesh has no granules (DCN) axis
else
  [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes '$nodes': expected a positive integer."
  [[ $gpus_per_node =~ ^[1-9][0-9]*$ ]] || die "--gpus-per-node '$gpus_per_node': expected a positive integer."
  [[ $gpu_type =~ ^[a-z0-9][-a-z0-9]*$ ]] || die "--gpu-type '$gpu_type' is not a GKE accelerator name like nvidia-h100-80gb."
  devices=$((nodes * gpus_per_node)) processes=$nodes
fi

# The mesh must cover the job's devices, one granule per process.
if [[ -n $mesh_file ]]; then
  mesh_devices=$(sed -n 's/^devices:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$mesh_file" | head -n 1)
  mesh_granules=$(sed -n 's/^granules:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$mesh_file" | head -n 1)
  if [[ -n $mesh_devices ]] && ((mesh_devices != devices)); then
    die "--mesh-config $mesh_config is for $mesh_devices devices, but this job has $devices."
  fi
  if ((${mesh_granules:-1} != processes)); then
    die "--mesh-config $mesh_config has ${mesh_granules:-1} granules, but this job has $processes processes."
  fi
fi

# --------------------------------------------------------------- render
extra=()
for item in ${overrides[@]+"${overrides[@]}"}; do extra+=("--set=$item"); done
[[ -n $steps ]] && extra+=("--steps=$steps")

# The placeholders are literal ${NAME} words in the templates.
# shellcheck disable=SC2016
substitute() {
  local line=$1
  line=${line//'${JOB_NAME}'/$name}
  line=${line//'${IMAGE}'/$image}
  line=${line//'${WORKDIR}'/$workdir}
  line=${line//'${CONFIG}'/$config}
  line=${line//'${MESH_CONFIG}'/$mesh_config}
  if [[ $target == tpu ]]; then
    line=${line//'${NUM_HOSTS}'/$hosts}
    line=${line//'${CHIPS_PER_HOST}'/$chips_per_host}
    line=${line//'${TPU_ACCELERATOR}'/$accelerator}
    line=${line//'${TPU_TOPOLOGY}'/$topology}
  else
    line=${line//'${NUM_NODES}'/$nodes}
    line=${line//'${GPUS_PER_NODE}'/$gpus_per_node}
    line=${line//'${GPU_TYPE}'/$gpu_type}
  fi
  printf '%s\n' "$line"
}

render() {
  local line arg header=1
  echo "# Rendered from launch/gke/jobset-$target.yaml by launch/gke/render.sh."
  while IFS= read -r line || [[ -n $line ]]; do
    # The template's opening comment is about the template, not this run.
    if ((header)) && [[ $line == \#* ]]; then
      continue
    fi
    header=0
    if [[ $line =~ ^([[:space:]]*)#\ EXTRA_ARGS ]]; then
      for arg in ${extra[@]+"${extra[@]}"}; do
        printf '%s- %s\n' "${BASH_REMATCH[1]}" "$(yaml_string "$arg")"
      done
      continue
    fi
    substitute "$line"
  done <"$HERE/jobset-$target.yaml"
}

if [[ -n $out ]]; then
  render >"$out"
  echo "$PROG: wrote $out" >&2
else
  render
fi
if ((apply)); then
  apply_cmd=(kubectl apply)
  [[ -n $namespace ]] && apply_cmd+=(--namespace="$namespace")
  run "${apply_cmd[@]}" -f "$out"
fi
