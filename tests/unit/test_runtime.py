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

from helpers import LAUNCHER_VARIABLES  # noqa: E402
from keras_torch_distribution import _keras  # noqa: E402
from keras_torch_distribution._processes import rendezvous  # noqa: E402
from keras_torch_distribution._processes import runtime  # noqa: E402


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

    def torch_rendezvous(url, rank, world_size, timeout):
        calls.rendezvous(url, rank, world_size, timeout=timeout)
        yield store, rank, world_size

    calls.init_process_group.side_effect = _Stop
    monkeypatch.setattr(runtime.dist, "rendezvous", torch_rendezvous)
    # (tested in test_interfaces.py and tests/hosts)
    monkeypatch.setattr(rendezvous.interfaces, "choose", lambda *args: None)
    monkeypatch.setattr(rendezvous, "_remember_hosts", lambda *args: None)
    monkeypatch.setattr(
        runtime.dist, "init_process_group", calls.init_process_group
    )
    return calls, store


_SEVEN_SECONDS = datetime.timedelta(seconds=7)


@pytest.mark.parametrize(
    "job_addresses, num_processes, url",
    [
        ("10.0.0.1:1234", 2, "tcp://10.0.0.1:1234"),
        ("10.0.0.1:1234,10.0.0.2:1234", 2, "tcp://10.0.0.1:1234"),
        ("node-a", 2, "tcp://node-a:29500"),  # no port: torchrun's default
        ("[::1]", 2, "tcp://[::1]:29500"),
        ("[::1]:1234", 2, "tcp://[::1]:1234"),
        ("fe80::1", 2, "tcp://[fe80::1]:29500"),
        ("tcp://10.0.0.1:1234", 2, "tcp://10.0.0.1:1234"),
        ("file:///tmp/ktd-rendezvous", 2, "file:///tmp/ktd-rendezvous"),
    ],
)
def test_initialize_hands_torch_the_coordinator_and_the_timeout(
    torch_start, job_addresses, num_processes, url
):
    calls, store = torch_start
    with pytest.raises(
        RuntimeError, match=r"could not start process 1 of 2 at "
    ):
        keras.distribution.initialize(job_addresses, num_processes, 1)
    assert calls.mock_calls == [
        mock.call.rendezvous(url, 1, 2, timeout=_SEVEN_SECONDS),
        mock.call.init_process_group(
            backend="gloo",
            store=store,
            world_size=2,
            rank=1,
            timeout=_SEVEN_SECONDS,
        ),
    ]
    store.set_timeout.assert_called_once_with(_SEVEN_SECONDS)


def test_initialize_from_the_launcher_environment(torch_start, monkeypatch):
    calls, store = torch_start
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        RuntimeError,
        match=(
            r"could not start process 1 of 2 at env:// "
            r"\(MASTER_ADDR='10.0.0.1', MASTER_PORT='1234'\) within "
            r"KTD_TIMEOUT_SECONDS=7 s"
        ),
    ):
        keras.distribution.initialize()
    assert calls.mock_calls == [
        mock.call.rendezvous("env://", -1, -1, timeout=_SEVEN_SECONDS),
        mock.call.init_process_group(
            backend="gloo",
            store=store,
            world_size=-1,
            rank=-1,
            timeout=_SEVEN_SECONDS,
        ),
    ]


def test_initialize_picks_this_process_gpu(torch_start, monkeypatch):
    """On CUDA, the process computes on GPU LOCAL_RANK % device_count."""
    from keras_torch_distribution._processes import seeds

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
    # The GPU is current before the group is made, and the group is bound
    # to it (NCCL connects at once; barriers and mesh groups know it).
    assert calls.mock_calls == [
        mock.call.rendezvous(
            "tcp://10.0.0.1:1234", 3, 4, timeout=_SEVEN_SECONDS
        ),
        mock.call.set_device(1),
        mock.call.init_process_group(
            backend="cpu:gloo,cuda:nccl",
            store=store,
            world_size=4,
            rank=3,
            timeout=_SEVEN_SECONDS,
            device_id=runtime.torch.device("cuda", 1),
        ),
        mock.call.initialize_rng(None),
    ]


