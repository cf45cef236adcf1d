"""One worker of the 2-process torchrun job of
tests/e2e/test_checkpoint_process_exit.py:

    python -m torch.distributed.run ... resume_fit.py BACKUP_DIR OUT ATTEMPT

fits with BackupAndRestore(BACKUP_DIR) (helpers.resume_fit); in attempt 0
rank 1 kills itself after epoch 2; rank 0 records OUT/attemptN.npz / .json.
"""

import os
import sys

# tests/, for `helpers` (this script's own folder is what Python adds).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401
from helpers import resume_fit  # noqa: E402

keras.distribution.initialize()
backup_dir, out, attempt = sys.argv[1:]
resume_fit(
    backup_dir, os.path.join(out, f"attempt{attempt}"), kill=attempt == "0"
)
