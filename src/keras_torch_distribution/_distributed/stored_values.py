"""Values of a weights file read when used: a sharded variable reads only
its block.

Keras' weight stores read each dataset whole (`np.array(dataset)`), and
`assign` converts it once more before a sharded variable keeps its block:
every rank reads the whole file and holds two copies of the largest
variable on the way. A stored value is the file's tensor unread:
assigned to a sharded variable it reads only this rank's block
(`read_block`), straight into the variable's local tensor where it can;
anywhere else it is a whole numpy array (`np.asarray(value)` reads it,
once). Two kinds:

- `StoredValue`: a dataset of an HDF5 weights file (Keras' `.weights.h5`,
  read through HDF5's hyperslab selection);
- `TensorFileValue`: a tensor of a safetensors file (a Hugging Face
  checkpoint that keras_hub converts, its boxes read with positioned reads
  by `safetensors_file.SafetensorsFile`, not through a memory map), with
  the transposes, reshapes and casts that numpy code applies to it
  recorded, not done: a block of the result is read as the
  block of the stored tensor it needs (`block_maps`).

`reads` counts what was read from files this way (bytes, the largest single
read), for tests and benchmarks.
"""

import inspect

import numpy as np
import torch

from keras_torch_distribution import _log
from keras_torch_distribution._distributed import block_maps

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

# The most a block read through a transpose holds on the host at once
# (`TensorFileValue._read_in_pieces`).
PIECE_BYTES = 4 * 2**20


class ValueReadWhenUsed:
    """What every stored value has: `shape`, `dtype`, `ndim`, `size`,
    `nbytes` and `len()` read nothing; `read_block(box, into=None)` reads
    one block; `whole()`, `np.asarray(value)`, indexing and any other array
    attribute read the whole value once (kept while the value lives)."""

    shape = ()
    dtype = None

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

    def _whole_for(self, use):
        """The whole value, read for `use` (what needs it)."""
        del use
        return self.whole()

    def __array__(self, dtype=None, copy=None):
        array = self._whole_for("np.asarray")
        if dtype is not None and np.dtype(dtype) != array.dtype:
            return array.astype(dtype)
        return array

    def __getitem__(self, key):
        return self._whole_for("indexing")[key]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._whole_for(f".{name}"), name)


class StoredValue(ValueReadWhenUsed):
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


