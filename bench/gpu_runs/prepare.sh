#!/usr/bin/env bash
# Builds what the issue scripts here carry to the GPU machine, on this (CPU) machine, from the repository root:
#   .whl/       wheels for the GPU image's Python 3.12 that it lacks (grain and its needs, tensorboardX)
#   .gpu_data/  corpus.jsonl: the Python standard library's modules as JSONL (`text`), about 11 MB, from the
#               pyenv Python 3.12 here; tokenizer.json: a 16,384-token byte-level BPE trained on it
# Both paths are ignored by git (.git/info/exclude) and named in the device tool's `carry`. The BPE is trained
# with `tokenizers` (installed here if missing); training on the same corpus gives the same merges.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
grep -qx '/.gpu_data/' .git/info/exclude 2>/dev/null || echo /.gpu_data/ >> .git/info/exclude
mkdir -p .whl .gpu_data
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl grain==0.2.18 array-record==0.8.6 portpicker tensorboardX dm-tree importlib_resources
stdlib=$("$(pyenv root)/versions/3.12.1/bin/python3.12" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
python3 -c 'import tokenizers' 2>/dev/null || python3 -m pip install -q tokenizers
python3 - "$stdlib" <<'PY'
import json, pathlib, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

root = pathlib.Path(sys.argv[1])
total = 0
with open(".gpu_data/corpus.jsonl", "w") as out:
  for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
    if "site-packages" in path.parts or "test" in path.parts[-2]:
      continue
    try:
      text = path.read_text("utf-8")
    except (UnicodeDecodeError, OSError):
      continue
    out.write(json.dumps({"text": text}) + "\n")
    total += len(text.encode())
    if total > 11.5e6:
      break
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=16384, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              special_tokens=["<|endoftext|>"], show_progress=False)
tokenizer.train_from_iterator((json.loads(line)["text"] for line in open(".gpu_data/corpus.jsonl")), trainer)
tokenizer.save(".gpu_data/tokenizer.json")
print(f".gpu_data: {total / 1e6:.1f} MB of text, a BPE of {tokenizer.get_vocab_size()} tokens")
PY
du -sh .whl .gpu_data
