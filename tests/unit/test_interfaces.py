"""Jobs across hosts, the parts that need no second host (tests/hosts has
the jobs): gloo's interface where a host name resolves to loopback
(`_processes.interfaces`), the line naming lost hosts (`lost_hosts`), and a
node whose torchrun agent is stuck (`launch._stuck_agent`)."""

import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from keras_torch_distribution._processes import interfaces
from keras_torch_distribution._processes import lost_hosts


def test_the_loopback_address_is_on_lo():
    assert interfaces.interface_of("127.0.0.1") == "lo"
    assert interfaces.is_loopback(interfaces.gloo_address("localhost"))


def _other_host_checked_in(store, name="node-b", address="192.0.2.1"):
    """What the first process of another host writes in `choose`."""
    store.add(f"ktd/hosts/seen/{name} {address}", 1)
    store.add("ktd/hosts/count", 1)
    store.set("ktd/hosts/host/0", f"{name} {address}")
    store.add("ktd/hosts/arrived", 1)


@pytest.fixture
def loopback_host(monkeypatch):
    """This host's name resolves to 127.0.1.1 (Debian's /etc/hosts)."""
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(interfaces, "gloo_address", lambda name: "127.0.1.1")
    monkeypatch.setattr(interfaces, "_resolve", lambda host: "127.0.1.1")


def test_a_job_on_one_host_keeps_loopback(loopback_host):
    environ = {}
    store = dist.HashStore()
    assert interfaces.choose(store, 0, 1, "node-a", environ) is None
    assert environ == {}


def test_hosts_that_all_reach_the_coordinator_over_loopback_keep_it(
    loopback_host,
):
    """Other host names on one network stack (containers of one machine
    sharing its network): loopback reaches every process."""
    environ = {}
    store = dist.HashStore()
    _other_host_checked_in(store, address="127.0.0.1")
    assert interfaces.choose(store, 1, 2, "node-a", environ) is None
    assert environ == {}


def test_a_set_interface_is_kept(loopback_host):
    environ = {"GLOO_SOCKET_IFNAME": "ib0"}
    store = dist.HashStore()
    _other_host_checked_in(store)
    assert interfaces.choose(store, 1, 2, "node-a", environ) is None
    assert environ == {"GLOO_SOCKET_IFNAME": "ib0"}


def test_the_interface_reaching_the_other_host_is_chosen(
    loopback_host, monkeypatch
):
    routes = {"127.0.1.1": "127.0.0.1", "192.0.2.1": "192.0.2.7"}
    monkeypatch.setattr(interfaces, "source_address", routes.get)
    monkeypatch.setattr(interfaces, "interface_of", {"192.0.2.7": "eth9"}.get)
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    store = dist.HashStore()
    _other_host_checked_in(store)
    assert interfaces.choose(store, 0, 2, "node-a", environ) == "eth9"
    # NCCL's own setting is the user's too.
    assert environ == {
        "GLOO_SOCKET_IFNAME": "eth9",
        "NCCL_SOCKET_IFNAME": "ib0",
    }


def test_no_interface_reaching_the_others_fails_at_once(
    loopback_host, monkeypatch
):
    monkeypatch.setattr(interfaces, "source_address", lambda a: "127.0.0.1")
    store = dist.HashStore()
    _other_host_checked_in(store)
    with pytest.raises(RuntimeError) as raised:
        interfaces.choose(store, 0, 2, "node-a", {})
    message = str(raised.value)
    assert message.startswith(
        "rank 0: this host's name 'node-a' resolves to 127.0.1.1 (loopback), "
        "which gloo would give the other hosts of this job (node-b)"
    ), message
    assert "Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs)" in message


@pytest.fixture
def two_hosts(monkeypatch):
    monkeypatch.setattr(lost_hosts, "ROLL_CALL_SECONDS", 0.2)
    store = dist.HashStore()
    lost_hosts.table.remember(
        store,
        0,
        [("node-a", "192.0.2.1", True), ("node-b", "192.0.2.2", False)],
        "node-a:29400",
    )
    yield store
    lost_hosts.table.clear()


def test_a_rank_that_does_not_sign_in_is_named_with_its_host(two_hosts):
    error = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
        "for recv operation to complete"
    )
    assert lost_hosts.explain(error) == (
        "rank 0 lost host node-b (192.0.2.2: rank 1): stopped answering and "
        "did not sign in on the rendezvous store within 0.2 s (a host that "
        "died or was cut off; a process that died). (RuntimeError: "
        "[gloo/transport/tcp/"
        "unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation "
        "to complete)"
    )
    # One rank of a host that has others: that rank is named.
    lost_hosts.table.hosts.append(("node-b", "192.0.2.2"))
    lost_hosts.table.on_coordinator.append(False)
    two_hosts.set("ktd/alive/2", "1")  # (rank 2 answers the roll call)
    assert lost_hosts.explain(error).startswith(
        "rank 0 lost rank 1 on host node-b (192.0.2.2): stopped "
    )
    # Another failure is not a lost host.
    assert lost_hosts.explain(ValueError("shapes differ")) is None


def test_a_store_that_does_not_answer_names_the_coordinators_host(
    two_hosts, monkeypatch
):
    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(lost_hosts.table, "store", Gone())
    monkeypatch.setattr(lost_hosts.table, "rank", 1)
    line = lost_hosts.explain(RuntimeError("Connection closed by peer"))
    assert line.startswith(
        "rank 1 lost the coordinator's host: host node-a (192.0.2.1: rank 0) "
        "(it holds the rendezvous store at node-a:29400"
    ), line


_STUCK_AGENT = """
import os, subprocess, time
from keras_torch_distribution_cli._light import package_without_keras
with package_without_keras():  # as `ktd run` loads it: without Keras
    from keras_torch_distribution.launch import _stuck_agent
_stuck_agent.Watch("node-a:29400").start()
rank = dict(os.environ, TORCHELASTIC_RUN_ID="x", RANK="1", LOCAL_RANK="0")
failing = subprocess.Popen(["sh", "-c", "sleep 1; exit 3"], env=rank)
sleeping = subprocess.Popen(["sleep", "60"])
not_a_rank = subprocess.Popen(["sh", "-c", "exit 4"])
time.sleep(60)  # (like an agent stuck in its store: nothing is reaped)
"""


def test_a_node_whose_agent_is_stuck_ends():
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _STUCK_AGENT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert took < 30, took
    assert result.stderr.startswith(
        "ktd run: rank 1 (local rank 0) failed, exit code 3. torchrun's "
        "agent on this node has not stopped it for 4 s: it waits on the "
        "rendezvous store at node-a:29400"
    ), result.stderr


def test_ktd_env_shows_the_host_and_the_interface_settings(
    loopback_host, monkeypatch, capsys
):
    from keras_torch_distribution import cli

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    cli.print_env()
    lines = [
        " ".join(line.split()) for line in capsys.readouterr().out.splitlines()
    ]
    assert "host name node-a" in lines
    assert (
        "gloo address 127.0.1.1 (loopback: across hosts the package picks an "
        "interface)"
    ) in lines
    assert "GLOO_SOCKET_IFNAME eth1" in lines
    assert "KTD_MAX_RESTARTS (default: 0)" in lines
