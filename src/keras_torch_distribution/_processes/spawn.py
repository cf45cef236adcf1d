"""This node's processes, started by `initialize()` through torch's elastic
agent.

Where `environments.detect` says this process should start its node's
processes (a bare `python train.py` on a machine with several GPUs,
`initialize(num_processes=N)` without a launcher, one srun task or one
Kubeflow pod per node), this process becomes what torchrun is: it runs
torch's elastic agent (`torch.distributed.launcher.api.elastic_launch`),
which starts `nproc` processes running the same script again, with rank =
node_rank * nproc + local index, and waits for them. So failures, signals
and exit codes are torchrun's: when one process fails, the agent stops the
others and this process exits non-zero naming the one that failed first; a
signal to this process (SIGTERM, SIGINT, ..., and SIGUSR1, SLURM's warning
before a job's end) is passed on to them and stops them all; with
KTD_MAX_RESTARTS=N the agent starts them all again up to N times after one
fails (torchrun's --max-restarts; never after a signal to the agent); and each
process dies with this one even when it is SIGKILLed (see `__main__`). On
success this process exits 0 without running the rest of the script
(it never trains).

Processes are started only from `initialize()` called in the main thread of
a script or module run by Python; never from an interactive session,
`python -c`, a Jupyter kernel, the first use of a mesh or `list_devices()`
(the script is already running), a process that a launcher started, or with
KTD_SPAWN=0. `why_not` says which of these holds.
"""

import os
import signal
import subprocess
import sys
import threading
import uuid

import keras_torch_distribution._processes.environments as environments
from keras_torch_distribution import _env
from keras_torch_distribution._processes.failures import failure_report
from keras_torch_distribution._processes.failures import launcher_exit_code
from keras_torch_distribution._processes.failures import quiet_agent_logs
from keras_torch_distribution._processes.record import PARENT_PID_VARIABLE

# The directory Python started in: the script's relative paths (its own
# path in sys.argv[0] included) mean this, even if it changed directory
# before initialize().
_STARTUP_DIRECTORY = os.getcwd()
# Set in every started process: a process started by this package never
# starts processes itself, whatever its environment says.
LAUNCHED_VARIABLE = "KTD_LAUNCHED"
LAUNCHER_NAME = "keras.distribution.initialize()"
_RUNNER = "keras_torch_distribution.launch"
# The signals torch's elastic agent handles by default (torch 2.11 to 2.15,
# torchrun's --signals-to-handle): it stops its processes with the signal
# it got and exits. SIGUSR1 is added (`handled_signals`): SLURM's
# `--signal=USR1@90` warns of the end of a job with it, whose default
# action would kill the agent and leave its processes unwarned.
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
EXTRA_SIGNALS = ("SIGUSR1",)


def why_not(first_use=None, environ=os.environ):
    """Why this process must not start processes (a phrase), or None."""
    main = sys.modules.get("__main__")
    argv0 = sys.argv[0] if sys.argv else ""
    if first_use:
        return (
            f"{first_use} started the process group on first use, with the "
            "script already running"
        )
    if environments.spawn_setting(environ) == 0:
        return f"{environments.SPAWN_VARIABLE}=0 is set"
    if environ.get(LAUNCHED_VARIABLE) or environ.get("TORCHELASTIC_RUN_ID"):
        return "this process was itself started by a launcher"
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return "the Python session is interactive"
    if "ipykernel" in sys.modules:
        return "it runs in a Jupyter kernel"
    if argv0 in ("-c", "-", ""):
        return (
            "Python runs a program given by -c or on stdin, which cannot be "
            "run again"
        )
    if not getattr(main, "__file__", None) and not getattr(
        main, "__spec__", None
    ):
        return "the main module is no file that can be run again"
    if threading.current_thread() is not threading.main_thread():
        return "initialize() was called outside the main thread"
    return None


def child_command(argv=None, main=None):
    """The arguments after `python` that run this script again in a started
    process: the interpreter's flags, then `-m keras_torch_distribution.launch`
    (which records failures for the summary and dies with its launcher) and
    the script file or `-m MODULE`, with the script's arguments."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__") if main is None else main
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        module = spec.name
        if module.endswith(".__main__"):
            module = module[: -len(".__main__")]
        target = ["-m", module]
    else:
        target = [os.path.join(_STARTUP_DIRECTORY, argv[0])]
    # The flags this interpreter was started with (-X, -W, -O, ...), as
    # multiprocessing gives them to its spawned processes; -u as torchrun.
    flags = subprocess._args_from_interpreter_flags()
    return ["-u", *flags, "-m", _RUNNER, *target, *argv[1:]]


def handled_signals(signals=DEFAULT_SIGNALS):
    """`signals` (torch's comma-separated signal names) with SIGUSR1 added
    where it is missing: the signals the elastic agent passes on to its
    processes."""
    names = [name.strip() for name in signals.split(",") if name.strip()]
    names += [name for name in EXTRA_SIGNALS if name not in names]
    return ",".join(names)


def start_processes(launch, timeout_seconds):
    """Run this node's `launch.nproc` processes of `launch` under torch's
    elastic agent and exit when they end: 0 when all succeed, otherwise
    naming the process that failed first. Never returns. The agent starts
    them again up to KTD_MAX_RESTARTS times after one fails, and passes
    SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 on to them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
    )
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.launcher.api import elastic_launch

    command = child_command()
    if launch.nnodes == 1:
        # torchrun --standalone: a private rendezvous on a free port (an
        # address or port derived for other nodes is of no use here).
        backend, endpoint = "c10d", "localhost:0"
        rendezvous, run_id = {}, str(uuid.uuid4())
    else:
        # torchrun --nnodes N --node-rank R --master-addr A --master-port P:
        # node 0's agent hosts the store that every node's processes join.
        backend, endpoint = "static", f"{launch.address}:{launch.port}"
        rendezvous, run_id = (
            {"rank": launch.node_rank},
            f"ktd-{launch.environment}",
        )
    config = LaunchConfig(
        min_nodes=launch.nnodes,
        max_nodes=launch.nnodes,
        nproc_per_node=launch.nproc,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=dict(rendezvous, timeout=int(max(timeout_seconds, 1))),
        max_restarts=_env.max_restarts(),
        monitor_interval=0.1,
        signals_to_handle=handled_signals(),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun, for nproc > 1
    os.environ[LAUNCHED_VARIABLE] = "1"
    os.environ[PARENT_PID_VARIABLE] = str(os.getpid())
    os.chdir(_STARTUP_DIRECTORY)
    full = _env.full_tracebacks()
    try:
        with quiet_agent_logs(not full):
            elastic_launch(config, sys.executable)(*command)
    except ChildFailedError as error:
        report = failure_report(error.failures, LAUNCHER_NAME, full)
        print(f"{error}\n{report}" if full else report, file=sys.stderr)
        raise SystemExit(launcher_exit_code(error.failures)) from None
    except SignalException as error:  # Ctrl-C, a scheduler's SIGTERM: one line
        name = signal.Signals(error.sigval).name
        print(
            f"{LAUNCHER_NAME}: got {name}; the agent passed it on to the "
            f"processes and stopped them. Exiting with {128 + error.sigval}.",
            file=sys.stderr,
        )
        raise SystemExit(128 + error.sigval) from None
    raise SystemExit(0)
