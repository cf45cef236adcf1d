"""A script that never imports Keras (nor torch): each rank prints what is
imported when it starts, then exits, or sleeps with `sleep` (stopped by
Ctrl-C). tests/e2e/test_habits.py runs it under `ktd run`."""

import os
import sys
import time

heavy = [
    m
    for m in ("torch", "keras", "keras_torch_distribution")
    if m in sys.modules
]
print("ready", os.environ["RANK"], os.getpid(), "imported", heavy, flush=True)
if sys.argv[1:] == ["sleep"]:
    time.sleep(300)
