"""The step: the model boundary, `jit_compile`, gradients and the optimizer,
metrics, and Keras' training loop on N processes.

Modules, bottom first (a module imports only those above it):

- `batch_logs`: a batch's logs read on the host only when shown or used.
- `overlap`: the gradient all-reduce overlapped with backward, as DDP does
  it.
- `regions`: `jit_compile=True` as torchtitan compiles: each repeated
  block's call compiled once per class.
- `optimizer_update`: Keras' torch Adam and SGD updates in place, on local
  blocks, without host syncs; compiled under `jit_compile=True`.
- `boundary`: the model boundary, through the seam's `Layer.__call__`.
- `remat`: rematerialization: the recompute replays the forward's layer
  calls in the forward's Keras call context.
- `compiled`: the step under `jit_compile=True`: repeated blocks compiled,
  or the outermost call under a distribution.
- `metric_states`: metric states summed over replicas, in the gradient
  all-reduce when it has one.
- `float8`: Keras' float8 layers: their matrix products as
  `torch._scaled_mm` where the GPU has float8, their bias gradient
  rounded after the replicas' sum.
- `quantized`: Keras' int8 layers under FSDP: the gathered int8 kernel
  gathered again in backward, not kept from forward.
- `reductions`: how the replicas' gradients combine (sum of the
  replicas' shares of the loss, mean, or the maximum for variables
  overwritten with their gradient: float8 scales and amax histories).
- `gradients`: gradients aligned with their variables' layouts and averaged
  over the replicas (the step's metric states riding along).
- `call_agreement`: ranks agree on a fit / evaluate / predict call before
  it runs (what differs named).
- `trainer`: fit / evaluate / predict on N processes: gradient sync,
  metrics, predictions, logs.
- `replica_start`: copies of a variable are equal before a model's first
  step.

Nothing is re-exported: importing the package imports none of them.
"""
