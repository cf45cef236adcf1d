"""`ktd run`: start a script on N processes with torch's own launcher.

`ktd run -n 2 train.py --lr 0.1` is `torchrun --nproc-per-node 2 train.py
--lr 0.1` (standalone rendezvous on this machine unless --nnodes or
--rdzv-endpoint say otherwise; every other torchrun option passes through),
plus: KERAS_BACKEND=torch, OMP_NUM_THREADS=1 per process unless set, and the
script runs with this package installed into Keras even if it never imports
it, so an unchanged Keras-on-JAX distribution script runs on torch.

When a rank fails, torchrun stops the others and `ktd run` prints the
error once (`_processes.failures.failure_report`: the first failure's
traceback without the launcher's frames, a line per other rank) and exits
non-zero with a last line naming the rank that failed first and its
exception (or the signal that killed it, or the preemption signal it
stopped on); with `--max-restarts N` torchrun starts every rank again
instead, up to N times. SIGUSR1 is added to the signals torchrun's agent
passes on to the ranks. Bad arguments and settings (a missing script, a
bad -n, a KTD_* value, CUDA asked for where there is none) are refused in
one line, exit 2, before any rank starts (`Refused`).
"""

import errno
import os
import signal
import socket
import sys

from keras_torch_distribution import _env
from keras_torch_distribution._processes.failures import failure_report
from keras_torch_distribution._processes.failures import launcher_exit_code
from keras_torch_distribution._processes.failures import quiet_agent_logs
from keras_torch_distribution._processes.record import PARENT_PID_VARIABLE
from keras_torch_distribution._processes.spawn import handled_signals
from keras_torch_distribution.launch._script import Refused
from keras_torch_distribution.launch._script import check_script
from keras_torch_distribution.launch._stuck_agent import Watch

# What each rank runs: the package's `launch.__main__`, loaded without the
# package's `__init__` (a script that never imports Keras starts as fast as
# under torchrun; one that does gets the backend installed then).
RANK_ENTRY = "keras_torch_distribution_cli._rank"

_OWN_OPTIONS = {"-n": "--nproc-per-node", "--nproc": "--nproc-per-node"}
# Options that tell torchrun where the other nodes are: with any of them (or
# more than one node), `ktd run` does not add --standalone.
_RENDEZVOUS_OPTIONS = (
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-id",
    "--rdzv_id",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
)
# torchrun options that change what is run: `ktd run` always runs a script
# file through keras_torch_distribution.launch, so they cannot be combined.
_UNSUPPORTED_OPTIONS = (
    "-m",
    "--module",
    "--no-python",
    "--no_python",
    "--run-path",
    "--run_path",
)
# torchrun's option for the signals its agent passes on to the ranks. Unless
# it is given (or PET_SIGNALS_TO_HANDLE, its variable), `ktd run` gives
# torchrun's default with SIGUSR1 added: SLURM's `--signal=USR1@90` then
# reaches the ranks instead of killing the agent (SIGUSR1's default action).
_SIGNALS_OPTIONS = ("--signals-to-handle", "--signals_to_handle")
_SIGNALS_VARIABLE = "PET_SIGNALS_TO_HANDLE"
# Words torchrun accepts for --nproc-per-node besides a number.
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
# torchrun's options that take no value (torch 2.11 to 2.15; checked against
# its parser by unit/test_launcher.py): known here, the script is found
# without importing torch.
TORCHRUN_FLAGS = frozenset(
    (
        "-h",
        "--help",
        "-m",
        "--module",
        "--no-python",
        "--no_python",
        "--run-path",
        "--run_path",
        "--standalone",
        "--virtual-local-rank",
        "--virtual_local_rank",
    )
)


