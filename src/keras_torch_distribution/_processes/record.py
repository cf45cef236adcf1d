"""What a launcher's variables make of this process, and reading them.

`Launch` is what `environments.detect` decides; the readers refuse a
value that is not what a launcher sets, and `require` a partial set,
naming the variables found, the ones missing and the fix. `Outside` is
what detection reads beyond the variables (a file, MPI).
"""

from __future__ import annotations

import dataclasses
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from collections.abc import Mapping
    from collections.abc import Sequence

# torchrun's default MASTER_PORT, used for an address given without a port.
DEFAULT_PORT = 29500
CLUSTER_VARIABLE = "KTD_CLUSTER"
SPAWN_VARIABLE = "KTD_SPAWN"
# The pid of the process running the elastic agent (`ktd run`, or the one
# `initialize()` made the agent): each process it starts dies with it
# (launch/__main__.py).
PARENT_PID_VARIABLE = "KTD_PARENT_PID"
# What a row makes of this process.
JOIN = "join"  # it is one process of a job of `world` processes
SPAWN = "spawn"  # it starts `nproc` processes on this node, then waits for them
SINGLE = "single"  # a world of one


class IncompleteEnvironmentError(RuntimeError):
    """A launcher's variables say this process is one of several, but some
    are missing or disagree: joining is impossible, training alone wrong."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What `initialize()` does, as `detect` found it.

    environment: the row that matched ("explicit", "torchelastic", ...).
    start: JOIN, SPAWN or SINGLE.
    world: the number of processes of the job.
    rank / local_rank: this process's (JOIN); None under SPAWN. A JOIN's
        local_rank is None where the launch does not say it (no LOCAL_RANK):
        `rendezvous` counts it on the rendezvous store.
    address / port: process 0's host and port (under SPAWN on several
        nodes, node 0's rendezvous); None where torch reads them itself.
    init_method: what torch's rendezvous is given (JOIN).
    nproc / nnodes / node_rank: under SPAWN, the processes to start here,
        the nodes and this node's index: rank = node_rank * nproc + index.
    fallback: under SPAWN, what to do where processes cannot be started
        (an interactive session, `python -c`, first use): None means that
        is an error (the user asked for several processes).
    variables: the variables the decision was read from, with their values.
    """

    environment: str
    start: str
    world: int = 1
    rank: int | None = 0
    local_rank: int | None = 0
    address: str | None = None
    port: int | None = None
    init_method: str | None = None
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    fallback: Launch | None = None
    variables: tuple[tuple[str, object], ...] = ()

    def describe(self) -> dict[str, object]:
        """{field: value} for `ktd env`."""
        shown = {"environment": self.environment, "start": self.start}
        if self.start == SPAWN:
            shown.update(
                processes_per_node=self.nproc,
                nodes=self.nnodes,
                node_rank=self.node_rank,
                world=self.world,
                ranks=f"{self.node_rank * self.nproc}..."
                f"{(self.node_rank + 1) * self.nproc - 1}",
            )
        else:
            shown.update(
                world=self.world, rank=self.rank, local_rank=self.local_rank
            )
        shown.update(
            address=self.address, port=self.port, init_method=self.init_method
        )
        shown["read from"] = (
            " ".join(f"{k}={v}" for k, v in self.variables) or "-"
        )
        return shown


