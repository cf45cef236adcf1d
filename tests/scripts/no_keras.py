"""A script that never imports Keras (nor torch): each rank prints what is
imported when it starts, then exits, or sleeps with `sleep` (stopped by
Ctrl-C). tests/e2e/test_habits.py runs it under `ktd run`."""

import os
import sys
import time

HEAVY = ("torch", "keras", "keras_torch_distribution")
heavy = [name for name in HEAVY if name in sys.modules]
# One write: the ranks share the pipe, and print() writes its parts apart.
sys.stdout.write(f"ready {os.environ['RANK']} {os.getpid()} imported {heavy}\n")
sys.stdout.flush()
if sys.argv[1:] == ["sleep"]:
    time.sleep(300)
