"""JSONL files opened through a kept index of line offsets, and the malformed-line policy (``data.bad_records``).

The index (``data/index_cache.py``, built by ``jsonl.scan_lines``) is
built by the first open and mapped by every later one, rebuilt when the file
changes, kept in the cache directory when the data's directory refuses it,
and built by one process when several open a new file at once. A malformed
line is found when it is read: skipped (logged with file and line, counted,
read as no document) or raised.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest

import data_helpers
import distrib_train as dt
from distrib_train import data
from distrib_train.data import index_cache, jsonl, record_shards


def _write(path, lines, end="\n"):
  path.write_bytes("".join(line + end for line in lines).encode())
  return str(path)


def _texts(reader):
  return [reader[i] for i in range(len(reader))]


def _reference_offsets(raw: bytes) -> list[int]:
  """Each non-blank line's offset, line by line in Python."""
  out, position = [], 0
  for line in raw.split(b"\n"):
    if line.strip(b" \t\r"):
      out.append(position)
    position += len(line) + 1
  return out


def test_the_index_is_built_once_and_mapped_by_the_next_open(tmp_path):
  path = _write(tmp_path / "a.jsonl", [json.dumps({"text": f"doc {i}"}) for i in range(50)])
  first = jsonl.JsonlFile(path, "text")
  second = jsonl.JsonlFile(path, "text")
  assert first.built_now and not second.built_now
  assert not second.offsets.flags.owndata and not second.offsets.flags.writeable  # mapped from the kept file
  assert _texts(second) == [f"doc {i}" for i in range(50)]
  data_mode = os.stat(path).st_mode & 0o777
  assert data_mode & 0o044  # readable by others: so is the index (a temporary file's 0o600 would not be)
  assert os.stat(tmp_path / ".a.jsonl.lines.dtindex").st_mode & 0o777 == data_mode & 0o444 | 0o200


def test_the_newline_scan_finds_every_non_blank_line_across_chunks(tmp_path, monkeypatch):
  """Blank lines (spaces, tabs, CR), CRLF, no final newline, an empty file and lines longer than a chunk."""
  rng = random.Random(0)
  pieces = [b"", b" ", b"\t", b"\r", b"x", b"{}", b"a b", b" \t\r ", b"yyyyyyyyyyyyyyyyyyyyyy"]
  mostly_ink = b"x\n" * 300 + b" \t\n" + b"x\n" * 50 + b"  y\r\n" + b"\r\n" + b"x\n" * 100  # few to look at
  for size in (0, 1, 3, 50, 400, -1):
    raw = mostly_ink if size < 0 else b"".join(rng.choice(pieces) + rng.choice([b"\n", b"\r\n"]) for _ in range(size))
    for tail in (b"", b"last", b"  "):
      path = tmp_path / f"s{size}.jsonl"
      path.write_bytes(raw + tail)
      for chunk in (5, 64 << 20):
        monkeypatch.setattr(jsonl, "_SCAN_BYTES", chunk)
        assert jsonl.scan_lines(str(path))["offsets"].tolist() == _reference_offsets(raw + tail), (size, tail)


def test_blank_lines_crlf_and_no_final_newline_read_right(tmp_path):
  raw = b'\r\n  \t\r\n{"text": "one"}\r\n\n{"text": "two\\r\\n"}\r\n \n{"text": "three"}'
  path = tmp_path / "c.jsonl"
  path.write_bytes(raw)
  reader = jsonl.JsonlFile(str(path), "text")
  assert _texts(reader) == ["one", "two\r\n", "three"]
  assert [reader.line_number(i) for i in range(3)] == [3, 5, 7]
  (tmp_path / "empty.jsonl").write_bytes(b"")
  (tmp_path / "blank.jsonl").write_bytes(b"\n \r\n\t")
  assert len(jsonl.JsonlFile(str(tmp_path / "empty.jsonl"), "text")) == 0
  assert len(jsonl.JsonlFile(str(tmp_path / "blank.jsonl"), "text")) == 0


