"""Values of a weights file read when used: a sharded variable reads only
its block.

Keras' weight stores read each dataset whole (`np.array(dataset)`), and
`assign` converts it once more before a sharded variable keeps its block:
every rank reads the whole file and holds two copies of the largest
variable on the way. A `StoredValue` is the dataset itself (an h5py
`Dataset`, read through HDF5's hyperslab selection): assigned to a
sharded variable it reads only this rank's block (`read_block`), straight
into the variable's local tensor where it can; anywhere else it is a whole
numpy array (`np.asarray(value)` reads it, once).

`reads` counts what was read from files this way (bytes, the largest single
read), for tests and benchmarks.
"""

import numpy as np
import torch

try:  # Keras' own dependency for bfloat16 numpy arrays
    import ml_dtypes
except ImportError:  # pragma: no cover - Keras needs it
    ml_dtypes = None


class Reads:
    """Bytes this process read from weights files through StoredValues."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.bytes = 0
        self.largest = 0
        self.count = 0

    def add(self, nbytes):
        self.bytes += nbytes
        self.largest = max(self.largest, nbytes)
        self.count += 1


reads = Reads()


class StoredValue:
    """One dataset of an HDF5 weights file, read when used.

    `shape`, `dtype`, `ndim`, `size` and `len()` read nothing;
    `read_block(box)` reads one block; `np.asarray(value)`, indexing and any
    other array attribute read the whole value once (kept while the
    StoredValue lives). `reopen` is the file's path when the dataset can be
    opened again after its file is closed (Keras' sharded store closes one
    file to open the next); without one, `keep()` reads the value whole
    before its file closes.
    """

    def __init__(self, dataset, bfloat16=False, reopen=None):
        self._dataset = dataset
        self._name = dataset.name
        self._reopen = reopen
        self._bfloat16 = bfloat16
        self._whole = None
        self.shape = tuple(int(n) for n in dataset.shape)
        if bfloat16:
            self.dtype = np.dtype(ml_dtypes.bfloat16)
        else:
            self.dtype = np.dtype(dataset.dtype)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d stored value")
        return self.shape[0]

    def __repr__(self):
        state = "unread" if self._whole is None else "read"
        return (
            f"<StoredValue {self._name} shape={self.shape} "
            f"dtype={self.dtype} {state}>"
        )

    # -- reading --------------------------------------------------------

    def _read(self, selection, out=None):
        """Read `selection` (a tuple of slices, or () for all) of the
        dataset, into `out` (a numpy array of the stored dtype) when given."""
        dataset, opened = self._dataset, None
        if not dataset.id.valid:
            if self._reopen is None:
                raise RuntimeError(
                    f"The weights file holding {self._name!r} was closed "
                    "before the value was read. Read it while the file is "
                    "open (np.asarray(value)), or load from a file on disk."
                )
            import h5py

            opened = h5py.File(self._reopen, "r")
            dataset = opened[self._name]
        try:
            if out is not None:
                dataset.read_direct(out, source_sel=selection or np.s_[()])
                array = out
            else:
                array = dataset[selection] if selection else dataset[()]
        finally:
            if opened is not None:
                opened.close()
        array = np.asarray(array)
        reads.add(array.nbytes)
        if self._bfloat16:
            array = array.view(ml_dtypes.bfloat16)
        return array

    def keep(self):
        """Read the whole value now, if not yet (its file is closing and
        cannot be opened again)."""
        if self._whole is None and self._reopen is None:
            self._whole = self._read(())
        return self

    def whole(self):
        """The whole value, a numpy array (read once)."""
        if self._whole is None:
            self._whole = self._read(())
        return self._whole

    def __array__(self, dtype=None, copy=None):
        array = self.whole()
        if dtype is not None and np.dtype(dtype) != array.dtype:
            return array.astype(dtype)
        return array

    def __getitem__(self, key):
        return self.whole()[key]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.whole(), name)

    def read_block(self, box, into=None):
        """The block `box` ((start, stop) per dim) as a torch tensor on the
        host in the stored dtype; with `into` (a torch tensor of the block's
        shape), copied into it instead, read straight into it when it is a
        contiguous CPU tensor of the stored dtype. Only the block is read
        from the file."""
        selection = tuple(slice(lo, hi) for lo, hi in box)
        if any(hi <= lo for lo, hi in box):  # an empty block: nothing to read
            empty = np.empty([hi - lo for lo, hi in box], self.dtype)
            block = _as_torch_dtype(
                torch.from_numpy(_torch_viewable(empty)), self.dtype
            )
            return block if into is None else into
        if self._whole is not None:
            block = torch.from_numpy(_torch_viewable(self._whole[selection]))
            block = _as_torch_dtype(block, self.dtype)
        elif _readable_into(into, self.dtype):
            self._read(selection, out=into.numpy())
            return into
        else:
            block = _as_torch_dtype(
                torch.from_numpy(_torch_viewable(self._read(selection))),
                self.dtype,
            )
        if into is None:
            return block
        with torch.no_grad():
            into.copy_(block.reshape(into.shape))
        return into


def _readable_into(tensor, dtype):
    return (
        tensor is not None
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.numel() > 0
        and not _is_bfloat16(dtype)
        and tensor.dtype == torch.from_numpy(np.empty(0, dtype)).dtype
    )


def _is_bfloat16(dtype):
    return ml_dtypes is not None and dtype == np.dtype(ml_dtypes.bfloat16)


def _torch_viewable(array):
    """`array` as numpy torch can take: bfloat16 as its 16-bit pattern."""
    array = np.ascontiguousarray(array)
    if _is_bfloat16(array.dtype):
        return array.view(np.int16)
    return array


def _as_torch_dtype(tensor, dtype):
    if _is_bfloat16(dtype):
        return tensor.view(torch.bfloat16)
    return tensor


def is_stored_value(value):
    return isinstance(value, StoredValue)
