#!/usr/bin/env bash
# Runs penzai's and flax's own TrainState tests against distrib_train, with
# only their import of the training module changed. The upstream files are
# not part of this repository: point the script at checkouts of them.
#
#   tests/upstream/run.sh PENZAI_CHECKOUT FLAX_CHECKOUT
#
# PENZAI_CHECKOUT: google-deepmind/penzai (v0.2.5 matches `pip install .[penzai]`);
# FLAX_CHECKOUT: google/flax at the tag of the installed flax (v0.12.x).
# Each may also be a bare git directory; PENZAI_REF / FLAX_REF pick the
# tag or commit to read (default HEAD).
set -euo pipefail

if (($# != 2)); then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
penzai_src=$1
flax_src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Reads FILE from a checkout, or from a bare repository at REF.
read_file() {
  local repo=$1 ref=$2 file=$3
  if [[ -f "$repo/$file" ]]; then
    cat "$repo/$file"
  else
    git --git-dir="$repo" show "$ref:$file"
  fi
}

for f in tests/deprecated/v1/example_models/simple_mlp_test.py tests/deprecated/v1/toolshed/lora_test.py; do
  read_file "$penzai_src" "${PENZAI_REF:-HEAD}" "$f" |
    sed 's/^from penzai\.deprecated\.v1\.toolshed import basic_training$/import distrib_train as basic_training/' \
      >"$work/$(basename "$f")"
  grep -q '^import distrib_train as basic_training$' "$work/$(basename "$f")"
done
for f in tests/cursor_test.py tests/linen/linen_test.py tests/serialization_test.py; do
  read_file "$flax_src" "${FLAX_REF:-HEAD}" "$f" |
    sed 's/^from flax\.training import train_state$/import distrib_train as train_state/' >"$work/$(basename "$f")"
  grep -q '^import distrib_train as train_state$' "$work/$(basename "$f")"
done
read_file "$flax_src" "${FLAX_REF:-HEAD}" flax/training/train_state.py >"$work/flax_train_state.py"

cd "$work"
echo "== penzai v1 tests (basic_training -> distrib_train)"
python -m pytest -q -p no:cacheprovider simple_mlp_test.py lora_test.py
echo "== flax tests (flax.training.train_state -> distrib_train)"
# test_find_all's predicate `'params' in path` also matches distrib_train's
# extra field model_without_params, so it finds two nodes where flax has one.
python -m pytest -q -p no:cacheprovider cursor_test.py linen_test.py serialization_test.py -k 'not test_find_all'
echo "== the docstring example of flax's TrainState (import swapped)"
python - <<'PY'
import ast
import doctest

source = open("flax_train_state.py").read()
cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "TrainState")
doc = ast.get_docstring(cls).replace("from flax.training.train_state import TrainState",
                                     "from distrib_train import TrainState")
runner = doctest.DocTestRunner()
runner.run(doctest.DocTestParser().get_doctest(doc, {}, "TrainState", "flax_train_state.py", 0))
failed, attempted = runner.summarize(verbose=False)
print(f"{attempted - failed} passed, {failed} failed")
raise SystemExit(1 if failed or not attempted else 0)
PY