@pytest.mark.parametrize("change", ["appended", "same_size_other_bytes", "touched"])
def test_a_changed_file_gets_a_new_index(tmp_path, change):
  path = tmp_path / "d.jsonl"
  _write(path, [json.dumps({"text": t}) for t in ("aa", "bb", "cc")])
  assert jsonl.JsonlFile(str(path), "text").built_now
  stat = os.stat(path)
  if change == "appended":
    with open(path, "a") as f:
      f.write(json.dumps({"text": "dd"}) + "\n")
    want = ["aa", "bb", "cc", "dd"]
  elif change == "same_size_other_bytes":  # same size, same mtime: the bytes' hash tells
    _write(path, [json.dumps({"text": t}) for t in ("a", "bbb", "cc")])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size
    want = ["a", "bbb", "cc"]
  else:
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    want = ["aa", "bb", "cc"]
  reader = jsonl.JsonlFile(str(path), "text")
  assert reader.built_now and _texts(reader) == want
  assert not jsonl.JsonlFile(str(path), "text").built_now


def test_a_copy_of_an_edited_file_that_keeps_size_mtime_head_and_tail_gets_a_new_index(tmp_path):
  """As ``cp -p``, ``rsync -a`` or ``tar x`` of a new version can: one line in the middle, beyond the hashed
  64 KiB at each end, changes length within the same total size, and the mtime is set back."""
  texts = [f"document {i:05d}" for i in range(8000)]
  path = tmp_path / "d.jsonl"
  _write(path, [json.dumps({"text": t}) for t in texts])
  assert jsonl.JsonlFile(str(path), "text").built_now
  stat = os.stat(path)
  edited = texts[:4000] + ["document 04000 and 04001", "xxxx"] + texts[4002:]  # two lines' bytes, moved
  _write(path, [json.dumps({"text": t}) for t in edited])
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns
  reader = jsonl.JsonlFile(str(path), "text")
  assert reader.built_now and reader[4000] == "document 04000 and 04001" and reader[4001] == "xxxx"


@pytest.mark.parametrize("name", [b"caf\xe9.jsonl", b"n" * 240 + b".jsonl"], ids=["latin-1", "240-bytes"])
def test_file_names_in_any_encoding_and_near_the_length_limit_are_indexed(tmp_path, name):
  """A name that is not UTF-8 (a latin-1 ``é``), and one of 246 bytes, whose index name would pass 255."""
  path = os.path.join(os.fsencode(tmp_path), name)
  with open(path, "wb") as f:
    f.write(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in ("aa", "bb")))
  for built in (True, False):
    reader = jsonl.JsonlFile(os.fsdecode(path), "text")
    assert reader.built_now == built and _texts(reader) == ["aa", "bb"]
  cached = data.DataConfig(source="text", paths=(os.fsdecode(path),), index_cache_dir=str(tmp_path / "cache"))
  assert _texts(data.Documents(cached)) == ["aa", "bb"]


def test_a_file_cut_short_after_its_index_was_built_is_named_when_read(tmp_path):
  """Truncated while a run reads it (a rewrite in progress): one error naming the change, not the lost lines
  skipped one by one as malformed."""
  path = tmp_path / "d.jsonl"
  _write(path, [json.dumps({"text": f"document {i}"}) for i in range(100)])
  reader = jsonl.JsonlFile(str(path), "text")
  assert reader[99] == "document 99"
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  assert reader[10] == "document 10"
  for index in (60, 99):
    with pytest.raises(ValueError, match=rf"d.jsonl' changed since it was indexed: .* before document {index} "):
      reader[index]


def test_a_byte_order_mark_before_the_first_line_is_read_past_in_every_reader(tmp_path):
  """As some editors write it: a plain, a gzip-compressed and a converted JSONL file each keep their first
  document (before: the plain file failed at open, the others dropped it as malformed)."""
  import gzip

  body = b"\xef\xbb\xbf" + b"".join(json.dumps({"text": t}).encode() + b"\n" for t in ("aa", "bb"))
  (tmp_path / "bom.jsonl").write_bytes(body)
  (tmp_path / "bom.jsonl.gz").write_bytes(gzip.compress(body))
  for name in ("bom.jsonl", "bom.jsonl.gz"):
    docs = data.Documents(data.DataConfig(source="text", paths=(str(tmp_path / name),)))
    assert _texts(docs) == ["aa", "bb"] and docs.skipped_documents == 0, name
  from distrib_train.data import text_files

  assert list(text_files.iter_text_file(str(tmp_path / "bom.jsonl"), "text", jsonl.BadRecords("error"))) == ["aa", "bb"]


