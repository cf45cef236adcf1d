"""A safetensors file read box by box with positioned reads, no memory map.

safetensors' own reader maps the whole file into memory: a box read
through it (`safe_open(...).get_slice(key)[box]`) touches every page the
box's rows cross, and those pages count in the reading process's RSS, and
in a cgroup's memory charge (SLURM, Kubernetes), though the rank keeps only
the box: a block of columns touches every row's pages. `SafetensorsFile`
parses the file's header itself and reads a box straight into the numpy
array that holds it, one positioned read (`os.preadv`) per contiguous run
of the box in the file; the file's pages stay the page cache's.

The format (safetensors, little-endian only): 8 bytes, the header's length
N as an unsigned little-endian integer; N bytes of JSON, per tensor name
`{"dtype", "shape", "data_offsets": [begin, end]}` with offsets counted
from the end of the header (byte 8 + N), row-major data; a
`"__metadata__"` entry holds strings and no tensor.

Runs: the dims after the last one the box cuts (not whole) are whole, so a
run is the box's extent of that dim times the whole dims after it; one run
per index of the dims before it (a box of rows is one read, a box of
columns one read per row).
"""

import json
import os
import struct
import sys

import numpy as np

try:  # Keras' own dependency for bfloat16 and float8 numpy arrays
    import ml_dtypes
except ImportError:  # pragma: no cover - Keras needs it
    ml_dtypes = None

# safetensors' dtype names -> numpy (little-endian, as the format is).
DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
if ml_dtypes is not None and sys.byteorder == "little":
    DTYPES.update(
        {
            "BF16": np.dtype(ml_dtypes.bfloat16),
            "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
            "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
        }
    )

# Bytes read at most per header (safetensors' own limit is 100 MB).
MAX_HEADER = 100_000_000


