"""FSDP: variables sharded on the batch axis, gathered for use, regathered in
backward, by group with prefetch (as FSDP2 does it).

Modules, bottom first (a module imports only those above it):

- `flat_shards`: one flat all-gather / reduce-scatter for a group's shards
  (copy-in, padding, copy-out).
- `lookup_gradients`: an embedding lookup's gradient made in the reduce-
  scatter's rank-major order.
- `gathering`: each variable's gather plan; gathering for use and
  regathering in backward.
- `einsum_grad`: einsum that saves its operands, not copies of them (FSDP
  regathers them).
- `group_specs`: which variables make a layer's group, in which buckets.
- `group_calls`: a group's call: one flat all-gather per bucket, values
  copied out, gradients reduce-scattered flat.
- `groups`: FSDP by group: the forward's order, prefetch, the scopes.

Nothing is re-exported: importing the package imports none of them.

"""
