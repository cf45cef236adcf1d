"""Rank 1 raises, then is slow to exit; rank 0 fails only once rank 1 is
exiting, so torchrun stops rank 1 (SIGTERM) before it has exited by itself:
issue 49's race made certain. The summary must still name rank 1 and the
exit code it chose. `rank_stopped_while_exiting.py MARKER`: the file rank 1
creates when it starts exiting.
"""

import atexit
import os
import sys
import time

RANK = int(os.environ["RANK"])
MARKER = sys.argv[1]

if RANK == 1:

    def exit_slowly():
        open(MARKER, "w").close()
        time.sleep(300)  # torchrun stops this process here

    atexit.register(exit_slowly)
    raise RuntimeError("deliberate failure on rank 1")

deadline = time.monotonic() + 120
while not os.path.exists(MARKER):  # wait for what comes: rank 1 exiting
    if time.monotonic() > deadline:
        raise SystemExit("rank 1 never started exiting")
    time.sleep(0.05)
raise RuntimeError("rank 0 gives up after rank 1")