def torchrun_arguments(argv):
    """torch.distributed.run arguments for `ktd run` arguments.

    `-n N` is `--nproc-per-node N`; every other option before the script is
    torchrun's and passes through unchanged. One node (no rendezvous option,
    `--nnodes` absent or 1) gets `--standalone`, a private rendezvous on a
    free port; otherwise torchrun's rendezvous options decide, e.g.
    `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint host:port`. Without
    --signals-to-handle (or PET_SIGNALS_TO_HANDLE), SIGUSR1 is added to
    torchrun's default signals, which its agent passes on to the ranks.
    """
    arguments = []
    nnodes = "1"
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        option = argv[index]
        name, sep, value = option.partition("=")
        name = _OWN_OPTIONS.get(name, name)
        if name in _UNSUPPORTED_OPTIONS:
            raise Refused(
                f"ktd run: torchrun's {name} is not supported: `ktd run` runs "
                "a Python script file with the backend installed, e.g. `ktd "
                "run -n 2 train.py`. Use torchrun directly for modules or "
                "non-Python programs (and `import keras_torch_distribution` in "
                "them)."
            )
        if not sep and name not in TORCHRUN_FLAGS:
            if index + 1 >= len(argv):
                raise Refused(
                    f"ktd run: option {name} needs a value, e.g. "
                    "`ktd run -n 2 train.py`."
                )
            value = argv[index + 1]
            arguments.extend([name, value])
            index += 2
        else:
            arguments.append(name + (sep + value if sep else ""))
            index += 1
        if name == "--nnodes":
            nnodes = value
        if name == "--nproc-per-node":
            _check_nproc(option.partition("=")[0], value)
    if index >= len(argv):
        raise Refused(
            "ktd run: give a script to run, e.g. `ktd run -n 2 train.py`"
        )
    multi_node = nnodes not in ("1", "1:1") or any(
        a.split("=")[0] in _RENDEZVOUS_OPTIONS for a in arguments
    )
    if not multi_node and "--standalone" not in arguments:
        arguments.append("--standalone")
    if _SIGNALS_VARIABLE not in os.environ and not any(
        a.split("=")[0] in _SIGNALS_OPTIONS for a in arguments
    ):
        arguments.extend(["--signals-to-handle", handled_signals()])
    script, script_args = argv[index], argv[index + 1 :]
    return arguments + ["-m", RANK_ENTRY, script] + script_args


def _check_nproc(option, value):
    """Refuse a --nproc-per-node that is not a positive count (torchrun
    would end in a bare AssertionError)."""
    if value in _NPROC_WORDS or (value.isdigit() and int(value) > 0):
        return
    raise Refused(
        f"ktd run: {option} {value} is not a number of processes per node: "
        "give a whole number of at least 1, e.g. `ktd run -n 2 train.py` (or "
        f"one of torchrun's {', '.join(_NPROC_WORDS)})."
    )


def _check_settings():
    """Refuse bad KTD_* settings here, once, rather than in every rank."""
    from keras_torch_distribution._processes import record

    for _, error in _env.setting_errors():
        raise Refused(f"ktd run: {error}")
    try:
        record.spawn_setting(os.environ)
    except ValueError as error:
        raise Refused(f"ktd run: {error}") from None
    misspelled = _env.misspelled()
    if misspelled:  # said here, once; not by the ranks
        print(f"ktd run: {_env.misspelled_text(misspelled)}", file=sys.stderr)


def _check_cuda(arguments):
    """Refuse a CUDA request (KTD_DEVICE=gpu/cuda, `-n gpu`) where CUDA is
    not available, naming what was found, before any rank starts."""
    import torch
    from torch.distributed import run as torch_run

    from keras_torch_distribution._processes import runtime

    nproc = torch_run.parse_args(arguments).nproc_per_node
    asked = []
    if _env.device_request() == "cuda":
        asked.append(f"KTD_DEVICE={os.environ['KTD_DEVICE']}")
    if nproc == "gpu":
        asked.append("-n gpu (one process per GPU)")
    if not asked or torch.cuda.is_available():
        return
    raise Refused(
        f"ktd run: {' and '.join(asked)} asks for CUDA, but "
        f"{runtime.cuda_found()} Run it on a machine with a GPU and a CUDA "
        "build of torch, or give a number of CPU processes, e.g. `ktd run -n "
        "2 train.py` (and unset KTD_DEVICE)."
    )


def _hosted_port(arguments):
    """The port this node's torchrun will listen on for a static rendezvous
    (node rank 0 hosts it at --master-port), or None when it hosts none
    (--standalone picks a free port itself; c10d rendezvous decides alone).
    """
    from torch.distributed import run as torch_run

    parsed = torch_run.parse_args(arguments)
    if (
        parsed.standalone
        or parsed.rdzv_backend != "static"
        or parsed.node_rank != 0
    ):
        return None
    endpoint = (
        parsed.rdzv_endpoint or f"{parsed.master_addr}:{parsed.master_port}"
    )
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def _port_in_use_message(port, reason):
    return (
        f"ktd run: --master-port {port} is in use on this machine ({reason}), "
        "and this node (node rank 0) must host the rendezvous there. Give a "
        "free port with --master-port (the same on every node), stop the "
        f"program that holds it (`ss -ltnp 'sport = :{port}'` names it), or, "
        "on one machine, leave out --master-addr and --master-port: `ktd run` "
        "then picks a free port."
    )