def test_a_txt_file_opens_from_its_first_64_kib(tmp_path):
  """A ``.txt`` file is one document: its open decodes the first 64 KiB (a character cut there is no error),
  not the whole file (a 768 MiB file took 3.3 s and 1.5 GiB at every open); a byte that is not UTF-8 further
  on is named when the document is read."""
  straddling = tmp_path / "straddling.txt"
  straddling.write_bytes(b"x" * 65535 + "é".encode() + b"y")  # é's two bytes either side of 64 KiB
  late = tmp_path / "late.txt"
  late.write_bytes(b"x" * 70_000 + b"\xff")
  docs = data.Documents(data.DataConfig(source="text", paths=(str(straddling), str(late))))
  assert len(docs) == 2 and docs[0].endswith("éy")
  with pytest.raises(ValueError, match=r"late.txt' is not UTF-8 text \(byte 70000\)"):
    docs[1]
  early = tmp_path / "early.txt"
  early.write_bytes(b"x" * 100 + b"\xff" + b"x" * 70_000)
  with pytest.raises(ValueError, match=r"early.txt' is not UTF-8 text \(byte 100\)"):
    data.Documents(data.DataConfig(source="text", paths=(str(early),)))


def test_a_corpus_that_changes_between_runs_is_read_as_it_is_now(tmp_path):
  for name in ("a", "b"):
    _write(tmp_path / f"{name}.jsonl", [json.dumps({"text": f"{name}{i}"}) for i in range(3)])
  config = data.DataConfig(source="text", paths=(str(tmp_path / "*.jsonl"),))
  assert _texts(data.Documents(config)) == ["a0", "a1", "a2", "b0", "b1", "b2"]
  _write(tmp_path / "a.jsonl", [json.dumps({"text": "new a"})])
  _write(tmp_path / "c.jsonl", [json.dumps({"text": "c0"})], end="")
  assert _texts(data.Documents(config)) == ["new a", "b0", "b1", "b2", "c0"]


def test_an_index_the_data_directory_refuses_goes_to_the_cache_directory(tmp_path, monkeypatch):
  """As a read-only mount or root squashed over NFS do: the directory looks writable and refuses the write."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  data_dir = tmp_path / "data"
  data_dir.mkdir()
  path = _write(data_dir / "r.jsonl", [json.dumps({"text": "x"}), json.dumps({"text": "y"})])
  build_at = index_cache._build_at

  def refusing(where, *args):
    if where.startswith(str(data_dir)):
      raise PermissionError(errno.EROFS, "Read-only file system")
    return build_at(where, *args)

  monkeypatch.setattr(index_cache, "_build_at", refusing)
  first = jsonl.JsonlFile(path, "text")
  assert first.built_now and _texts(first) == ["x", "y"]
  assert sorted(os.listdir(data_dir)) == ["r.jsonl"]
  kept = list((tmp_path / "cache" / "distrib_train" / "indexes").glob("*-r.jsonl.lines.dtindex"))
  assert len(kept) == 1
  assert not jsonl.JsonlFile(path, "text").built_now  # found there by the next open


def test_an_index_goes_where_data_index_cache_dir_says(tmp_path):
  (tmp_path / "data").mkdir()
  path = _write(tmp_path / "data" / "k.jsonl", [json.dumps({"text": "x"})])
  config = data.DataConfig(source="text", paths=(path,), index_cache_dir=str(tmp_path / "indexes"))
  assert _texts(data.Documents(config)) == ["x"]
  assert os.listdir(tmp_path / "data") == ["k.jsonl"]
  assert [p.name.split("-", 1)[1] for p in (tmp_path / "indexes").glob("*.dtindex")] == ["k.jsonl.lines.dtindex"]


_READ_ONLY = """
import ctypes, os, sys

from distrib_train.data import jsonl

