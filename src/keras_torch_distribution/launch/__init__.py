"""Starting processes: which launcher started this one, and starting more.

- `agent_store`: a key space of its own for each start of the processes on
  torchrun's store, which keeps the keys of earlier attempts.
- `hostlist`: SLURM node lists ("rack[1-2]-node[01-04]") expanded.
- `record`: the `Launch` record (what `initialize()` does here) and
  readers of launcher variables whose errors name them.
- `schedulers`: one function per launcher (torchrun, SLURM, MPI, LSF,
  Kubeflow): its variables -> a Launch.
- `environments`: `detect`, which tries them innermost launcher first, with
  initialize()'s arguments winning; pure functions of the environment.
- `interfaces`: the network interface gloo listens on where the host
  name resolves to loopback in a job across hosts.
- `failures`: the one line naming the process that failed first.
- `spawn`: one process per local device through torch's elastic agent,
  for `initialize()` in a script started without a launcher.
- `stuck_agent`: a node whose torchrun agent cannot reach the rendezvous
  store ends anyway, with the failed rank's error.
- `torchrun`: `ktd run`, over torchrun.
- `__main__`: what every launched process runs (`python -m
  keras_torch_distribution.launch SCRIPT`).

`runtime` is the one place that starts a process group; it asks
`environments` how and `spawn` to start the local processes.
"""

from keras_torch_distribution.launch.failures import failure_summary  # noqa: F401
from keras_torch_distribution.launch.failures import first_failure  # noqa: F401
from keras_torch_distribution.launch.torchrun import Signalled  # noqa: F401
from keras_torch_distribution.launch.torchrun import run  # noqa: F401
from keras_torch_distribution.launch.torchrun import torchrun_arguments  # noqa: F401
