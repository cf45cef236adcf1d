"""This process joins its job: which launcher started it, the process
group, seeds, and the hosts a failure lost. The bottom room of the package:
it knows torch.distributed and the launchers' environments, not meshes,
DTensors or models.

Modules, bottom first (a module imports only those above it):

- `agent_store`: a key space of its own for each start of the processes on
  torchrun's store, which keeps the keys of earlier attempts.
- `hostlist`: SLURM node lists ("rack[1-2]-node[01-04]") expanded.
- `record`: the `Launch` record (what `initialize()` does here) and
  readers of launcher variables whose errors name them.
- `schedulers`: one function per launcher (torchrun, SLURM, LSF,
  Kubeflow): its variables -> a Launch.
- `mpi`: the same for the MPI launchers (Open MPI, PMI, MVAPICH2).
- `environments`: `detect`, which tries them innermost launcher first, with
  initialize()'s arguments winning; pure functions of the environment.
- `interfaces`: the network interface gloo listens on where the host
  name resolves to loopback in a job across hosts.
- `failures`: the one line naming the process that failed first.
- `spawn`: one process per local device through torch's elastic agent,
  for `initialize()` in a script started without a launcher.
- `seeds`: every process agrees on seeds.
- `lost_hosts`: the hosts and ranks a failed collective lost, in one line.
- `runtime`: this process in its job, starting nothing: whether a group
  runs, rank and world, devices, the group for CPU tensors, timeouts.
- `rendezvous`: the process group started: torch's rendezvous bounded in
  time, `init_process_group`, the hosts remembered, the start-failure
  message.
- `join`: `initialize()` (detect, spawn or fall back, start, seed),
  `ensure_initialized`, `list_devices`, `shutdown`.

`join` is the one place that starts a process group; it asks
`environments` how and `spawn` to start the local processes.

Nothing is re-exported: importing the package imports none of them.
"""