def spawn_setting(env: Mapping[str, str]) -> int | None:
    """KTD_SPAWN as an int (0: never start processes), or None when unset."""
    text = env.get(SPAWN_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(
            f"{SPAWN_VARIABLE}={env[SPAWN_VARIABLE]!r} is not a number of "
            "local processes: set 0 to never start local processes, N >= 1 to "
            "start N per node (also on CPU), or unset it (one per local GPU)."
        )
    return int(text)


def node_processes(env: Mapping[str, str], local_devices: int) -> int:
    """Processes started on this node: KTD_SPAWN, else one per local
    accelerator. (KTD_SPAWN=0, never start any, is `spawn`'s to refuse.)"""
    return spawn_setting(env) or max(local_devices, 1)


def join(
    name: str,
    env: Mapping[str, str],
    world: int,
    rank: int,
    local: int | None,
    address: str | None,
    port: int,
    names: Sequence[str],
    init_method: str | None = None,
) -> Launch:
    """The Launch of process `rank` of `world` (a world of one: SINGLE),
    read by launcher `name` from the variables `names` of `env`; raises
    when `rank` is not in [0, world). `address` may be None only for a
    world of one."""
    if not 0 <= rank < world:
        raise IncompleteEnvironmentError(
            f"{name} made this process rank {rank} of {world} processes "
            f"({shown(present(env, names))}): a rank must be in [0, {world}). "
            "Check how the job was started."
        )
    if world == 1:
        return Launch(name, SINGLE, variables=present(env, names))
    return Launch(
        name,
        JOIN,
        world,
        rank,
        local,
        address,
        port,
        init_method or f"tcp://{_bracketed(address)}:{port}",
        variables=present(env, names),
    )


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def require(
    env: Mapping[str, str],
    what: str,
    names: Sequence[str],
    also: Sequence[str] = (),
    fix: str = "",
) -> None:
    """Raise naming what was found and what is missing, unless all of
    `names` are set."""
    missing = [n for n in names if not env.get(n)]
    if missing:
        found = present(env, tuple(names) + tuple(also))
        raise IncompleteEnvironmentError(
            f"This process looks started by {what} "
            f"({shown(found) or 'nothing set'}), "
            f"but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing, "
            f"so it cannot join the other processes. {fix} Or set "
            f"{CLUSTER_VARIABLE}=none to run one process and ignore these "
            "variables."
        )


def present(
    env: Mapping[str, str], names: Iterable[str]
) -> tuple[tuple[str, str], ...]:
    """(name, value) of each of `names` set in `env`, in order, once."""
    return tuple((n, env[n]) for n in dict.fromkeys(names) if env.get(n))


def shown(variables: Iterable[tuple[str, object]]) -> str:
    """`NAME=value, ...` of (name, value) pairs, for messages."""
    return ", ".join(f"{k}={v}" for k, v in variables)


def read_whole(env: Mapping[str, str], name: str, minimum: int = 1) -> int:
    """Variable `name` of `env` as a whole number >= `minimum`; raises
    naming it otherwise."""
    text = env[name].strip()
    if not text.isdigit() or int(text) < minimum:
        what = "a number of processes" if minimum else "a rank or index"
        raise ValueError(
            f"{name}={env[name]!r} is not {what} "
            f"(a whole number >= {minimum}): "
            "the launcher sets it so; correct it, or unset it for a "
            "one-process run."
        )
    return int(text)


def read_local_rank(env: Mapping[str, str], name: str) -> int:
    """`name` as a local rank, 0 when it is unset."""
    return read_whole(env, name, minimum=0) if env.get(name) else 0


def read_local_rank_or_none(env: Mapping[str, str], name: str) -> int | None:
    """`name` as a local rank, or None when it is unset: a launch that
    says nothing about the processes of a host (an explicit initialize(),
    a MASTER_ADDR / WORLD_SIZE / RANK launch), whose local rank `rendezvous`
    then counts on the rendezvous store (so that the processes of one host
    never all pick GPU 0)."""
    return read_whole(env, name, minimum=0) if env.get(name) else None


def read_port(env: Mapping[str, str], name: str) -> int:
    """Variable `name` of `env` as a port in [1, 65535]; raises naming it
    otherwise."""
    text = env[name].strip()
    if not text.isdigit() or not 0 < int(text) < 2**16:
        raise ValueError(
            f"{name}={env[name]!r} is not a port: give a number in "
            "[1, 65535], the same free port for every process."
        )
    return int(text)


def read_port_or_none(env: Mapping[str, str], name: str) -> int | None:
    """`name` as a port, None when it is unset."""
    return read_port(env, name) if env.get(name) else None


class Outside:
    """What detection reads beyond the environment variables; tests replace
    it."""

    def read_text(self, path: str) -> str:
        """The text of the file at `path` (UTF-8)."""
        with open(path, encoding="utf-8") as f:
            return f.read()

    def mpi_address(self) -> tuple[str, int] | None:
        """(rank 0's host name, a port free there), broadcast from rank 0 to
        every rank of MPI_COMM_WORLD by mpi4py; None without mpi4py.
        Collective over MPI: every rank reaches it together, in initialize()."""
        try:
            from mpi4py import MPI
        except ImportError:
            return None
        told = None
        if MPI.COMM_WORLD.Get_rank() == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                told = (socket.gethostname(), probe.getsockname()[1])
        return MPI.COMM_WORLD.bcast(told, root=0)