def _started_on_cuda(torch_start, monkeypatch, device_count=2):
    """torch_start with CUDA "available" and the group "started"."""
    from keras_torch_distribution._processes import seeds

    calls, store = torch_start
    calls.init_process_group.side_effect = None
    monkeypatch.delenv("KTD_DEVICE")
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        runtime.torch.cuda, "device_count", lambda: device_count
    )
    monkeypatch.setattr(runtime.torch.cuda, "set_device", calls.set_device)
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(seeds, "initialize_rng", calls.initialize_rng)
    return calls, store


def test_an_explicit_start_without_local_rank_counts_the_host_processes(
    torch_start, monkeypatch
):
    """initialize(job_addresses, n, id) on a GPU host with no LOCAL_RANK:
    the process counts itself in on the store under its host name (the
    third process of this host here), instead of taking GPU 0 as every
    other process of the host would."""
    calls, store = _started_on_cuda(torch_start, monkeypatch, device_count=4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    store.add.return_value = 3  # two processes of this host came first
    keras.distribution.initialize("10.0.0.1:1234", 4, 1)
    store.add.assert_called_once_with(
        f"ktd/local_rank/{rendezvous.socket.gethostname()}", 1
    )
    calls.set_device.assert_called_once_with(2)
    assert calls.init_process_group.call_args.kwargs[
        "device_id"
    ] == runtime.torch.device("cuda", 2)


def test_a_given_local_rank_is_not_counted(torch_start, monkeypatch):
    calls, store = _started_on_cuda(torch_start, monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    keras.distribution.initialize("10.0.0.1:1234", 4, 1)
    store.add.assert_not_called()
    calls.set_device.assert_called_once_with(1)


def test_a_cpu_start_touches_no_gpu(torch_start, monkeypatch):
    """KTD_DEVICE=cpu on a CUDA machine: gloo, no device, no device_id."""
    from keras_torch_distribution._processes import seeds

    calls, store = torch_start
    calls.init_process_group.side_effect = None
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.cuda, "set_device", calls.set_device)
    monkeypatch.setattr(_keras.torch_core_module, "DEFAULT_DEVICE", "cuda")
    monkeypatch.setattr(runtime.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(runtime.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(seeds, "initialize_rng", calls.initialize_rng)
    keras.distribution.initialize("10.0.0.1:1234", 2, 1)
    assert calls.mock_calls == [
        mock.call.rendezvous(
            "tcp://10.0.0.1:1234", 1, 2, timeout=_SEVEN_SECONDS
        ),
        mock.call.init_process_group(
            backend="gloo",
            store=store,
            world_size=2,
            rank=1,
            timeout=_SEVEN_SECONDS,
        ),
        mock.call.initialize_rng(None),
    ]
    store.add.assert_not_called()


# ---------------------------------------------------------------------------
# KTD_DEVICE=cpu on a CUDA machine (mocked CUDA)
# ---------------------------------------------------------------------------


@pytest.fixture
def cuda_machine(monkeypatch):
    """CUDA "available", and Keras' torch device "cuda" as Keras picks it
    there (restored after the test)."""
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_keras.torch_core_module, "DEFAULT_DEVICE", "cuda")
    monkeypatch.delenv("KERAS_TORCH_DEVICE", raising=False)


def test_ktd_device_cpu_makes_keras_compute_on_the_cpu(
    cuda_machine, monkeypatch
):
    """KTD_DEVICE=cpu picks gloo; Keras must then make CPU tensors too (gloo
    cannot carry CUDA ones), in every thread and after clear_session."""
    import threading

    monkeypatch.setenv("KTD_DEVICE", "cpu")
    assert runtime._backend() == "gloo"
    assert str(_keras.torch_device()) == "cpu"
    keras.backend.clear_session()
    assert keras.ops.zeros((2,)).device.type == "cpu"
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append(str(_keras.torch_device()))
    )
    thread.start()
    thread.join()
    assert seen == ["cpu"]


def test_ktd_device_cpu_refuses_another_keras_torch_device(
    cuda_machine, monkeypatch
):
    monkeypatch.setenv("KTD_DEVICE", "cpu")
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "cuda:0")
    with pytest.raises(
        ValueError,
        match=(
            r"^KTD_DEVICE=cpu asks for CPU processes \(gloo\), but "
            r"KERAS_TORCH_DEVICE='cuda:0' makes Keras compute on another device"
        ),
    ):
        runtime.uses_cuda()


def test_without_ktd_device_keras_stays_on_cuda(cuda_machine, monkeypatch):
    monkeypatch.delenv("KTD_DEVICE", raising=False)
    assert runtime.uses_cuda()
    assert _keras.default_torch_device() == "cuda"


