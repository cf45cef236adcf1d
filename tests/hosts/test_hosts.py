"""Jobs across hosts of their own: network namespaces with their own
addresses, host names and /etc/hosts (network.py), joined by a bridge.
Each host runs `ktd run --nnodes N --rdzv-backend c10d --rdzv-endpoint
node-h1:29400`, as a user runs it on each machine.

- Host names that resolve to 127.0.1.1 on their own host (Debian's and
  Ubuntu's /etc/hosts): the job trains with one process's numbers under
  DataParallel, a 2 x 2 ModelParallel mesh and FSDP, with no setting given
  (the package picks the interface that reaches the other hosts).
- A host cut off mid-fit: every host's `ktd run` ends within
  KTD_TIMEOUT_SECONDS plus 15 s, naming the host and ranks it lost.
- A sharded checkpoint saved on 2 hosts without a shared filesystem
  loads, merged, on 3 hosts.
- An elastic job (`--nnodes 1:2 --max-restarts 1`) goes on without a host
  cut off mid-fit and ends with an uninterrupted run's weights.

Runs as root where `ip` can make network namespaces (CI does); skipped
otherwise. Every namespace, link and process a test makes is removed at
its end, also on failure.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import network
import numpy as np
import pytest

from helpers import PREEMPT_BATCHES
from helpers import PREEMPT_EPOCHS
from helpers import ROOT
from helpers import SHRINK_RDZV_CONF
from helpers import node_args
from helpers import preempt_fit
from helpers import shrink_command

_WHY_NOT = network.unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT)),
]
TIMEOUT_S = 10  # KTD_TIMEOUT_SECONDS of the lost-host test
START_S = 300  # the longest a launch may take on a loaded machine


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu")
    for key in (
        "KERAS_BACKEND",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GLOO_SOCKET_IFNAME",  # (the package must find it)
        "NCCL_SOCKET_IFNAME",
    ):
        env.pop(key, None)
    return dict(env, **extra)


def _ktd_run(hosts, nproc, script, *args):
    """`ktd run` of `script` on every host, as each machine would run it."""
    endpoint = f"{network.HOST_NAME.format(1)}:29400"

    def command(i):
        return [
            sys.executable,
            "-m",
            "keras_torch_distribution",
            "run",
            *node_args(i, endpoint, "hosts-test", hosts.count, nproc),
            script,
            *args,
        ]

    return [
        hosts.run(
            i,
            command(i),
            cwd=ROOT,
            env=_env(KTD_TIMEOUT_SECONDS=str(TIMEOUT_S)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(hosts.count)
    ]


def _outputs(processes, timeout):
    """(returncode, stdout, stderr, seconds taken) of each process."""
    start = time.monotonic()
    results = []
    for process in processes:
        left = max(1.0, timeout - (time.monotonic() - start))
        out, err = process.communicate(timeout=left)
        results.append((process.returncode, out, err, time.monotonic() - start))
    return results


def test_loopback_host_names_train_with_one_process_numbers(tmp_path):
    reference = tmp_path / "one.npz"
    one = subprocess.run(
        [sys.executable, "tests/scripts/hosts_train.py", str(reference)],
        cwd=ROOT,
        env=_env(KERAS_BACKEND="torch"),
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    out = tmp_path / "hosts.npz"
    with network.Hosts(2, names="loopback") as hosts:
        results = _outputs(
            _ktd_run(hosts, 2, "tests/scripts/hosts_train.py", str(out)),
            START_S,
        )
    for i, (code, stdout, stderr, _) in enumerate(results):
        assert code == 0, stderr[-3000:]
        name = network.HOST_NAME.format(i + 1)
        # Two processes per host, each on its own host.
        assert stdout.count(f"host={name} ") == 2, stdout
        assert (
            f"host {name}: its name resolves to 127.0.1.1, a loopback "
            f"address, in a job across 2 hosts" in stderr
        ), stderr[-3000:]
        assert f"Using interface {network.INTERFACE}" in stderr
    want = np.load(reference)
    got = np.load(out)
    for kind in ("dp", "hybrid", "mp"):
        for key in want.files:
            np.testing.assert_allclose(
                got[f"{kind}/{key.partition('/')[2]}"],
                want[key],
                rtol=1e-4,
                atol=2e-5,
                err_msg=f"{kind}: {key}",
            )


def test_a_host_cut_off_mid_fit_ends_the_job_on_every_host(tmp_path):
    marker = tmp_path / "training"
    with network.Hosts(2, names="own") as hosts:
        launches = _ktd_run(
            hosts, 1, "tests/scripts/hosts_long_fit.py", str(marker)
        )
        deadline = time.monotonic() + START_S
        while not marker.exists():
            assert time.monotonic() < deadline, "training never started"
            assert all(p.poll() is None for p in launches), [
                p.communicate() for p in launches
            ]
            time.sleep(0.2)
        hosts.cut(1)
        results = _outputs(launches, TIMEOUT_S + 60)
    h1, h2 = network.HOST_NAME.format(1), network.HOST_NAME.format(2)
    for code, _, stderr, seconds in results:
        assert code != 0, stderr[-3000:]
        assert seconds < TIMEOUT_S + 15, (seconds, stderr[-3000:])
    # The host that kept the rendezvous store names the host it lost...
    last = results[0][2].strip().splitlines()[-1]
    assert last.startswith("ktd run: rank 0 (local rank 0) failed first"), last
    assert f"LostHostsError: rank 0 lost host {h2} (" in last, last
    assert "rank 1)" in last, last
    # ...and the cut-off host, whose agent cannot reach that store, ends too.
    last = results[1][2].strip().splitlines()[-1]
    assert last.startswith("ktd run: rank 1 (local rank 0) failed"), last
    assert f"rank 1 lost the coordinator's host: host {h1} (" in last, last
    assert "Stopping this node's processes." in last, last


def test_saved_on_two_hosts_own_disks_loads_on_three_hosts(tmp_path):
    """A sharded checkpoint saved by 2 hosts, each on its own disk (the
    same path, another folder per host), completes on both; the two
    copies merged (as `rsync` would) load on 3 hosts with every value
    exactly as saved."""
    ckpt = tmp_path / "disk" / "ckpt"
    saved = tmp_path / "saved.npz"
    with network.Hosts(2, own_folder=str(ckpt.parent)) as hosts:
        results = _outputs(
            _ktd_run(
                hosts,
                1,
                "tests/scripts/hosts_checkpoint.py",
                "save",
                str(ckpt),
                str(saved),
            ),
            START_S,
        )
        copies = [os.path.join(hosts.folder_of(i), "ckpt") for i in range(2)]
    for code, _, stderr, _ in results:
        assert code == 0, stderr[-3000:]
    merged = tmp_path / "merged" / "ckpt"
    for copy in copies:
        files = os.listdir(copy)
        assert "keras_checkpoint.json" in files, files  # complete here
        shutil.copytree(copy, merged, dirs_exist_ok=True)
    loaded = tmp_path / "loaded.npz"
    with network.Hosts(3) as hosts:
        results = _outputs(
            _ktd_run(
                hosts,
                1,
                "tests/scripts/hosts_checkpoint.py",
                "load",
                str(merged),
                str(loaded),
            ),
            START_S,
        )
    for code, _, stderr, _ in results:
        assert code == 0, stderr[-3000:]
    want, got = np.load(saved), np.load(loaded)
    assert sorted(got.files) == sorted(want.files)
    for key in want.files:
        np.testing.assert_array_equal(got[key], want[key], key)


def test_the_hosts_left_go_on_without_a_cut_off_host(pool2, tmp_path):
    """`--nnodes 1:2 --max-restarts 1`: host 2 is cut off after step 7
    (tests/scripts/shrink_fit.py, BackupAndRestore every 2 batches); host
    1's ranks fail naming it, its agent restarts them without host 2 and
    the fit resumes from step 6's backup, ending with the weights of an
    uninterrupted run."""
    every_batch = [
        (e, b) for e in range(PREEMPT_EPOCHS) for b in range(PREEMPT_BATCHES)
    ]
    step, save_freq = 7, 2
    (tmp_path / "uninterrupted").mkdir()
    reference = pool2.run(preempt_fit, str(tmp_path / "uninterrupted"), 0)[0]
    endpoint = f"{network.HOST_NAME.format(1)}:29400"
    with network.Hosts(2) as hosts:
        launches = [
            hosts.run(
                i,
                shrink_command(
                    endpoint,
                    "hosts-shrink",
                    SHRINK_RDZV_CONF,
                    tmp_path,
                    step,
                    save_freq,
                ),
                cwd=ROOT,
                env=_env(
                    KTD_TIMEOUT_SECONDS=str(TIMEOUT_S),
                    SHRINK_NODE=str(i),  # host 2's rank stops after `step`
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + START_S
        while not (tmp_path / "stopped").exists():
            assert time.monotonic() < deadline, "step 7 never came"
            assert all(p.poll() is None for p in launches), [
                p.communicate() for p in launches
            ]
            time.sleep(0.1)
        hosts.cut(1)
        code, _, stderr, _ = _outputs(launches[:1], START_S)[0]
    assert code == 0, stderr[-3000:]
    assert f"lost host {network.HOST_NAME.format(2)} (" in stderr or (
        "lost the coordinator's host: host "
        f"{network.HOST_NAME.format(2)} (" in stderr
    ), stderr[-3000:]
    worlds = (tmp_path / "worlds").read_text().split("\n")
    assert worlds == ["0 4", "1 2", ""], worlds
    report = json.loads((tmp_path / "attempt1.json").read_text())
    assert [tuple(p) for p in report["seen"]] == every_batch[step - 1 :]
    got = {
        k.replace("|", "/"): v
        for k, v in np.load(tmp_path / "attempt1.npz").items()
    }
    want = reference[1]
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(
            got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key
        )
