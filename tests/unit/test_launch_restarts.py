"""Restarts without launching: the key space each start of the processes
gets on torchrun's store (ranks are threads on one in-process store), the
signals and restarts `ktd run` and `initialize()` hand torch's elastic
agent, KTD_MAX_RESTARTS, and the failure line of a preempted rank. The
launches are in e2e/test_restarts.py.
"""

import datetime
import json
import os
import signal
import threading

import pytest
import torch.distributed as dist

from keras_torch_distribution import _env
from keras_torch_distribution._processes import agent_store
from keras_torch_distribution._processes import spawn
from keras_torch_distribution._processes.failures import failure_summary
from keras_torch_distribution.launch import _torchrun

_LAUNCH = ["-m", "keras_torch_distribution_cli._rank"]
_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
_TEN_SECONDS = datetime.timedelta(seconds=10)

# --------------------------------------------------------------------------
# A fresh key space for each start, on a store that outlives the processes
# --------------------------------------------------------------------------


def _start(store, world_size, timeout=_TEN_SECONDS, late=()):
    """Every rank of one start, each a thread: {rank: its PrefixStore or the
    exception it raised}. Ranks in `late` start 0.3 s after the others."""
    out = {}

    def rank_main(rank):
        if rank in late:
            threading.Event().wait(0.3)
        try:
            out[rank] = agent_store.fresh_namespace(
                store, rank, world_size, timeout
            )
        except Exception as error:  # noqa: BLE001 (checked by the test)
            out[rank] = error

    threads = [
        threading.Thread(target=rank_main, args=(rank,), daemon=True)
        for rank in range(world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout.total_seconds() + 5)
    assert not any(thread.is_alive() for thread in threads)
    return out


def _shared(stores, rank):
    """What every rank reads of the key `rank` wrote in its store."""
    stores[rank].set("written by", str(rank))
    return {r: s.get("written by").decode() for r, s in stores.items()}


def test_every_rank_of_a_start_gets_the_same_new_key_space():
    store = dist.HashStore()
    first = _start(store, 3)
    assert _shared(first, 2) == {0: "2", 1: "2", 2: "2"}
    # A restart on the same store (as torchrun's agent keeps it): the keys
    # of the first start are there, rank 0 comes last, and still every rank
    # of the second start shares a space of its own.
    second = _start(store, 3, late=(0,))
    assert all(isinstance(s, dist.PrefixStore) for s in second.values())
    assert not second[1].check(["written by"])
    assert _shared(second, 1) == {0: "1", 1: "1", 2: "1"}
    assert first[0].get("written by") == b"2"  # the first start's, untouched
    # A start that stopped before its members checked in leaves rank 0's
    # name behind; the next start does not take it.
    store.set(agent_store.LEADER_KEY, "an-earlier-start")
    third = _start(store, 2, late=(0,))
    assert _shared(third, 0) == {0: "0", 1: "0"}
    assert not third[0].check(["an-earlier-start"])


def test_a_world_of_one_needs_nobody():
    store = dist.HashStore()
    alone = _start(store, 1)
    assert isinstance(alone[0], dist.PrefixStore)


def test_a_rank_that_never_checks_in_is_named_after_the_timeout():
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=0.5)
    with pytest.raises(
        TimeoutError,
        match=r"^ranks 1, 2 never checked in on the launcher's store",
    ):
        agent_store.fresh_namespace(store, 0, 3, timeout)
    with pytest.raises(
        TimeoutError,
        match=r"^rank 0 never published this start's name",
    ):
        agent_store.fresh_namespace(dist.HashStore(), 1, 3, timeout)
    # Only an earlier start's name: rank 0 of this one never answers.
    store.set(agent_store.LEADER_KEY, "an-earlier-start")
    with pytest.raises(
        TimeoutError, match=r"^rank 0 did not answer rank 2 .*an-earlier-start"
    ):
        agent_store.fresh_namespace(store, 2, 3, timeout)


def test_initialize_uses_a_fresh_key_space_only_on_the_agents_store(
    monkeypatch,
):
    """Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the group is built
    on the store under this start's own prefix; elsewhere on the store."""
    from keras_torch_distribution._processes import join
    from keras_torch_distribution._processes import runtime

    class Stop(RuntimeError):
        pass

    store = dist.HashStore()
    handed = []

    def rendezvous(url, rank, world_size, timeout):
        yield store, rank, world_size

    def init_process_group(**kwargs):
        handed.append(kwargs["store"])
        raise Stop

    monkeypatch.setenv("KTD_DEVICE", "cpu")
    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", "10")
    # (set: rank 0 alone does not wait for the others' host names)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime.dist, "rendezvous", rendezvous)
    monkeypatch.setattr(runtime.dist, "init_process_group", init_process_group)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(RuntimeError):
        join.initialize("10.0.0.1:1234", 2, 0)
    assert handed == [store]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    member = threading.Thread(  # rank 1 of the same start
        target=agent_store.fresh_namespace,
        args=(store, 1, 2, _TEN_SECONDS),
        daemon=True,
    )
    member.start()
    with pytest.raises(RuntimeError):
        join.initialize("10.0.0.1:1234", 2, 0)
    member.join(10)
    assert isinstance(handed[1], dist.PrefixStore)
    assert store.check([agent_store.LEADER_KEY])