class SafetensorsFile:
    """The safetensors file at `path`: `keys()`, `info(key)` (shape, numpy
    dtype), `read_box(key, box, out=None)` and `read_whole(key)`. The
    header is read on first use; the file stays open until `close()`.
    `opened`, the same file opened by safetensors (`safe_open`), reads the
    whole tensors (`read_whole`: its `get_tensor`, as its user reads
    them)."""

    def __init__(self, path, opened=None):
        self.path = os.fspath(path)
        self.opened = opened
        self._file = None
        self._tensors = None
        self._data_start = None

    def __repr__(self):
        return f"<SafetensorsFile {self.path!r}>"

    # -- the header -----------------------------------------------------

    def _open(self):
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        return self._file

    def _header(self):
        if self._tensors is None:
            file = self._open()
            head = file.read(8)
            if len(head) != 8:
                raise ValueError(
                    f"{self.path!r} is not a safetensors file: "
                    f"{len(head)} bytes, expected at least 8 (the header's "
                    "length)."
                )
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER:
                raise ValueError(
                    f"{self.path!r}: a header of {length} bytes, expected "
                    f"at most {MAX_HEADER}: not a safetensors file, or a "
                    "damaged one."
                )
            header = json.loads(file.read(length))
            header.pop("__metadata__", None)
            self._data_start = 8 + length
            self._tensors = {}
            for key, entry in header.items():
                self._tensors[key] = self._tensor_of(key, entry)
        return self._tensors

    def _tensor_of(self, key, entry):
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise TypeError(
                f"{self.path!r}: tensor {key!r} has dtype "
                f"{entry['dtype']!r}, which this reader cannot read "
                f"(it reads {', '.join(DTYPES)}; BF16 and F8 need "
                "ml_dtypes on a little-endian machine). Load it whole "
                "with safetensors instead."
            )
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(n) for n in entry["data_offsets"])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected:
            raise ValueError(
                f"{self.path!r}: tensor {key!r} of shape {shape} and dtype "
                f"{entry['dtype']} spans {end - begin} bytes "
                f"(data_offsets {begin}..{end}), expected {expected}: a "
                "damaged file."
            )
        return shape, dtype, begin

    def keys(self):
        return list(self._header())

    def info(self, key):
        """(shape, numpy dtype) of tensor `key`; reads nothing of it."""
        shape, dtype, _ = self._entry(key)
        return shape, dtype

    def _entry(self, key):
        tensors = self._header()
        if key not in tensors:
            raise KeyError(
                f"{self.path!r} has no tensor {key!r} (it has "
                f"{len(tensors)}, e.g. {sorted(tensors)[:3]})."
            )
        return tensors[key]

    # -- reading --------------------------------------------------------

    def read_box(self, key, box, out=None):
        """The box `box` ((start, stop) per dim) of tensor `key` as a numpy
        array of the stored dtype, read from the file alone; into `out`
        (a C-contiguous numpy array of the box's shape and the stored
        dtype) when given."""
        shape, dtype, begin = self._entry(key)
        box = tuple((int(lo), int(hi)) for lo, hi in box)
        extents = tuple(hi - lo for lo, hi in box)
        if len(box) != len(shape) or any(
            not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape)
        ):
            raise ValueError(
                f"box {box} is not inside tensor {key!r} of shape {shape} "
                f"in {self.path!r}."
            )
        if out is None:
            out = np.empty(extents, dtype)
        elif (
            out.shape != extents
            or out.dtype != dtype
            or not out.flags.c_contiguous
        ):
            raise ValueError(
                f"out has shape {out.shape} and dtype {out.dtype}, expected "
                f"a C-contiguous array of {extents} and {dtype}."
            )
        if out.size == 0:
            return out
        offsets, run = runs(shape, box)
        run_bytes = run * dtype.itemsize
        buffer = memoryview(out.reshape(-1).view(np.uint8))
        start = self._data_start + begin
        fd = self._open().fileno()
        for i, offset in enumerate(offsets):
            self._read_into(
                fd,
                buffer[i * run_bytes : (i + 1) * run_bytes],
                start + offset * dtype.itemsize,
                key,
            )
        return out

    def read_whole(self, key):
        """Tensor `key` whole: safetensors' own read where the file was
        opened by it, else one read of the whole box."""
        if self.opened is not None:
            return self.opened.get_tensor(key)
        return self.read_box(key, tuple((0, n) for n in self.info(key)[0]))

    def _read_into(self, fd, view, position, key):
        while len(view):
            if hasattr(os, "preadv"):
                count = os.preadv(fd, [view], position)
            else:  # pragma: no cover - platforms without preadv
                self._file.seek(position)
                count = self._file.readinto(view)
            if not count:
                raise EOFError(
                    f"{self.path!r} ends before byte {position} of tensor "
                    f"{key!r}: the file is truncated."
                )
            view = view[count:]
            position += count

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def runs(shape, box):
    """The contiguous runs of `box` in a row-major tensor of `shape`: (an
    iterator of the element offset of each run's first element, in the
    box's row-major order, made one at a time: a box of columns of a large
    tensor has as many runs as rows; the elements per run)."""
    cut = len(shape) - 1
    while cut >= 0 and tuple(box[cut]) == (0, shape[cut]):
        cut -= 1
    if cut < 0:  # the whole tensor: one run
        return iter((0,)), int(np.prod(shape, dtype=np.int64))
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    lo, hi = box[cut]
    first = lo * strides[cut]
    outer = [
        range(lo * strides[d], hi * strides[d], strides[d])
        for d, (lo, hi) in enumerate(box[:cut])
    ]
    return _sums(first, outer), int((hi - lo) * strides[cut])


def _sums(base, ranges):
    """`base` plus each combination of one number of each range, in
    row-major order, made one at a time (itertools.product would hold each
    range's numbers as a tuple)."""
    if not ranges:
        yield base
        return
    for start in ranges[0]:
        yield from _sums(base + start, ranges[1:])
