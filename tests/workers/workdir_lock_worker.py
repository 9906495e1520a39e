"""Worker: the workdir lock's job-wide checks, twice in one 2-process job (as two trainers in one job make them).

argv: WORKDIR
"""

import sys

import mp_harness

mp_harness.worker_init()

from distrib_train.train import workdir_lock  # noqa: E402

workdir = sys.argv[1]
outcomes = []
for _ in range(2):  # each run probes, takes and releases the lock
  workdir_lock.check_free_for_job(workdir)
  lock = workdir_lock.acquire_for_job(workdir)
  outcomes.append("taken")
  lock.release()
held = workdir_lock.acquire_for_job(workdir)  # a third run holds it: a fourth is refused in every process
try:
  workdir_lock.check_free_for_job(workdir)
  outcomes.append("not refused")
except workdir_lock.WorkdirInUseError as e:
  outcomes.append(str(e))
mp_harness.write_result(outcomes)
