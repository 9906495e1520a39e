"""A real one-node SLURM cluster for tests: munge + slurmctld + slurmd.

Debian's slurm 22.05 daemons run as root with a throwaway config (loopback,
free ports, state in a temporary directory); ``start`` writes the settings
this machine kind needs (checked on the project's machines: cgroup/v1 with
IgnoreSystemd, since ``CgroupPlugin=disabled`` makes slurmd fail).
``SlurmCluster.unavailable()`` says why a machine
cannot run one (missing packages, not root), for a skip message.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

# One SLURM test cluster per machine at a time (munged and the slurm user's
# daemons are machine-wide), whichever checkout or test run starts it.
_MACHINE_LOCK = "/tmp/distrib_train_slurm_tests.lock"
_BINARIES = ("slurmctld", "slurmd", "sbatch", "sinfo", "munged", "mungekey", "munge", "unmunge")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class SlurmCluster:
  """Start with ``start()``, submit with ``sbatch(...)``, end with ``stop()``."""

  def __init__(self, root: Path):
    self.root = Path(root)
    self.conf = self.root / "slurm.conf"
    self.env = dict(os.environ, SLURM_CONF=str(self.conf))
    self._started_munge = False

  @staticmethod
  def unavailable() -> str | None:
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
      return (
        f"SLURM/munge not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd"
        " slurm-client munge (.ci/run does)"
      )
    if os.geteuid() != 0:
      return "the SLURM daemons need root"
    return None

  def _munge_works(self) -> bool:
    try:
      token = subprocess.run(["munge", "-n"], capture_output=True, timeout=10).stdout
      return subprocess.run(["unmunge"], input=token, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
      return False

  def _start_munge(self) -> None:
    if self._munge_works():
      return
    for d in ("/etc/munge", "/run/munge", "/var/lib/munge", "/var/log/munge"):
      os.makedirs(d, exist_ok=True)
      shutil.chown(d, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():
      subprocess.run(["mungekey", "-c", "-k", str(key)], check=True)
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=30)
    self._started_munge = True
    deadline = time.time() + 20
    while not self._munge_works():
      if time.time() > deadline:
        raise RuntimeError("munged started but munge -n | unmunge fails")
      time.sleep(0.2)

  def start(self, timeout: float = 60, wait_for_machine: float = 240) -> None:
    """Starts the daemons once no other test run on this machine has its
    cluster up: munged is one per machine, and a second suite running beside
    this one would otherwise stop it under this one's jobs (or the reverse)."""
    self._take_machine(wait_for_machine)
    self._start_munge()
    host = socket.gethostname()
    for d in ("state", "spool", "log"):
      (self.root / d).mkdir(parents=True, exist_ok=True)
    self.conf.write_text(f"""\
ClusterName=dttest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}
SlurmctldPidFile={self.root / "slurmctld.pid"}
SlurmdPidFile={self.root / "slurmd.pid"}
SlurmctldLogFile={self.root / "log" / "slurmctld.log"}
SlurmdLogFile={self.root / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=20000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
    (self.root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n")
    subprocess.run(["slurmctld"], env=self.env, check=True, timeout=30)
    subprocess.run(["slurmd"], env=self.env, check=True, timeout=30)
    deadline = time.time() + timeout
    while time.time() < deadline:
      state = subprocess.run(
        ["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=10
      ).stdout.strip()
      if state in ("idle", "mixed", "allocated"):
        return
      time.sleep(0.5)
    raise RuntimeError(f"the SLURM node did not come up (state {state!r}); logs: {self.logs()}")

  def sbatch(self, *args: str, timeout: float, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``sbatch --wait ...``: returns when the job ends (its exit code).

    ``unset`` names variables to leave out of sbatch's environment (which
    ``--export=ALL`` hands on to the job).
    """
    env = {k: v for k, v in self.env.items() if k not in unset}
    return subprocess.run(["sbatch", "--wait", *args], env=env, capture_output=True, text=True, timeout=timeout)

  def logs(self) -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log"):
      path = self.root / "log" / name
      if path.exists():
        out.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
    return "\n".join(out)

  def _take_machine(self, wait: float) -> None:
    self._machine_lock = open(_MACHINE_LOCK, "a")  # noqa: SIM115 - held until stop()
    deadline = time.monotonic() + wait
    while True:
      try:
        fcntl.flock(self._machine_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
      except BlockingIOError:
        if time.monotonic() > deadline:
          self._machine_lock.close()
          self._machine_lock = None
          raise RuntimeError(f"another test run kept this machine's SLURM for {wait:.0f} s ({_MACHINE_LOCK})")
        time.sleep(1)

  def stop(self) -> None:
    try:
      self._stop_daemons()
    finally:
      if getattr(self, "_machine_lock", None) is not None:
        self._machine_lock.close()  # releases the flock
        self._machine_lock = None

  def _stop_daemons(self) -> None:
    subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, timeout=10)
    for name in ("slurmd.pid", "slurmctld.pid"):
      pidfile = self.root / name
      if pidfile.exists():
        try:
          pid = int(pidfile.read_text().strip())
          os.kill(pid, signal.SIGTERM)
          for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
        except (ValueError, ProcessLookupError):
          pass
    if self._started_munge:
      subprocess.run(["runuser", "-u", "munge", "--", "munged", "--stop"], capture_output=True, timeout=10)
