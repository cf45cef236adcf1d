"""A sharded checkpoint saved on hosts that do not share its folder.

Two "hosts" on this machine: two `ktd run --nnodes 2 -n 1` launches (c10d
rendezvous on 127.0.0.1), each in a mount namespace of its own
(`unshare --mount`) where the same checkpoint path is bind-mounted onto a
folder of its own, as two hosts with local disks; for the save, also with
host names of their own (`unshare --uts`), resolving to 127.0.0.1. The
save completes on both (each host's copy has the marker, `.metadata` and
the files of its ranks); one host's copy alone is refused with
SplitCheckpointError naming the missing files, their host and the fix;
the two copies merged into one folder load with exactly the saved values
in 1 process and in 3. The callbacks (ShardedCheckpoint with max_to_keep,
BackupAndRestore) keep each host's copy complete and tidy; resuming from
them on the same hosts is refused on both with the same error (each host
lacks the other's files).

Needs root and `unshare`; skipped with the reason otherwise. Every launch
runs in a session of its own with a timeout, and is killed on failure.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT
from helpers import finish
from helpers import finish_all
from helpers import free_port
from helpers import node_args

SCRIPT = "tests/scripts/hosts_checkpoint.py"
MARKER = "keras_checkpoint.json"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="bind mounts in a mount namespace need root",
    ),
    pytest.mark.skipif(
        shutil.which("unshare") is None or shutil.which("mount") is None,
        reason="needs util-linux's unshare and mount",
    ),
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", KTD_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(ROOT, "src"), env.get("PYTHONPATH")) if p
    )
    env.pop("KERAS_BACKEND", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(key, None)
    env.pop("MASTER_PORT", None)
    return env


def _start(command):
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _ktd(*args):
    return [sys.executable, "-m", "keras_torch_distribution", "run", *args]


def _on_own_disk(own, common, command, name=None, hosts_file=None):
    """`command` where `common` shows the folder `own` (a host's disk);
    with `name`, on a host of that name (a UTS namespace), which
    `hosts_file` (bind-mounted on /etc/hosts) resolves."""
    script = 'mount --bind "$1" "$2" && shift 4 && exec "$@"'
    options = ["--mount", "--propagation", "private"]
    if name is not None:
        script = 'hostname "$3" && mount --bind "$4" /etc/hosts && ' + script
        options.append("--uts")
    return [
        "unshare",
        *options,
        "sh",
        "-c",
        script,
        "sh",
        str(own),
        str(common),
        str(name),
        str(hosts_file),
        *command,
    ]


def _two_hosts(
    tmp_path, mode, target, values, succeed=True, names=False, timeout=240
):
    """Run SCRIPT `mode` on 2 hosts of 1 process; `target` lies under
    tmp_path/common, which each host sees as its own tmp_path/host<K>.
    With `names`, the hosts are also named ktd-host<K> (resolving to
    127.0.0.1); else they keep this machine's name, like containers of
    one host with mounts of their own. The CompletedProcess of each host
    (each exited 0 if `succeed`)."""
    common = tmp_path / "common"
    common.mkdir(exist_ok=True)
    hosts_file = tmp_path / "hosts"
    with open("/etc/hosts") as f:
        hosts_file.write_text(f.read() + "\n127.0.0.1 ktd-host0 ktd-host1\n")
    endpoint = f"127.0.0.1:{free_port()}"
    hosts = []
    for node in (0, 1):
        own = tmp_path / f"host{node}"
        own.mkdir(exist_ok=True)
        launch = _ktd(
            *node_args(node, endpoint, f"hosts-{mode}"),
            SCRIPT,
            mode,
            str(target),
            str(values),
        )
        name = f"ktd-host{node}" if names else None
        hosts.append(
            _start(_on_own_disk(own, common, launch, name, hosts_file))
        )
    results = finish_all(hosts, timeout)
    for result in results:
        assert (result.returncode == 0) == succeed, result.stderr[-3000:]
    return results


def _load(path, values, n, timeout=240):
    return finish(
        _start(_ktd("-n", str(n), SCRIPT, "load", path, values)), timeout
    )


def _values(path):
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def test_saved_on_two_disks_merged_loads_on_1_and_3_processes(tmp_path):
    saved_values = tmp_path / "saved.npz"
    _two_hosts(
        tmp_path,
        "save",
        tmp_path / "common" / "ckpt",
        saved_values,
        names=True,
    )
    copies = [tmp_path / f"host{node}" / "ckpt" for node in (0, 1)]
    written = []
    for copy in copies:
        # Complete on each host: renamed into place, marker and metadata.
        names = sorted(os.listdir(copy))
        assert MARKER in names and ".metadata" in names, names
        assert not os.path.exists(f"{copy}.incomplete")
        assert os.listdir(copy.parent) == ["ckpt"]  # no probe file left
        written.append([n for n in names if n.endswith(".distcp")])
    assert sorted(sum(written, [])) == ["__0_0.distcp", "__1_0.distcp"]
    markers = [(copy / MARKER).read_bytes() for copy in copies]
    assert markers[0] == markers[1]
    assert (copies[0] / ".metadata").read_bytes() == (
        copies[1] / ".metadata"
    ).read_bytes()
    marker = json.loads(markers[0])
    assert marker["storage_groups"] == [[0], [1]]
    assert {e["rank"] for e in marker["files"].values()} == {0, 1}
    writers = {
        name: (entry["rank"], entry["host"])
        for name, entry in marker["files"].items()
    }
    # Rank 0 wrote .metadata; each host's name is recorded with its files.
    assert writers[".metadata"] == writers["__0_0.distcp"]
    assert {host for _, host in writers.values()} == {"ktd-host0", "ktd-host1"}

    # One host's copy alone: the other host's file is named, with the fix.
    lone = copies[0]
    other = written[1][0]
    refused = _load(str(lone), str(tmp_path / "refused.npz"), 1)
    assert refused.returncode != 0
    assert "SplitCheckpointError" in refused.stderr, refused.stderr[-3000:]
    assert f"lacks 1 file(s) written by rank(s) [{other[2]}]" in (
        refused.stderr
    )
    assert repr(other) in refused.stderr
    other_host = writers[other][1]
    assert f"on host(s) ['{other_host}']" in refused.stderr
    assert f"rsync -a {other_host}:{lone}/ {lone}/" in refused.stderr

    # Both copies merged: exactly the saved values, on 1 and on 3 processes.
    merged = tmp_path / "merged" / "ckpt"
    for copy in copies:
        shutil.copytree(copy, merged, dirs_exist_ok=True)
    saved = _values(saved_values)
    for n in (1, 3):
        loaded_values = tmp_path / f"loaded{n}.npz"
        result = _load(str(merged), str(loaded_values), n)
        assert result.returncode == 0, result.stderr[-3000:]
        loaded = _values(loaded_values)
        assert sorted(loaded) == sorted(saved)
        for key in saved:
            np.testing.assert_array_equal(loaded[key], saved[key], key)


def test_callbacks_keep_each_hosts_copy_complete_and_tidy(tmp_path):
    _two_hosts(
        tmp_path, "callbacks", tmp_path / "common" / "run", tmp_path / "v.npz"
    )
    for node in (0, 1):
        run = tmp_path / f"host{node}" / "run"
        assert sorted(os.listdir(run)) == ["backup", "sharded"]
        # max_to_keep=2 of 3 epochs (4 steps each), on every host.
        kept = sorted(os.listdir(run / "sharded"))
        assert kept == ["ckpt-000000008", "ckpt-000000012"], kept
        for path in [run / "sharded" / k for k in kept] + [
            run / "backup" / "latest.ckpt"
        ]:
            names = os.listdir(path)
            assert MARKER in names and ".metadata" in names, (path, names)
            assert len([n for n in names if n.endswith(".distcp")]) == 1
        assert os.listdir(run / "backup") == ["latest.ckpt"]
    # Resuming on the same hosts needs every host's files on each: refused
    # on both hosts, with the fix, rather than loading part of the values.
    for result in _two_hosts(
        tmp_path,
        "resume",
        tmp_path / "common" / "run",
        tmp_path / "r.npz",
        succeed=False,
    ):
        assert "SplitCheckpointError" in result.stderr, result.stderr[-3000:]
        assert "ckpt-000000012' holds only this host's part" in result.stderr
