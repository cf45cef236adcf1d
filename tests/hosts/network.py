"""Hosts of their own on this machine: Linux network namespaces.

`Hosts(n)` makes n hosts, each a network namespace with one interface,
`eth1`, on a bridge that lives in a namespace of its own (the switch), an
address of a private subnet (10.123.X.0/24, which exists only inside these
namespaces), and a host name, `node-h1` ... `node-hN`, set in a UTS
namespace of each process started there and written in the host's own
/etc/hosts (`ip netns exec` binds /etc/netns/NAME/hosts over /etc/hosts):

- `names="own"`: every name resolves to its host's address on every host
  (DNS or a complete /etc/hosts);
- `names="loopback"`: each host's own name resolves to 127.0.1.1, as
  Debian and Ubuntu images write it, the others' to their addresses.

`Hosts(n, own_folder=PATH)`: PATH is a folder of each host's own disk (no
shared filesystem): host i's processes see PATH + ".host<i+1>" there,
bound in their mount namespace.

`run(i, argv)` starts a process on host i (in a session of its own);
`cut(i)` takes host i's link down (a partition: no packet in or out, no
connection reset); `close()` kills every process left in the namespaces
and removes the namespaces, the bridge, the links and the /etc/netns
folders, also after a failure. Making hosts needs root and `ip` (and
`unshare`); `unavailable()` says why they cannot be made here, or None.
"""

import os
import secrets
import shutil
import signal
import subprocess
import time

HOST_NAME = "node-h{}"
INTERFACE = "eth1"
_NETNS_ETC = "/etc/netns"


def unavailable():
    """Why hosts cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"ktdprobe{secrets.token_hex(3)}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, count, names="own", own_folder=None):
        if names not in ("own", "loopback"):
            raise ValueError(f"names={names!r}: expected 'own' or 'loopback'")
        self.count = count
        self.names = names
        self.own_folder = own_folder
        tag = secrets.token_hex(3)
        self._switch = f"ktd{tag}-sw"
        self._namespaces = [f"ktd{tag}-h{i + 1}" for i in range(count)]
        self._ports = [f"k{tag}p{i + 1}" for i in range(count)]
        subnet = 1 + secrets.randbelow(250)
        self.addresses = [f"10.123.{subnet}.{i + 1}" for i in range(count)]
        self.hostnames = [HOST_NAME.format(i + 1) for i in range(count)]
        self._processes = []
        self._made = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self):
        _ip("netns", "add", self._switch)
        self._made.append(self._switch)
        _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._switch, "link", "set", "br0", "up")
        for i, namespace in enumerate(self._namespaces):
            _ip("netns", "add", namespace)
            self._made.append(namespace)
            inside = self._ports[i].replace("p", "e", 1)
            _ip(
                "link",
                "add",
                inside,
                "type",
                "veth",
                "peer",
                "name",
                self._ports[i],
            )
            _ip("link", "set", self._ports[i], "netns", self._switch)
            _ip("link", "set", inside, "netns", namespace)
            _ip("-n", namespace, "link", "set", inside, "name", INTERFACE)
            _ip(
                "-n",
                namespace,
                "addr",
                "add",
                f"{self.addresses[i]}/24",
                "dev",
                INTERFACE,
            )
            _ip("-n", namespace, "link", "set", INTERFACE, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip(
                "-n",
                self._switch,
                "link",
                "set",
                self._ports[i],
                "master",
                "br0",
            )
            _ip("-n", self._switch, "link", "set", self._ports[i], "up")
            folder = os.path.join(_NETNS_ETC, namespace)
            os.makedirs(folder)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write(self._hosts_file(i))

    def _hosts_file(self, i):
        lines = ["127.0.0.1 localhost"]
        for j, (address, name) in enumerate(
            zip(self.addresses, self.hostnames)
        ):
            if j == i and self.names == "loopback":
                address = "127.0.1.1"
            lines.append(f"{address} {name}")
        return "\n".join(lines) + "\n"

    def folder_of(self, i):
        """Host i's own copy of `own_folder`, seen from outside."""
        return f"{self.own_folder}.host{i + 1}"

    def command(self, i, argv):
        """argv run on host i, under its host name."""
        start = 'hostname "$0" && exec "$@"'
        if self.own_folder is not None:
            own, seen = self.folder_of(i), self.own_folder
            os.makedirs(own, exist_ok=True)
            os.makedirs(seen, exist_ok=True)
            start = f"mount --bind '{own}' '{seen}' && {start}"
        return [
            "ip",
            "netns",
            "exec",
            self._namespaces[i],
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            start,
            self.hostnames[i],
            *argv,
        ]

    def run(self, i, argv, **popen):
        """Start argv on host i in a session of its own (a Popen)."""
        process = subprocess.Popen(
            self.command(i, argv), start_new_session=True, **popen
        )
        self._processes.append(process)
        return process

    def cut(self, i):
        """Take host i's link down: its packets go nowhere from now on."""
        _ip("-n", self._switch, "link", "set", self._ports[i], "down")

    def pids(self, i):
        listed = subprocess.run(
            ["ip", "netns", "pids", self._namespaces[i]],
            capture_output=True,
            text=True,
        )
        return [int(p) for p in listed.stdout.split()]

    def kill(self, i):
        """SIGKILL every process of host i (a host that dies)."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self):
        for process in self._processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for i, namespace in enumerate(self._namespaces):
            if namespace in self._made:
                self.kill(i)
        for process in self._processes:
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        for i, namespace in enumerate(self._namespaces):
            while self.pids(i) and time.monotonic() < deadline:
                time.sleep(0.1)
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "del", namespace], check=False)
        self._made = []
        for namespace in self._namespaces:
            shutil.rmtree(
                os.path.join(_NETNS_ETC, namespace), ignore_errors=True
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
