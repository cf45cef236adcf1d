"""Meshes and DTensors: the parts that know torch, not models (the
process group is `_processes`').

Modules, bottom first (a module imports only those above it):

- `attention_rules`: DTensor rules of the attention ops.
- `older_torch_rules`: DTensor rules torch<2.13 lacks or gets wrong.
- `sharding_rules`: those rules registered with DTensor; `uninstall()`
  gives torch its own back.
- `masked_lookup`: a vocabulary-sharded lookup's other rows zeroed without
  a host sync (torch's `MaskBuffer.apply_mask`, replaced through the patch
  table).
- `layouts`: Keras `DeviceMesh` / `TensorLayout` onto torch meshes and
  placements.
- `tensors`: plain tensors to and from DTensors of a layout.
- `block_maps`: which block of a tensor a block of its transpose or
  reshape needs.
- `safetensors_file`: a safetensors file read box by box with positioned
  reads (its header parsed here), not through a memory map.
- `stored_values`: values of a weights file read when used (a sharded
  variable reads only its block): an HDF5 dataset, or a safetensors tensor
  with the transposes and reshapes applied to it recorded.
- `collectives`: the one bucketed flat collective (gradient averages, metric
  sums, broadcasts).
- `replicas`: the batch axis: replicas, their process group, the current
  batch's weight.
- `agreement`: what ranks agree on: that they do the same thing (one small
  all-gather names what differs), when they stop (training or input), and
  that a step succeeded on every rank (barrier, agree, gather).

Nothing is re-exported: importing the package imports none of them.

"""
