"""Every wait of `initialize()` is bounded by KTD_TIMEOUT_SECONDS: two real
processes (subprocesses of a script) whose coordinator port is held by a
program that never answers, or closed, end in time, saying what to do.

What `initialize()` hands torch (mocked) is in unit/test_runtime.py.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from helpers import LAUNCHER_VARIABLES
from helpers import ROOT

# --------------------------------------------------------------------------
# Two processes: a coordinator port held by a program that never answers
# --------------------------------------------------------------------------


class _SilentPorts:
    """Ports held by programs that never answer: one accepts connections and
    stays silent, one listens and never accepts, one is closed."""

    def __enter__(self):
        self.sockets = {}
        for kind in ("accepts", "listens"):
            held = socket.socket()
            held.bind(("127.0.0.1", 0))
            held.listen(8)
            self.sockets[kind] = held
        self.accepted = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            ports = {"closed": closed.getsockname()[1]}
        ports.update(
            {kind: s.getsockname()[1] for kind, s in self.sockets.items()}
        )
        return ports

    def _accept(self):
        listener = self.sockets["accepts"]
        while True:
            try:
                self.accepted.append(listener.accept()[0])
            except OSError:  # __exit__ closed the listener: the test is over
                return

    def __exit__(self, *exc_info):
        for held in [*self.sockets.values(), *self.accepted]:
            held.close()
        self.thread.join(10)


_TRY_EACH_PORT = """
import json, sys, time
import keras, keras_torch_distribution

process_id, ports = int(sys.argv[1]), json.loads(sys.argv[2])
for kind, port in ports.items():
    start = time.monotonic()
    try:
        keras.distribution.initialize(
            job_addresses=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=process_id,
        )
        found = None
    except RuntimeError as error:
        found = str(error)
    print(
        "RESULT",
        json.dumps([kind, found, time.monotonic() - start]),
        flush=True,
    )
"""


@pytest.mark.slow
def test_initialize_ends_within_the_timeout_when_nothing_answers():
    """Process 0 cannot host the coordinator on a held port; process 1
    reaches something that never answers (or nothing at all): both end
    within KTD_TIMEOUT_SECONDS plus a margin, saying what to do."""
    timeout = 2
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        KTD_DEVICE="cpu",
        OMP_NUM_THREADS="1",
        KTD_TIMEOUT_SECONDS=str(timeout),
    )
    for key in LAUNCHER_VARIABLES:
        env.pop(key, None)
    with _SilentPorts() as ports:
        # Process 0 on the closed port would host a coordinator there.
        held = {kind: ports[kind] for kind in ("accepts", "listens")}
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    textwrap.dedent(_TRY_EACH_PORT),
                    str(process_id),
                    json.dumps(held if process_id == 0 else ports),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for process_id in (0, 1)
        ]
        try:
            outputs = [p.communicate(timeout=240) for p in processes]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    results = {}
    for process_id, (stdout, stderr) in enumerate(outputs):
        lines = [
            line for line in stdout.splitlines() if line.startswith("RESULT")
        ]
        assert len(lines) == (2 if process_id == 0 else 3), (
            stdout + stderr[-3000:]
        )
        for line in lines:
            kind, message, seconds = json.loads(line[len("RESULT") :])
            results[process_id, kind] = message, seconds
    for (process_id, kind), (message, seconds) in results.items():
        assert message is not None, (process_id, kind)
        assert seconds < timeout + 6, (process_id, kind, seconds)
        assert message.startswith(
            f"torch.distributed could not start process {process_id} of 2 at "
            f"tcp://127.0.0.1:{ports[kind]} within "
            f"KTD_TIMEOUT_SECONDS={timeout} s: "
        ), message
    for kind in ("accepts", "listens"):
        message, seconds = results[0, kind]
        assert seconds < timeout, seconds  # refused at once
        assert message.endswith(
            f"Another program holds port {ports[kind]} on this host, where "
            "process 0 hosts the coordinator. Give every process the same free "
            "port (job_addresses='host:PORT', or MASTER_PORT), or stop the "
            "program that holds it."
        ), message
        message, _ = results[1, kind]
        assert message.endswith(
            f"no torch.distributed store answered at 127.0.0.1:{ports[kind]}. "
            "Either process 0 has not started its coordinator there (start it, "
            "or raise KTD_TIMEOUT_SECONDS if it starts slowly), or another "
            "program holds that port and does not answer (process 0 then fails "
            "at once with 'address already in use'): give every process the "
            "same free port."
        ), message
    # Nothing listens: torch's own timeout, or ours if torch overruns it.
    message, _ = results[1, "closed"]
    assert "raise KTD_TIMEOUT_SECONDS if" in message, message