class TensorFileValue(np.lib.mixins.NDArrayOperatorsMixin, ValueReadWhenUsed):
    """One tensor of a safetensors file (a
    `safetensors_file.SafetensorsFile`), read when used, with the numpy
    operations applied to it that a block can be read through recorded,
    not done: `np.transpose` / `.transpose` / `.T`, `np.reshape` /
    `.reshape` (row-major) and `.astype`, each giving a new
    `TensorFileValue`. `read_block(box)` reads from the file only the box
    of the stored tensor that `box` of the result needs (`block_maps`),
    then transposes, reshapes and casts that block as numpy would the
    whole. Any other use (another numpy function, arithmetic, indexing,
    `np.asarray`) reads the whole tensor, applies the recorded operations
    with numpy and goes on with the array, with a warning naming what
    needed it (once per kind of use), through the file's `read_whole`
    (safetensors' own `get_tensor` for a file keras_hub opened). The file
    must stay open while the value is used (keras_hub's loader keeps its
    files open while it converts)."""

    def __init__(self, file, key, source=None, steps=()):
        self._file = file
        self._key = key
        if source is None:
            source = file.info(key)
        self._source = source
        self._steps = tuple(steps)
        self._whole = None
        shape, dtype = source
        for step in self._steps:
            if step[0] == "transpose":
                shape = tuple(shape[axis] for axis in step[1])
            elif step[0] == "reshape":
                shape = step[2]
            else:
                dtype = step[1]
        self.shape, self.dtype = shape, dtype

    def __repr__(self):
        steps = "".join(f".{step[0]}({step[-1]})" for step in self._steps)
        return (
            f"<TensorFileValue {self._key!r}{steps} shape={self.shape} "
            f"dtype={self.dtype}>"
        )

    # -- the operations followed ---------------------------------------

    def _then(self, step):
        return TensorFileValue(
            self._file, self._key, self._source, self._steps + (step,)
        )

    def transpose(self, *axes):
        if len(axes) == 1 and (axes[0] is None or not isinstance(axes[0], int)):
            axes = axes[0]
        axes = block_maps.resolve_axes(axes or None, self.ndim)
        if axes == tuple(range(self.ndim)):
            return self
        return self._then(("transpose", axes))

    @property
    def T(self):
        return self.transpose()

    def reshape(self, *shape, order="C", copy=None):
        if len(shape) == 1:
            shape = shape[0]
        if order != "C" or copy is False:
            whole = self._whole_for(f"reshape(order={order!r}, copy={copy!r})")
            return np.reshape(whole, shape, order=order, copy=copy)
        shape = block_maps.resolve_shape(shape, self.size)
        if shape == self.shape:
            return self
        return self._then(("reshape", self.shape, shape))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if (order, casting, subok) != ("K", "unsafe", True):
            whole = self._whole_for(
                f"astype(order={order!r}, casting={casting!r})"
            )
            return whole.astype(dtype, order, casting, subok, copy)
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return self._then(("astype", dtype))

    def __array_function__(self, func, types, args, kwargs):
        if func in (np.transpose, np.reshape):
            arguments = inspect.signature(func).bind(*args, **kwargs).arguments
            if arguments.get("a") is self and func is np.transpose:
                return self.transpose(arguments.get("axes"))
            if arguments.get("a") is self and func is np.reshape:
                shape = arguments.get("shape")
                if shape is None:
                    shape = arguments.get("newshape")
                return self.reshape(
                    shape,
                    order=arguments.get("order", "C"),
                    copy=arguments.get("copy"),
                )
        use = f"np.{getattr(func, '__name__', func)}"
        return func(
            *self._with_wholes(args, use), **self._with_wholes(kwargs, use)
        )

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        use = f"np.{ufunc.__name__}" + (
            "" if method == "__call__" else f".{method}"
        )
        return getattr(ufunc, method)(
            *self._with_wholes(inputs, use), **self._with_wholes(kwargs, use)
        )

    def _with_wholes(self, values, use):
        """`values` (args or kwargs) with every TensorFileValue read whole."""
        if isinstance(values, dict):
            return {k: self._with_wholes(v, use) for k, v in values.items()}
        if isinstance(values, (tuple, list)):
            return type(values)(self._with_wholes(v, use) for v in values)
        if isinstance(values, TensorFileValue):
            return values._whole_for(use)
        return values

    # -- reading --------------------------------------------------------

    def _whole_for(self, use):
        if self._whole is None:
            _log.warn_once(
                ("tensor file value read whole", use),
                "%s on a tensor of a safetensors file (%r) reads it whole "
                "on every rank: a sharded variable reads only its block "
                "through transpose, reshape and astype alone.",
                use,
                self._key,
            )
        return self.whole()

    def whole(self):
        """The whole value, a numpy array (read once)."""
        if self._whole is None:
            array = self._file.read_whole(self._key)
            reads.add(array.nbytes)
            for step in self._steps:
                if step[0] == "transpose":
                    array = np.transpose(array, step[1])
                elif step[0] == "reshape":
                    array = np.reshape(array, step[2])
                else:
                    array = array.astype(step[1])
            self._whole = array
        return self._whole

    def read_block(self, box, into=None):
        """The block `box` ((start, stop) per dim) of the value as a torch
        tensor on the host; with `into` (a torch tensor of the block's
        shape), copied into it instead (cast to its dtype). Reads only the
        stored tensor's box that the block needs: the block's own elements
        where the reshapes map it onto a box, else the smallest box that
        holds them."""
        box = tuple(tuple(int(i) for i in dim) for dim in box)
        if block_maps.is_empty(box) or self._whole is not None:
            array = self.whole() if self._whole is not None else None
            if array is None:
                array = np.empty(block_maps.extents(box), self.dtype)
            else:
                array = array[tuple(slice(lo, hi) for lo, hi in box)]
        elif not self._steps and _readable_into(into, self.dtype):
            # Stored as the variable holds it: read straight into it.
            array = self._file.read_box(self._key, box, out=into.numpy())
            reads.add(array.nbytes)
            return into
        elif into is not None and all(s[0] != "reshape" for s in self._steps):
            return self._read_in_pieces(box, into)
        else:
            array = self._read_for(box)
        block = _as_torch_dtype(_to_torch(array), self.dtype)
        if into is None:
            return block
        with torch.no_grad():
            into.copy_(block)
        return into

    def _read_in_pieces(self, box, into):
        """Read the block `box` into `into` through transposes and casts
        alone, a piece of at most `PIECE_BYTES` of the stored box at a
        time (whole indices of its first dim), each transposed and cast
        into its place: no whole block on the host on the way (a
        transposed embedding's block is the largest)."""
        stored, axis = box, 0
        for step in reversed(self._steps):
            if step[0] == "transpose":
                stored = block_maps.transpose_box(stored, step[1])
        for step in self._steps:  # where the stored first dim goes
            if step[0] == "transpose":
                axis = step[1].index(axis)
        (lo, hi), rest = stored[0], stored[1:]
        row_bytes = self._source[1].itemsize * int(
            np.prod(block_maps.extents(rest), dtype=np.int64)
        )
        rows = max(1, PIECE_BYTES // max(1, row_bytes))
        for start in range(lo, hi, rows):
            stop = min(hi, start + rows)
            array = self._file.read_box(self._key, ((start, stop),) + rest)
            reads.add(array.nbytes)
            for step in self._steps:
                if step[0] == "transpose":
                    array = np.transpose(array, step[1])
                else:
                    array = array.astype(step[1])
            piece = _as_torch_dtype(_to_torch(array), self.dtype)
            where = (slice(None),) * axis + (slice(start - lo, stop - lo),)
            with torch.no_grad():
                into[where].copy_(piece)
        return into

    def _read_for(self, box):
        """Read the stored box `box` of the result needs, and make it the
        block: the recorded steps applied, each reshape's widened block cut
        back to the block after it."""
        undo = []
        for step in reversed(self._steps):
            if step[0] == "transpose":
                undo.append(step)
                box = block_maps.transpose_box(box, step[1])
            elif step[0] == "reshape":
                in_box, out_box = block_maps.reshape_box(box, step[1], step[2])
                cut = tuple(
                    slice(lo - start, hi - start)
                    for (lo, hi), (start, _) in zip(box, out_box)
                )
                undo.append(("reshape", block_maps.extents(out_box), cut))
                box = in_box
            else:
                undo.append(step)
        array = self._file.read_box(self._key, box)
        reads.add(array.nbytes)
        for step in reversed(undo):
            if step[0] == "transpose":
                array = np.transpose(array, step[1])
            elif step[0] == "reshape":
                array = np.reshape(array, step[1])[step[2]]
            else:
                array = array.astype(step[1])
        return array


def tensor_file_value(file, key):
    """The tensor `key` of the safetensors file `file` (a
    `safetensors_file.SafetensorsFile`), unread (a `TensorFileValue`); a
    0-d tensor is read at once."""
    if not file.info(key)[0]:
        array = file.read_whole(key)
        reads.add(array.nbytes)
        return array
    return TensorFileValue(file, key)


def _to_torch(array):
    """A host numpy array as a torch tensor, without a copy where torch can
    view it (any non-negative strides), bfloat16 as its 16-bit pattern."""
    if _is_bfloat16(array.dtype) or any(s < 0 for s in array.strides):
        return torch.from_numpy(_torch_viewable(array))
    return torch.from_numpy(array)


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
    return isinstance(value, ValueReadWhenUsed)