def test_cpu_devices_on_a_cuda_run_are_refused(cuda_machine, monkeypatch):
    """A 'cpu' mesh on a CUDA run would hold CUDA tensors: refused, from
    list_devices('cpu') and from hand-written 'cpu:R' devices."""
    from keras_torch_distribution._distributed import layouts

    monkeypatch.delenv("KTD_DEVICE", raising=False)
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    with pytest.raises(
        ValueError,
        match=(
            r"^list_devices\('cpu'\) asks for CPU devices, but this run "
            r"computes on CUDA \(process group 'cpu:gloo,cuda:nccl', Keras' "
            r"torch device 'cuda'\)"
        ),
    ):
        keras.distribution.list_devices("cpu")
    monkeypatch.setattr(layouts.join, "ensure_initialized", lambda: 1)
    mesh = keras.distribution.DeviceMesh((1,), ["batch"], ["cpu:0"])
    with pytest.raises(
        ValueError,
        match=r"^DeviceMesh devices \['cpu:0'\] are CPUs, but "
        r"this run computes on CUDA",
    ):
        layouts.to_torch_mesh(mesh)


def test_gpu_devices_under_ktd_device_cpu_are_refused(
    cuda_machine, monkeypatch
):
    from keras_torch_distribution._distributed import layouts

    monkeypatch.setenv("KTD_DEVICE", "cpu")
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    assert keras.distribution.list_devices("gpu") == []
    monkeypatch.setattr(layouts.join, "ensure_initialized", lambda: 1)
    mesh = keras.distribution.DeviceMesh((1,), ["batch"], ["gpu:0"])
    with pytest.raises(
        ValueError,
        match=r"are GPUs, but KTD_DEVICE=cpu runs this process "
        r"on the CPU",
    ):
        layouts.to_torch_mesh(mesh)


@pytest.mark.parametrize(
    "job_addresses",
    ["node-a:0", "node-a:70000", "node-a:", ":1234", "node-a:port", "[::1]x"],
)
def test_job_addresses_that_are_not_an_address(torch_start, job_addresses):
    with pytest.raises(
        ValueError,
        match=(
            rf"^job_addresses={re.escape(repr(job_addresses))} is not "
            r"'host:port' or 'host' \(process 0's address first; port 29500 "
            r"when left out\) nor an init URL such as 'tcp://host:port' or "
            r"'file:///path'. Give e.g. job_addresses='10.0.0.1:1234'.$"
        ),
    ):
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
        "MASTER_ADDR, MASTER_PORT to join the others (found RANK=1, "
        "WORLD_SIZE=2). Launch the script with `ktd run -n 2 script.py` or "
        "torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; or "
        "call keras.distribution.initialize(job_addresses='host:port' (process "
        "0's), num_processes=2, process_id=...) on every process; or unset "
        "WORLD_SIZE for a one-process run."
    )
    mesh = keras.distribution.DeviceMesh((2,), ["model"], ["cpu:0", "cpu:1"])
    for use in (
        keras.distribution.list_devices,
        keras.distribution.DataParallel,
        lambda: mesh.backend_mesh,
        keras.distribution.initialize,
    ):
        with pytest.raises(RuntimeError) as caught:
            use()
        assert str(caught.value) == expected


def test_a_bad_world_size_is_named(monkeypatch):
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(
        ValueError, match=r"^WORLD_SIZE='two' is not a number of processes"
    ):
        keras.distribution.list_devices()


@pytest.mark.parametrize("value", ["gpu", "cuda", "GPU"])
def test_a_cuda_request_where_cuda_is_absent_is_an_error(monkeypatch, value):
    """KTD_DEVICE=gpu/cuda on a machine without CUDA: an error naming what
    was found (torch's build, the devices it sees, CUDA_VISIBLE_DEVICES),
    not a silent run on the CPU."""
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime.torch.version, "cuda", "12.4")
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("KTD_DEVICE", value)
    with pytest.raises(
        RuntimeError,
        match=(
            rf"^KTD_DEVICE={value} asks for CUDA, but CUDA is not available "
            rf"here: torch {re.escape(runtime.torch.__version__)} is built "
            r"with CUDA 12.4, it sees 0 CUDA device\(s\), "
            r"CUDA_VISIBLE_DEVICES is ''\. Run on a machine with a GPU"
        ),
    ):
        runtime.uses_cuda()
