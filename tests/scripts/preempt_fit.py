"""One worker of the 2-process jobs of tests/e2e/test_preemption_restarts.py:

    ktd run -n 2 [--max-restarts 1] preempt_fit.py OUT HOW STEP [SAVE_FREQ]
    PREEMPT_SPAWN=1 KTD_MAX_RESTARTS=1 python preempt_fit.py OUT HOW STEP

runs helpers.preempt_fit(OUT, attempt, HOW, STEP): the attempt is
PREEMPT_ATTEMPT when set (a launch by hand), else torchrun's restart count.
With PREEMPT_SPAWN=1, `initialize(num_processes=2)` starts the 2 processes
itself (through torch's elastic agent, restarting them KTD_MAX_RESTARTS
times).
"""

import os
import sys

# tests/, for `helpers` (this script's own folder is what Python adds).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401
from helpers import preempt_fit  # noqa: E402

if os.environ.get("PREEMPT_SPAWN") == "1":
    keras.distribution.initialize(num_processes=2)
else:
    keras.distribution.initialize()
out, how, step = sys.argv[1:4]
save_freq = int(sys.argv[4]) if len(sys.argv) > 4 else "epoch"
attempt = int(
    os.environ.get("PREEMPT_ATTEMPT")
    or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
)
preempt_fit(out, attempt, how, int(step), save_freq=save_freq)