def _check_port_free(port):
    """Refuse a rendezvous port another program holds, before ranks start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise Refused(_port_in_use_message(port, error.strerror)) from None


def _watch_agent(arguments):
    """For a job across nodes, a started `stuck_agent.Watch`: this node
    ends even when its agent cannot reach the rendezvous store."""
    from torch.distributed import run as torch_run

    parsed = torch_run.parse_args(arguments)
    if parsed.standalone:
        return None
    endpoint = (
        parsed.rdzv_endpoint or f"{parsed.master_addr}:{parsed.master_port}"
    )
    watch = Watch(endpoint)
    watch.start()
    return watch


class Failed(SystemExit):
    """Ranks failed: `ktd` prints `message` (the failure report) and exits
    with the code the first failed rank chose (1 for an exception, N for
    `sys.exit(N)`; 1 for a signal)."""

    def __init__(self, message, code):
        super().__init__(code)
        self.message = message


class Signalled(SystemExit):
    """`ktd run`'s torchrun agent got a signal it handles, passed it on to
    the ranks and stopped them: exit with 128 + the signal (as a process
    that signal ended), after `message` (printed by `ktd`)."""

    def __init__(self, signal_number, message):
        super().__init__(128 + signal_number)
        self.message = message


def use_torch_backend(environ=os.environ):
    """KERAS_BACKEND=torch for the ranks; a note (one line, stderr) when
    this shell said another backend (a JAX user's `export
    KERAS_BACKEND=jax`): the package runs Keras on torch only."""
    said = environ.get("KERAS_BACKEND", "").strip()
    environ["KERAS_BACKEND"] = "torch"
    if said and said != "torch":
        print(backend_note(said), file=sys.stderr)


def backend_note(said, what="the ranks"):
    """The note for a shell whose KERAS_BACKEND is `said`, not torch."""
    return (
        f"ktd: note: KERAS_BACKEND={said} in this shell; ktd runs {what} with "
        "Keras on torch (KERAS_BACKEND=torch), the backend "
        "keras_torch_distribution distributes."
    )


def run(argv):
    """`ktd run ARGV`: check the arguments, the script and the settings
    (before torch is imported: a refusal takes well under a second), then
    start torchrun. Raises `Refused` or `Signalled`, or SystemExit with the
    failure report when ranks failed."""
    arguments = torchrun_arguments(argv)
    check_script(arguments[arguments.index(RANK_ENTRY) + 1])
    _check_settings()
    use_torch_backend()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed import DistNetworkError
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
    )

    _check_cuda(arguments)
    port = _hosted_port(arguments)
    if port is not None:
        _check_port_free(port)
    # Each process dies with this one, even if it is SIGKILLed (see __main__).
    parent_before = os.environ.get(PARENT_PID_VARIABLE)
    os.environ[PARENT_PID_VARIABLE] = str(os.getpid())
    watch = _watch_agent(arguments)
    full = _env.full_tracebacks()
    try:
        with quiet_agent_logs(not full):
            torch_run.main(arguments)
    except ChildFailedError as error:
        # torchrun stopped every other process when this one failed: the
        # error once, and which rank failed first, without the launcher's
        # own traceback (KTD_FULL_TRACEBACKS=1: torchrun's table as well).
        report = failure_report(error.failures, full_tracebacks=full)
        raise Failed(
            f"{error}\n{report}" if full else report,
            launcher_exit_code(error.failures),
        ) from None
    except SignalException as error:
        # torchrun's agent got a signal it handles (SIGTERM, SIGUSR1, ...),
        # passed it on to the ranks, stopped them and does not restart them.
        name = signal.Signals(error.sigval).name
        raise Signalled(
            error.sigval,
            f"ktd run: got {name}; torchrun passed it on to the ranks and "
            f"stopped them. Exiting with {128 + error.sigval}, as a process "
            f"ended by {name}.",
        ) from None
    except DistNetworkError as error:
        if port is None or "EADDRINUSE" not in str(error):
            raise
        # Taken between our check and torchrun's own bind.
        raise Refused(
            _port_in_use_message(port, "address already in use")
        ) from None
    finally:  # (run() is also called in tests' own process)
        if watch is not None:
            watch.stop()
        if parent_before is None:
            del os.environ[PARENT_PID_VARIABLE]
        else:
            os.environ[PARENT_PID_VARIABLE] = parent_before