# --------------------------------------------------------------------------
# Signals and restarts handed to the elastic agent
# --------------------------------------------------------------------------


def test_ktd_run_adds_sigusr1_to_the_signals_torchrun_passes_on(monkeypatch):
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    assert _torchrun.torchrun_arguments(
        ["-n", "2", "--max-restarts", "1", "t.py"]
    ) == [
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--standalone",
        "--signals-to-handle",
        _SIGNALS,
        *_LAUNCH,
        "t.py",
    ]
    # The user's own choice stays, in either spelling or as its variable.
    for given in (
        ["--signals-to-handle", "SIGTERM"],
        ["--signals_to_handle=SIGTERM,SIGUSR2"],
    ):
        arguments = _torchrun.torchrun_arguments([*given, "-n", "2", "t.py"])
        assert arguments[: len(given)] == given
        assert "--signals-to-handle" not in arguments[len(given) :]
    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", "SIGTERM")
    assert "--signals-to-handle" not in _torchrun.torchrun_arguments(
        ["-n", "2", "t.py"]
    )


def test_a_signal_to_ktd_run_ends_it_with_128_plus_the_signal(
    monkeypatch, capsys
):
    """torchrun's agent passed the signal on and stopped the ranks; `ktd
    run` exits as a process ended by that signal, without a traceback."""
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def agent(arguments):
        raise SignalException("got signal: 10", sigval=signal.SIGUSR1)

    monkeypatch.setattr(torch_run, "main", agent)
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    monkeypatch.setenv(
        "OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1")
    )
    with pytest.raises(SystemExit) as exited:
        _torchrun.run(["-n", "2", __file__])
    assert exited.value.code == 138
    from keras_torch_distribution_cli import main

    assert main(["run", "-n", "2", __file__]) == 138
    assert capsys.readouterr().err == (
        "ktd run: got SIGUSR1; torchrun passed it on to the ranks and stopped "
        "them. Exiting with 138, as a process ended by SIGUSR1.\n"
    )


def test_torchrun_still_defaults_to_the_signals_we_extend():
    """If torch changes its default, `handled_signals`' default must too."""
    from torch.distributed import run as torch_run

    (action,) = [
        a
        for a in torch_run.get_args_parser()._actions
        if a.dest == "signals_to_handle"
    ]
    if "PET_SIGNALS_TO_HANDLE" not in os.environ:
        assert action.default == spawn.DEFAULT_SIGNALS


def test_handled_signals_adds_sigusr1_once():
    assert spawn.handled_signals() == _SIGNALS
    assert spawn.handled_signals("SIGTERM, SIGUSR1 ,SIGINT") == (
        "SIGTERM,SIGUSR1,SIGINT"
    )
    assert spawn.handled_signals("SIGINT") == "SIGINT,SIGUSR1"


@pytest.mark.parametrize(
    "text, value", [(None, 0), ("0", 0), ("3", 3), (" 2 ", 2)]
)
def test_max_restarts_setting(monkeypatch, text, value):
    if text is None:
        monkeypatch.delenv("KTD_MAX_RESTARTS", raising=False)
    else:
        monkeypatch.setenv("KTD_MAX_RESTARTS", text)
    assert _env.max_restarts() == value


@pytest.mark.parametrize("text", ["-1", "two", "1.5", ""])
def test_a_bad_max_restarts_setting_is_named_with_the_fix(monkeypatch, text):
    monkeypatch.setenv("KTD_MAX_RESTARTS", text)
    with pytest.raises(
        ValueError,
        match=(
            rf"^KTD_MAX_RESTARTS={text!r} is not a number of restarts: set a "
            r"whole number >= 0 .* e\.g\. KTD_MAX_RESTARTS=3, or unset it"
        ),
    ):
        _env.max_restarts()


