# Sourced by the issue scripts here, with $log set: installs the carried wheels (.whl/, Python 3.12) where
# Python finds them, and defines run LIMIT COMMAND...: the command under a time limit, its output's tail
# (without the runtime's log lines) appended to $log.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD
start=$SECONDS
run() {
  local limit=$1
  shift
  echo "=== [$((SECONDS - start)) s] $*" | tee -a "$log"
  timeout "$limit" "$@" > /tmp/run.out 2>&1
  echo "exit $?" >> /tmp/run.out
  grep -v "^W[0-9]\{4\} \|^I[0-9]\{4\} \|cuda_executor\|bfc_allocator" /tmp/run.out | tail -n 30 | tee -a "$log"
}
