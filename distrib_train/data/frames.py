"""Frames between a process and its data worker processes: a JSON header and raw array bytes, no pickle.

A frame is the header's JSON length (8 bytes, little-endian), the JSON (with
each array's dtype and shape added) and the arrays' bytes. The lanes' workers
(``lane_process.py``) and the converter's (``convert_workers.py``) speak
them over their stdin and stdout; ``worker_streams`` gives a worker those two
streams.

Not for: what the frames say (each worker module's own protocol).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np

_LENGTH = struct.Struct("<Q")


def send(stream: Any, header: dict, arrays: Sequence[np.ndarray] = ()) -> None:
  """One frame: the header's JSON length, the JSON (with each array's dtype and shape), the arrays' bytes."""
  header = {**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
  data = json.dumps(header).encode()
  stream.write(_LENGTH.pack(len(data)) + data)
  for array in arrays:
    stream.write(np.ascontiguousarray(array).data)
  stream.flush()


def _exactly(stream: Any, size: int) -> bytes:
  data = stream.read(size)
  if len(data) != size:
    raise EOFError("the stream ended inside a frame")
  return data


def receive(stream: Any) -> tuple[dict, list[np.ndarray]]:
  """``send``'s header and arrays.

  Raises:
    EOFError: the stream ended (the other process has gone).
  """
  (size,) = _LENGTH.unpack(_exactly(stream, _LENGTH.size))
  header = json.loads(_exactly(stream, size))
  arrays = []
  for dtype, shape in header.pop("arrays"):
    dtype = np.dtype(dtype)
    arrays.append(np.frombuffer(_exactly(stream, dtype.itemsize * int(np.prod(shape))), dtype).reshape(shape))
  return header, arrays


def worker_streams() -> tuple[BinaryIO, BinaryIO]:
  """A worker's (commands, frames): its stdin, and its stdout, where nothing else may be printed.

  SIGINT and SIGTERM are ignored: the parent handles them and then closes
  this worker; if the parent dies instead, the pipes close and the worker
  ends. Anything else printed goes to stderr, not into the frames.
  """
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, signal.SIG_IGN)
  frames = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)
  return sys.stdin.buffer, frames