@pytest.fixture
def agent(monkeypatch, tmp_path):
    """start_processes with torch's elastic_launch replaced: the
    LaunchConfig it got. Restores what start_processes changes."""
    from torch.distributed.launcher import api

    configs = []

    def elastic_launch(config, entrypoint):
        configs.append(config)
        return lambda *args: None

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    for key in (
        spawn.LAUNCHED_VARIABLE,
        spawn.PARENT_PID_VARIABLE,
        "OMP_NUM_THREADS",
        "KTD_MAX_RESTARTS",
    ):
        # Set, then deleted: monkeypatch then removes what start_processes
        # sets (a delenv of a missing variable records nothing to undo).
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return configs


def _one_node():
    from keras_torch_distribution._processes.record import SPAWN
    from keras_torch_distribution._processes.record import Launch

    return Launch(
        environment="local",
        start=SPAWN,
        address="localhost",
        port=0,
        world=2,
        rank=0,
        local_rank=0,
        nproc=2,
        nnodes=1,
        node_rank=0,
    )


def test_initialize_hands_the_agent_restarts_and_sigusr1(agent, monkeypatch):
    with pytest.raises(SystemExit) as exited:
        spawn.start_processes(_one_node(), 30)
    assert exited.value.code == 0
    assert (agent[0].max_restarts, agent[0].signals_to_handle) == (0, _SIGNALS)
    monkeypatch.setenv("KTD_MAX_RESTARTS", "2")
    with pytest.raises(SystemExit):
        spawn.start_processes(_one_node(), 30)
    assert agent[1].max_restarts == 2
    monkeypatch.setenv("KTD_MAX_RESTARTS", "many")
    with pytest.raises(ValueError, match=r"KTD_MAX_RESTARTS='many'"):
        spawn.start_processes(_one_node(), 30)
    assert len(agent) == 2  # refused before the agent starts


# --------------------------------------------------------------------------
# The failure line of a preempted rank
# --------------------------------------------------------------------------


def _failure(tmp_path, local_rank, exitcode, timestamp, message=None):
    """torchrun's record of a failed rank (as in test_launcher.py)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = str(tmp_path / f"error_{local_rank}.json")
    if message is not None:
        with open(error_file, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {
                            "py_callstack": "Traceback ...",
                            "timestamp": str(timestamp),
                        },
                    }
                },
                f,
            )
    failure = ProcessFailure(
        local_rank=local_rank,
        pid=1000 + local_rank,
        exitcode=exitcode,
        error_file=error_file,
    )
    failure.timestamp = timestamp
    return failure


@pytest.mark.parametrize("exitcode, name", [(143, "SIGTERM"), (138, "SIGUSR1")])
def test_a_rank_that_stopped_on_a_preemption_signal_was_preempted(
    tmp_path, exitcode, name
):
    preempted = _failure(tmp_path, 1, exitcode, 100)
    assert failure_summary({1: preempted}) == (
        f"ktd run: rank 1 (local rank 1) was preempted by {name} (exit code "
        f"{exitcode}). It is resumable: relaunch the job, or use `ktd run "
        "--max-restarts N` to restart it in place (keras.callbacks."
        "BackupAndRestore resumes from its newest backup)."
    )
    assert "use KTD_MAX_RESTARTS=N to restart" in failure_summary(
        {1: preempted}, launcher="keras.distribution.initialize()"
    )
    # What it recorded, if anything, is said.
    said = _failure(tmp_path, 2, exitcode, 100, "Preempted: saved at step 7")
    assert failure_summary({2: said}).startswith(
        f"ktd run: rank 2 (local rank 2) was preempted by {name} (exit code "
        f"{exitcode}): Preempted: saved at step 7. It is resumable"
    )


def test_a_rank_stopped_after_a_failure_is_not_named_preempted(tmp_path):
    """torchrun SIGTERMs the survivors of a failure; one that handles
    SIGTERM exits 143 in the same second as the rank that raised."""
    raised = _failure(tmp_path, 1, 1, 100, "ValueError: bad input")
    stopped = _failure(tmp_path, 0, 128 + signal.SIGTERM, 100)
    assert failure_summary({0: stopped, 1: raised}).startswith(
        "ktd run: rank 1 (local rank 1) failed first, exit code 1: "
        "ValueError: bad input."
    )


def test_a_rank_killed_by_sigusr1_is_no_native_crash(tmp_path):
    killed = _failure(tmp_path, 0, -signal.SIGUSR1, 100)
    assert failure_summary({0: killed}) == (
        "ktd run: rank 0 (local rank 0) died first, by signal SIGUSR1 (exit "
        "code -10). SIGUSR1 is SLURM's warning before a job's end "
        "(`--signal=USR1@N`) or a `kill -USR1`; nothing in the rank handled "
        "it, so it ended. It left no traceback. torchrun stopped the other "
        "processes."
    )
