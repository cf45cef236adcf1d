"""The torch backend as Keras calls it, mirroring `keras/src/backend/torch/`:
the modules whose functions Keras' own torch backend module or op calls
reach (through the patch table in `_patches`, or installed whole as
Keras' backend `distribution_lib`).

Modules, bottom first (a module imports only those above it):

- `keras_ops`: the backend ops Keras layers call with sharded values
  (`convert_to_numpy`, `slice_update`, `scatter_update`,
  `batch_normalization`), DTensor-aware.
- `distribution_lib`: the backend module `keras.distribution` calls
  (`list_devices`, `initialize`, `distribute_tensor`,
  `distribute_data_input`, ...; the name upstream diffs target), and the
  check of a `Distribution` when it is constructed.
- `core`: `convert_to_tensor` without a copy from the host (Python numbers
  filled on the device, host batches through pinned memory).
- `numpy`: `einsum` as one matrix product where the equation is one.
- `nn`: `sparse_categorical_crossentropy` on rows, the class dim last.
- `float8`: Keras' float8 matrix product (Dense, EinsumDense) as
  `torch._scaled_mm` on float8 operands, with Keras' delayed scales.

`core`, `numpy` and `nn` are the fast ops: each gives Keras' numbers, and
KTD_FAST_OPS=0 leaves Keras' own in place.

Nothing is re-exported: importing the package imports none of them.
"""
