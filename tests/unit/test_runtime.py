"""Starting the process group: what `initialize()` hands torch (mocked, no
ranks spawned, as Keras' JAX distribution_lib test mocks
jax.distributed.initialize) and the errors of a launch without one. Every
wait bounded by KTD_TIMEOUT_SECONDS (two real processes) is in
e2e/test_initialize_timeout.py.
"""

import datetime
import os
import re
from unittest import mock

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import pytest  # noqa: E402

from keras_torch_distribution import runtime  # noqa: E402

from helpers import LAUNCHER_VARIABLES  # noqa: E402


class _Stop(RuntimeError):
    """Raised by the mocked init_process_group: initialize() ends there."""


@pytest.fixture
def torch_start(monkeypatch):
    """Records what initialize() hands torch's rendezvous and
    init_process_group (which then raises _Stop); no process group starts."""
    monkeypatch.setenv("KTD_TIMEOUT_SECONDS", "7")
    monkeypatch.setenv("KTD_DEVICE", "cpu")
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    store = mock.Mock(name="store")
    calls = mock.Mock()

    def rendezvous(url, rank, world_size, timeout):
        calls.rendezvous(url, rank, world_size, timeout=timeout)
        yield store, rank, world_size

    calls.init_process_group.side_effect = _Stop
    monkeypatch.setattr(runtime.dist, "rendezvous", rendezvous)
    monkeypatch.setattr(runtime.dist, "init_process_group", calls.init_process_group)
    return calls, store


_SEVEN_SECONDS = datetime.timedelta(seconds=7)


@pytest.mark.parametrize("job_addresses, num_processes, url", [
    ("10.0.0.1:1234", 2, "tcp://10.0.0.1:1234"),
    ("10.0.0.1:1234,10.0.0.2:1234", 2, "tcp://10.0.0.1:1234"),
    ("node-a", 2, "tcp://node-a:29500"),  # no port: torchrun's default
    ("[::1]", 2, "tcp://[::1]:29500"),
    ("[::1]:1234", 2, "tcp://[::1]:1234"),
    ("fe80::1", 2, "tcp://[fe80::1]:29500"),
    ("tcp://10.0.0.1:1234", 2, "tcp://10.0.0.1:1234"),
    ("file:///tmp/ktd-rendezvous", 2, "file:///tmp/ktd-rendezvous"),
])
def test_initialize_hands_torch_the_coordinator_and_the_timeout(
        torch_start, job_addresses, num_processes, url):
    calls, store = torch_start
    with pytest.raises(RuntimeError, match=r"could not start process 1 of 2 at "):
        keras.distribution.initialize(job_addresses, num_processes, 1)
    assert calls.mock_calls == [
        mock.call.rendezvous(url, 1, 2, timeout=_SEVEN_SECONDS),
        mock.call.init_process_group(backend="gloo", store=store, world_size=2, rank=1,
                                     timeout=_SEVEN_SECONDS),
    ]
    store.set_timeout.assert_called_once_with(_SEVEN_SECONDS)


def test_initialize_from_the_launcher_environment(torch_start, monkeypatch):
    calls, store = torch_start
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
                       "MASTER_PORT": "1234"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match=(
            r"could not start process 1 of 2 at env:// \(MASTER_ADDR='10.0.0.1', "
            r"MASTER_PORT='1234'\) within KTD_TIMEOUT_SECONDS=7 s")):
        keras.distribution.initialize()
    assert calls.mock_calls == [
        mock.call.rendezvous("env://", -1, -1, timeout=_SEVEN_SECONDS),
        mock.call.init_process_group(backend="gloo", store=store, world_size=-1, rank=-1,
                                     timeout=_SEVEN_SECONDS),
    ]


def test_initialize_picks_this_process_gpu(torch_start, monkeypatch):
    """On CUDA, the process computes on GPU LOCAL_RANK % device_count."""
    from keras_torch_distribution import seeds

    calls, store = torch_start
    calls.init_process_group.side_effect = None  # the group "starts"
    monkeypatch.delenv("KTD_DEVICE")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(runtime.torch.cuda, "set_device", calls.set_device)
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(seeds, "initialize_rng", calls.initialize_rng)
    keras.distribution.initialize("10.0.0.1:1234", 4, 3)
    assert calls.mock_calls == [
        mock.call.rendezvous("tcp://10.0.0.1:1234", 3, 4, timeout=_SEVEN_SECONDS),
        mock.call.init_process_group(backend="cpu:gloo,cuda:nccl", store=store,
                                     world_size=4, rank=3, timeout=_SEVEN_SECONDS),
        mock.call.set_device(1),
        mock.call.initialize_rng(),
    ]


@pytest.mark.parametrize("job_addresses", ["node-a:0", "node-a:70000", "node-a:",
                                           ":1234", "node-a:port", "[::1]x"])
def test_job_addresses_that_are_not_an_address(torch_start, job_addresses):
    with pytest.raises(ValueError, match=(
            rf"^job_addresses={re.escape(repr(job_addresses))} is not 'host:port' or "
            r"'host' \(process 0's address first; port 29500 when left out\) nor an init "
            r"URL such as 'tcp://host:port' or 'file:///path'. Give e.g. "
            r"job_addresses='10.0.0.1:1234'.$")):
        keras.distribution.initialize(job_addresses, 2, 1)
    assert torch_start[0].mock_calls == []


def test_a_launch_without_its_environment_says_how_to_start(monkeypatch):
    """WORLD_SIZE says 2 processes but nothing says where the others are:
    every entry point says what is missing and how to fix it, instead of
    acting as one process or starting a group that cannot form."""
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    for key in LAUNCHER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    expected = (
        "WORLD_SIZE=2 says this process is one of 2, but the environment lacks "
        "MASTER_ADDR, MASTER_PORT to join the others (found RANK=1, WORLD_SIZE=2). "
        "Launch the script with `ktd run -n 2 script.py` or torchrun, which set RANK, "
        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT; or call "
        "keras.distribution.initialize(job_addresses='host:port' (process 0's), "
        "num_processes=2, process_id=...) on every process; or unset WORLD_SIZE for a "
        "one-process run."
    )
    mesh = keras.distribution.DeviceMesh((2,), ["model"], ["cpu:0", "cpu:1"])
    for use in (keras.distribution.list_devices, keras.distribution.DataParallel,
                lambda: mesh.backend_mesh, keras.distribution.initialize):
        with pytest.raises(RuntimeError) as caught:
            use()
        assert str(caught.value) == expected


def test_a_bad_world_size_is_named(monkeypatch):
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"^WORLD_SIZE='two' is not a number of processes"):
        keras.distribution.list_devices()