if os.geteuid() == 0:  # root writes past a directory's mode through CAP_DAC_OVERRIDE: this process drops it
  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Sets(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

  libc = ctypes.CDLL(None, use_errno=True)
  header, sets = Header(0x20080522, 0), (Sets * 2)()  # _LINUX_CAPABILITY_VERSION_3: two sets of 32 bits
  failed = libc.capget(ctypes.byref(header), sets)
  if not failed:
    for field in ("effective", "permitted", "inheritable"):
      setattr(sets[0], field, getattr(sets[0], field) & ~(1 << 1))  # CAP_DAC_OVERRIDE
    failed = libc.capset(ctypes.byref(header), sets)
  if failed:
    print("NOCAPS", os.strerror(ctypes.get_errno()))
    sys.exit(0)
probe = os.path.join(os.path.dirname(sys.argv[1]), "probe")
try:
  open(probe, "w").close()
except OSError:  # EACCES, or EROFS on a read-only mount: refused, as wanted
  pass
else:
  os.unlink(probe)
  print("WRITABLE")
  sys.exit(0)
reader = jsonl.JsonlFile(sys.argv[1], "text")
print(reader.built_now, [reader[i] for i in range(len(reader))])
"""


def test_a_read_only_data_directory_keeps_its_index_in_the_cache(tmp_path):
  """A directory the process may not write (mode 0555; as root, in a process without CAP_DAC_OVERRIDE, as CI
  runs): the index goes to the cache directory, the data directory is left as it was, and the next open finds
  the index there."""
  (tmp_path / "data").mkdir()
  path = _write(tmp_path / "data" / "r.jsonl", [json.dumps({"text": "x"}), json.dumps({"text": "y"})])
  env = _child_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
  os.chmod(tmp_path / "data", 0o555)
  try:
    runs = [
      subprocess.run([sys.executable, "-c", _READ_ONLY, path], env=env, capture_output=True, text=True, timeout=120)
      for _ in range(2)
    ]
  finally:
    os.chmod(tmp_path / "data", 0o755)
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
    said = run.stdout.strip()
    if said == "WRITABLE" or said.startswith("NOCAPS"):
      pytest.skip(f"this process cannot be refused a write to a mode-0555 directory here ({said})")
  assert [run.stdout.strip() for run in runs] == ["True ['x', 'y']", "False ['x', 'y']"]
  assert os.listdir(tmp_path / "data") == ["r.jsonl"]
  assert len(list((tmp_path / "cache").rglob("*-r.jsonl.lines.dtindex"))) == 1


_OPEN = """
import hashlib, os, sys, time
while not os.path.exists(sys.argv[2]):
  time.sleep(0.005)
from distrib_train.data import jsonl
reader = jsonl.JsonlFile(sys.argv[1], "text")
print(reader.built_now, hashlib.sha256(reader.offsets.tobytes()).hexdigest(), len(reader))
"""


def test_two_processes_opening_a_new_file_at_once_build_its_index_once(tmp_path):
  path = _write(tmp_path / "big.jsonl", [json.dumps({"text": f"{i} " + "x" * (i % 300)}) for i in range(20_000)])
  go = tmp_path / "go"
  procs = [
    subprocess.Popen([sys.executable, "-c", _OPEN, path, str(go)], stdout=subprocess.PIPE, text=True, env=_child_env())
    for _ in range(2)
  ]
  go.touch()
  outs = [p.communicate(timeout=120)[0].split() for p in procs]
  assert all(p.returncode == 0 for p in procs)
  assert sorted(built for built, _, _ in outs) == ["False", "True"]
  assert outs[0][1:] == outs[1][1:] and outs[0][2] == "20000"


def pathlib_root():
  import pathlib

  return pathlib.Path(dt.__file__).resolve().parents[1]


def _child_env(**extra: str) -> dict[str, str]:
  """This environment for a child Python that imports this checkout, plus ``extra``."""
  return {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib_root()), os.environ.get("PYTHONPATH", "")]), **extra}


def _bad_corpus(tmp_path, bad_every=3, documents=60):
  """Documents 'doc NN …'; every ``bad_every``-th line (but the first) malformed, one of four ways. Also the
  same corpus with each malformed line an empty document instead."""
  bad = ['{"text": oops}', '{"body": "no text"}', '["a list"]', '{"text": 7}']
  lines, empty = [], []
  for i in range(documents):
    if i and i % bad_every == 0:
      lines.append(bad[i % 4])
      empty.append('{"text": ""}')
    else:
      lines.append(json.dumps({"text": f"doc {i:02d} " + "lorem ipsum " * (1 + i % 4)}))
      empty.append(lines[-1])
  (tmp_path / "with_empty").mkdir(exist_ok=True)
  return _write(tmp_path / "bad.jsonl", lines), _write(tmp_path / "with_empty" / "bad.jsonl", empty)


def test_malformed_lines_are_skipped_logged_with_file_and_line_and_counted(tmp_path, caplog):
  lines = [json.dumps({"text": "fine"})] + ["not json"] * 13 + [json.dumps({"text": "end"})]
  path = _write(tmp_path / "m.jsonl", lines)
  docs = data.Documents(data.DataConfig(source="text", paths=(path,)))
  with caplog.at_level("WARNING"):
    assert _texts(docs) == ["fine"] + [None] * 13 + ["end"]
  assert docs.skipped_documents == 13
  messages = [r.getMessage() for r in caplog.records]
  assert messages[:10] == [
    f"Data file {path!r} line {n} is not JSON: Expecting value: skipped (data.bad_records=skip)." for n in range(2, 12)
  ]
  assert len(messages) == 11 and "more malformed lines skipped" in messages[10]


def test_a_malformed_line_under_error_raises_one_value_error_naming_file_line_and_field(tmp_path):
  path, _ = _bad_corpus(tmp_path)
  docs = data.Documents(data.DataConfig(source="text", paths=(path,), bad_records="error"))
  assert docs[1].startswith("doc 01")
  for index, what in (
    (3, r"has no string field 'text' \(data.text_field\)"),
    (6, r"holds a JSON list, not an object with a string field 'text'"),
    (12, "is not JSON"),
  ):
    with pytest.raises(jsonl.BadRecordError, match=rf"'{path}' line {index + 1} {what}.*bad_records=skip"):
      docs[index]


def test_a_wrong_text_field_or_a_file_that_is_not_jsonl_fails_at_open(tmp_path):
  path = _write(tmp_path / "body.jsonl", ["", "  ", json.dumps({"body": "x"})])
  for policy in ("skip", "error"):
    with pytest.raises(ValueError, match=r"body.jsonl' line 3 has no string field 'text' \(data.text_field\)\.$"):
      data.Documents(data.DataConfig(source="text", paths=(path,), bad_records=policy))
  (tmp_path / "bin.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
  with pytest.raises(ValueError, match=r"bin.jsonl' line 1 is not UTF-8 text \(byte 0\)"):
    data.Documents(data.DataConfig(source="text", paths=(str(tmp_path / "bin.jsonl"),)))
  with pytest.raises(ValueError, match=r"unknown bad_records 'warn'; known: skip, error"):
    data.DataConfig(bad_records="warn")


@pytest.mark.parametrize("workers", [0, 1])
def test_skipped_lines_read_as_empty_documents_count_and_resume_exactly(tmp_path, workers):
  """The batches are those of the corpus with each malformed line an empty document, and a restored loader
  continues them exactly; the loader counts the skipped lines (those its lane workers skip too)."""
  path, with_empty = _bad_corpus(tmp_path)
  shardings = data_helpers.shardings(dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2))))

  def loader(corpus):
    return data.DataLoader(
      data.DataConfig(
        source="text",
        paths=(corpus,),
        seq_len=16,
        global_batch_size=8,
        eval_fraction=0.0,
        num_threads=1,
        num_workers=workers,
      ),
      shardings,
    )

  want = loader(with_empty)
  expected = [want.next_local() for _ in range(6)]
  want.close()
  got = loader(path)
  states = []
  for batch in expected:
    states.append(got.get_state())
    mine = got.next_local()
    for name in batch:
      np.testing.assert_array_equal(mine[name], batch[name], err_msg=name)
  assert 0 < got.skipped_documents <= 60 // 3 * 2  # read ahead, and more than one pass over the corpus
  got.close()
  if workers:  # resuming in workers is the same code (lane_process.py's tests); one start less
    return
  restored = loader(path)
  restored.set_state(states[3])
  for batch in expected[3:]:
    np.testing.assert_array_equal(restored.next_local()["tokens"], batch["tokens"])
  restored.close()


def test_the_converter_skips_or_stops_at_malformed_lines(tmp_path, capsys):
  path = _write(tmp_path / "c.jsonl", [json.dumps({"text": "one"}), "{bad", json.dumps({"text": "two"})])
  with pytest.raises(SystemExit) as stopped:
    record_shards.main(["convert", path, str(tmp_path / "stop" / "c"), "--bad_records", "error"])
  assert stopped.value.code == 2 and "c.jsonl' line 2 is not JSON" in capsys.readouterr().err
  assert list((tmp_path / "stop").iterdir()) == []  # no shard
  record_shards.main(["convert", path, str(tmp_path / "skip" / "c")])
  [shard] = capsys.readouterr().out.split()
  assert _texts(data.Documents(data.DataConfig(source="text", paths=(shard,)))) == ["one", "two"]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_malformed_line_met_in_training_stops_the_loader_with_its_one_line(tmp_path, workers):
  """Past the checks at construction (which read every other document of this corpus, the even ones), the
  first malformed line the lanes read raises ``BadRecordError`` (the trainer's command line prints it as one
  line), whether the lanes run in this process or in a worker."""
  lines = [
    json.dumps({"text": f"document {i} " + "text " * 5}) if i % 2 == 0 or i % 100 != 1 else "{oops" for i in range(4000)
  ]
  path = _write(tmp_path / "late.jsonl", lines)
  shardings = data_helpers.shardings(dt.build_mesh(dt.MeshConfig(("data", "fsdp", "tensor"), (2, 2, 2))))
  loader = data.DataLoader(
    data.DataConfig(
      source="text",
      paths=(path,),
      seq_len=16,
      global_batch_size=8,
      eval_fraction=0.0,
      bad_records="error",
      num_workers=workers,
    ),
    shardings,
  )
  try:
    with pytest.raises(jsonl.BadRecordError, match=r"late.jsonl' line \d+02 is not JSON.*skip would skip it"):
      for _ in range(2000):
        loader.next_local()
  finally:
    loader.close()


def test_a_source_sent_to_a_worker_process_maps_its_index_again(tmp_path):
  """grain sends a finite pass's source to its workers (cloudpickle): the copy holds no map, lock or array."""
  import cloudpickle

  path = _write(tmp_path / "w.jsonl", [json.dumps({"text": "a"}), "{bad", json.dumps({"text": "b"})])
  docs = data.Documents(data.DataConfig(source="text", paths=(path,), index_cache_dir=str(tmp_path / "idx")))
  assert _texts(docs) == ["a", None, "b"]
  sent = cloudpickle.dumps(docs)
  assert len(sent) < 4096
  copy = cloudpickle.loads(sent)
  assert _texts(copy) == ["a", None, "b"] and copy.skipped_documents == 2 and docs.skipped_documents == 1


def _descriptors_on(path):
  """How many of this process's descriptors are open on `path` (others, opened by other threads, do not count)."""
  count = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      count += os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")) == os.path.realpath(path)
    except OSError:  # closed between the listing and the readlink
      pass
  return count


def test_threads_making_a_files_first_reads_together_open_one_descriptor(tmp_path):
  for attempt in range(20):
    path = _write(tmp_path / f"t{attempt}.jsonl", [json.dumps({"text": f"doc {i}"}) for i in range(64)])
    reader = jsonl.JsonlFile(path, "text")
    assert _descriptors_on(path) == 0
    barrier = threading.Barrier(8)

    def read(i, reader=reader):
      barrier.wait()
      return reader[i]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      assert list(pool.map(read, range(8))) == [f"doc {i}" for i in range(8)]
    assert _descriptors_on(path) == 1
    del reader


def test_a_lone_surrogate_is_a_malformed_line_named_by_file_and_line(tmp_path):
  path = _write(tmp_path / "s.jsonl", ['{"text": "fine"}', '{"text": "ab\\ud83d cd"}', '{"text": "after"}'])
  with pytest.raises(jsonl.BadRecordError, match=r"s.jsonl' line 2 holds a lone surrogate in field 'text'"):
    jsonl.JsonlFile(path, "text", jsonl.BadRecords("error"))[1]
  skipping = jsonl.BadRecords("skip")
  assert _texts(jsonl.JsonlFile(path, "text", skipping)) == ["fine", None, "after"]
  assert skipping.skipped == 1
