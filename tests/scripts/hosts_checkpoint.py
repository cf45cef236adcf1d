"""Save or load a sharded checkpoint, for tests where the ranks' hosts may
not share the checkpoint's folder (tests/e2e/test_checkpoint_hosts.py runs
each "host" in a mount namespace of its own).

    ktd run ... tests/scripts/hosts_checkpoint.py save CKPT VALUES.npz
    ktd run ... tests/scripts/hosts_checkpoint.py load CKPT VALUES.npz
    ktd run ... tests/scripts/hosts_checkpoint.py callbacks DIR VALUES.npz
    ktd run ... tests/scripts/hosts_checkpoint.py resume DIR VALUES.npz

`save` trains the checkpoint test model (tests/helpers.py) for 2 epochs
under ModelParallel over every process (its kernels sharded), saves it to
CKPT with `checkpoint.save` and writes every saved value (global, as a
checkpoint key -> array) to VALUES.npz from rank 0. `load` builds the same
model under ModelParallel over its own processes (none in one process),
loads CKPT and writes the loaded values the same way. `callbacks` fits 3
epochs with `ShardedCheckpoint(DIR/sharded, max_to_keep=2)` and
`BackupAndRestore(DIR/backup, delete_checkpoint=False)` and writes the
final values; `resume` fits on from the newest checkpoint of
DIR/sharded (`restore=True`). Rank 0 prints `saved N values` or
`loaded N values`.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution  # noqa: E402, F401
from helpers import SAVE_RULES  # noqa: E402
from helpers import checkpoint_data  # noqa: E402
from helpers import checkpoint_model  # noqa: E402
from helpers import checkpoint_values  # noqa: E402
from helpers import distribute  # noqa: E402
from keras_torch_distribution import checkpoint  # noqa: E402
from keras_torch_distribution._processes import runtime  # noqa: E402

mode, path, values_path = sys.argv[1:4]
keras.distribution.initialize()
distribute(SAVE_RULES if runtime.num_processes() > 1 else None)
model = checkpoint_model()
x, y = checkpoint_data()
if mode == "save":
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    checkpoint.save(model, path, extra={"epoch": 2})
elif mode == "load":
    extra = checkpoint.load(model, path)
    assert extra == {"epoch": 2}, extra
elif mode == "callbacks":
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[
            checkpoint.ShardedCheckpoint(
                os.path.join(path, "sharded"), max_to_keep=2
            ),
            keras.callbacks.BackupAndRestore(
                os.path.join(path, "backup"), delete_checkpoint=False
            ),
        ],
    )
elif mode == "resume":
    callback = checkpoint.ShardedCheckpoint(
        os.path.join(path, "sharded"), restore=True
    )
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[callback])
else:
    raise SystemExit(f"mode {mode!r}: expected save, load, callbacks or resume")
values = checkpoint_values(model)
if runtime.process_id() == 0:
    np.savez(values_path, **values)
    verb = "loaded" if mode == "load" else "saved"
    print(f"{verb} {len(values)} values", flush=True)
