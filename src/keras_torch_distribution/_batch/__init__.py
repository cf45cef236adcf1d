"""The batch axis: each replica's rows of the global batch, and what must
see the global batch anyway.

Modules, bottom first (a module imports only those above it):

- `adapter`: each replica's rows of the global batch (Keras' data adapters,
  as on JAX).
- `random_slices`: a replica's slice of the random numbers one process draws
  (dropout).
- `sync_batch_norm`: BatchNormalization's moments over the global batch.
- `position`: where `fit` is in its data (saved with backups), and a resume
  at exactly that batch.

Nothing is re-exported: importing the package imports none of them.

"""
