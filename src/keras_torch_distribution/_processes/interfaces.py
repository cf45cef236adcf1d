"""The network interface gloo listens on, when the host name says loopback.

Gloo (torch's CPU backend, and the package's side group for CPU tensors on
CUDA runs) tells its peers to reach this process at the address its host
name resolves to. Debian and Ubuntu images write `127.0.1.1 <hostname>`
into /etc/hosts, and clusters without DNS for node names keep it: then
every host of a job gives the others a loopback address, and the job fails
after its timeout with `Gloo connectFullMesh failed ... Connection
refused, remote=[127.0.1.1]:PORT` (torchrun and Lightning leave it to the
user: GLOO_SOCKET_IFNAME).

`choose` runs in every process before the process group is made, on the
rendezvous store: each host's first process writes down the host (its name
and the address it reaches the coordinator from); a process whose host
name resolves to a loopback address (or to nothing: gloo then takes
loopback too) waits for every process to check in, and if the job spans
more than one host it sets GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME)
to the interface that reaches the coordinator (on the coordinator's own
host: that reaches the other hosts), logging it once per host; where no
interface does, it fails at once naming the host name, the address and the
setting. A set GLOO_SOCKET_IFNAME is the user's choice and is kept; so is
a job on one network stack (one host, or hosts of other names that all
reach the coordinator over loopback), where loopback is right.
"""

import ipaddress
import os
import socket

from keras_torch_distribution._log import logger

GLOO_VARIABLE = "GLOO_SOCKET_IFNAME"
NCCL_VARIABLE = "NCCL_SOCKET_IFNAME"
_PREFIX = "ktd/hosts/"
_ANY_PORT = 9  # (a UDP "connect" sends nothing; any port does)


def gloo_address(hostname):
    """The address gloo would give its peers for `hostname`: the first of
    its addresses that this process can bind, or None when none (gloo then
    takes the loopback address)."""
    try:
        found = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, _, _, address in found:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
        return address[0]
    return None


def is_loopback(address):
    return address is None or ipaddress.ip_address(address).is_loopback


def _usable(address):
    """True for an address other hosts could reach (not loopback)."""
    return bool(address) and not is_loopback(address)


def source_address(address):
    """The address of this host that packets to `address` leave from (the
    kernel's route; nothing is sent), or None when there is no route."""
    try:
        family = socket.getaddrinfo(address, None)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, _ANY_PORT))
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_of(address):
    """The name of this host's interface that holds `address`, or None."""
    wanted = ipaddress.ip_address(address)
    for name, held in _interface_addresses():
        if held == wanted:
            return name
    return None


def _interface_addresses():
    """(interface name, address) for every address of every interface."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(
                    probe.fileno(),
                    siocgifaddr,
                    struct.pack("256s", name.encode()[:15]),
                )
            except OSError:  # (no IPv4 address on this interface)
                continue
            yield name, ipaddress.ip_address(answer[20:24])
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                yield (
                    fields[5],
                    ipaddress.ip_address(
                        ":".join(fields[0][i : i + 4] for i in range(0, 32, 4))
                    ),
                )
    except FileNotFoundError:  # (no IPv6 here)
        return


def host_facts(coordinator_host):
    """(host name, an address other hosts reach it at, whether it is the
    coordinator's host) of this process, for messages about lost hosts."""
    hostname = socket.gethostname()
    coordinator = _resolve(coordinator_host)
    source = source_address(coordinator) if coordinator else None
    chosen = os.environ.get(GLOO_VARIABLE, "").split(",")[0]
    address = next(
        (str(a) for name, a in _interface_addresses() if name == chosen),
        None,
    )
    if not _usable(address):
        address = source if _usable(source) else gloo_address(hostname)
    on_coordinator = not _usable(source) or source == coordinator
    return hostname, address, on_coordinator


def choose(store, rank, world_size, coordinator_host, environ=os.environ):
    """Check in on the rendezvous store and, for a host whose name resolves
    to loopback in a job that spans hosts, set GLOO_SOCKET_IFNAME (and
    NCCL_SOCKET_IFNAME) in `environ` (see the module's docstring).
    Collective over the store: every rank calls it before the process
    group is made. Returns the interface chosen, or None."""
    hostname = socket.gethostname()
    advertised = gloo_address(hostname)
    coordinator = _resolve(coordinator_host)
    source = source_address(coordinator) if coordinator else None
    host = f"{hostname} {source or ''}"
    first_on_host = store.add(f"{_PREFIX}seen/{host}", 1) == 1
    if first_on_host:
        index = store.add(f"{_PREFIX}count", 1) - 1
        store.set(f"{_PREFIX}host/{index}", host)
    if store.add(f"{_PREFIX}arrived", 1) == world_size:
        store.set(f"{_PREFIX}all", "1")
    if GLOO_VARIABLE in environ or not is_loopback(advertised):
        return None
    store.wait([f"{_PREFIX}all"])
    count = store.add(f"{_PREFIX}count", 0)
    hosts = [
        store.get(f"{_PREFIX}host/{index}").decode().split(" ", 1)
        for index in range(count)
    ]
    others = [(name, address) for name, address in hosts if name != hostname]
    if not others:  # (two hosts of one name: told apart by their address)
        others = [(n, a) for n, a in hosts if f"{n} {a}" != host]
    if len(hosts) == 1 or not any(_usable(a) for _, a in hosts):
        # One host, or hosts of other names that all reach the coordinator
        # over loopback (one network stack: containers of one machine):
        # loopback is right.
        return None
    targets = [coordinator] + [address for _, address in others]
    for target in targets:
        leaves_from = source_address(target) if _usable(target) else None
        if not _usable(leaves_from):
            continue
        interface = interface_of(leaves_from)
        if interface is None:
            continue
        environ[GLOO_VARIABLE] = interface
        environ.setdefault(NCCL_VARIABLE, interface)
        if first_on_host:
            logger.warning(
                "host %s: its name resolves to %s, a loopback address, in a "
                "job across %d hosts (%s): gloo would give the other hosts "
                "that address to reach this one. Using interface %s (%s, "
                "which reaches %s) instead: %s=%s, %s=%s. Set %s yourself to "
                "choose another, or make the host name resolve to the "
                "host's address (DNS or /etc/hosts).",
                hostname,
                advertised or "nothing (gloo then uses 127.0.0.1)",
                len(hosts),
                ", ".join(sorted({name for name, _ in hosts})),
                interface,
                leaves_from,
                target,
                GLOO_VARIABLE,
                interface,
                NCCL_VARIABLE,
                environ[NCCL_VARIABLE],
                GLOO_VARIABLE,
                extra={"ktd_every_rank": True},
            )
        return interface
    raise RuntimeError(
        f"rank {rank}: this host's name {hostname!r} resolves to "
        f"{advertised or 'no address'} (loopback), which gloo would give "
        f"the other hosts of this job ({', '.join(n for n, _ in others)}) to "
        "reach this process, and no interface of this host reaches the "
        f"coordinator {coordinator_host} ({coordinator}) or another host "
        "from an address they could use. Set GLOO_SOCKET_IFNAME (and "
        "NCCL_SOCKET_IFNAME on GPUs) to the interface on the hosts' "
        "network on every host, e.g. GLOO_SOCKET_IFNAME=eth0 (`ip -brief "
        "address` lists them), or make the host name resolve to the host's "
        "address (DNS, or its line in /etc/hosts)."
    )


def _resolve(host):
    """An address for `host`, or None when it does not resolve."""
    if not host:
        return None
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except (socket.gaierror, UnicodeError):
        return None
