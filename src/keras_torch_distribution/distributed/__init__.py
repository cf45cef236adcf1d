"""Meshes and DTensors: the parts that know torch, not models (the
process group is `_processes`').

Modules, bottom first (a module imports only those above it):

- `sharding_rules`: DTensor rules torch lacks or gets wrong; `uninstall()`
  gives torch its own back.
- `layouts`: Keras `DeviceMesh` / `TensorLayout` onto torch meshes and
  placements.
- `tensors`: plain tensors to and from DTensors of a layout.
- `keras_ops`: the torch backend's ops Keras layers call with sharded
  values (to_numpy, slice_update, scatter_update, batch_normalization).
- `collectives`: the one bucketed flat collective (gradient averages, metric
  sums, broadcasts).
- `stopping`: ranks that stop training or run out of input stop together.
- `collective_counts`: counting a step's collectives (tests, benchmarks,
  `ktd plan`).
- `replicas`: the batch axis: replicas, their process group, the current
  batch's weight.
- `agreement`: ranks agree before they train; one small all-gather names
  what differs.

Nothing is re-exported: importing the package imports none of them.

"""
