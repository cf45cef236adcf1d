"""`ktd plan`: a script's per-rank memory and collectives at any world
size, simulated in one CPU process as rank 0 of N.

    ktd plan --world 64 --json plan.json train.py [ARGS]

The script runs unchanged in a world of N processes made by torch's fake
process group (collectives return at once and move nothing): the mesh it
builds from `keras.distribution.list_devices()` is the one it would get on
N devices, and its variables are born sharded as rank 0's shards, allocated
but never initialised (untouched pages cost no memory). It stops at its
first fit / evaluate / predict / save; at a fit, after one simulated
training step whose collectives are counted and whose FSDP gathers are
measured (their number and sizes exact, their values meaningless): on
fake tensors that allocate nothing, so that models of any size are
simulated (or on rank 0's own tensors, --step real). Every rank's
bytes are then computed from the variables' layouts: pure arithmetic on
shapes and placements, checked against what rank 0 holds.

Modules, bottom first (a module imports only those above it):

- `_collective_counts`: counting a step's collectives (the plan's step,
  tests, benchmarks).
- `_world`: the simulated world (torch's fake process group), started and
  destroyed only by `ktd plan`.
- `_values`: variables allocated, not initialised, while planning.
- `_peers`: a script's own collectives that need real peers, refused.
- `_shards`: each rank's bytes of a variable, its gradient, its optimizer
  state and FSDP's gathered groups, from shapes and layouts.
- `_gathered`: FSDP's gathered weights measured in a step (held at once,
  largest gather), at the dispatcher.
- `_fake_step`: a step on fake tensors (torch's FakeTensorMode): the
  collectives of a model of any size, nothing allocated.
- `_fsdp_figure`: each rank's FSDP figure, measured or estimated.
- `_stops`: the script stopped at its first fit / evaluate / predict /
  save, after one counted training step.
- `_runner`: runs the script and assembles the plan.
- `_output`: the plan as text and as JSON.
- `_command`: `ktd plan`'s arguments.

Nothing is re-exported: importing the package imports none of them. A
script asks `is_planning()` to skip, while planned, what needs real peers
(its own collectives: `_peers`).
"""


def is_planning():
    """True while `ktd plan` runs this process as rank 0 of a simulated
    world: a script skips with it what needs real peers (a collective of
    its own, whose result the simulated world cannot give)."""
    from keras_torch_distribution.plan import _world

    return _world.is_simulated()
