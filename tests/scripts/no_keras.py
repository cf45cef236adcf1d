"""A script that never imports Keras (nor torch): each rank prints what is
imported when it starts, then exits; or sleeps with `sleep` (stopped by
Ctrl-C); or with `exit DIR`, once every rank has left a file in DIR, calls
sys.exit(3). tests/e2e/test_habits.py runs it under `ktd run`."""

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
if sys.argv[1:2] == ["exit"]:
    folder = sys.argv[2]
    open(os.path.join(folder, os.environ["RANK"]), "w").close()
    while len(os.listdir(folder)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)  # every rank exits at the same point
    sys.exit(3)
