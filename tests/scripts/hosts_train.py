"""Train one small model under each distribution; rank 0 saves the numbers.

    python hosts_train.py OUT.npz            # one process, no distribution
    ktd run ... hosts_train.py OUT.npz       # every rank of a launch

Run by tests/hosts/test_hosts.py on hosts of their own (network
namespaces): under `ktd run` on 2 hosts x 2 processes it trains with
DataParallel, ModelParallel on a 2 x 2 ("batch", "model") mesh, and FSDP
(the same layout map on a 1-D mesh, whose one axis is the batch's); each
must give the numbers of one process without a distribution. Rank 0
writes OUT.npz: per distribution, the losses and the final weights; each
rank prints its host name and rank.
"""

import os
import socket
import sys

# tests/, for `helpers` (this script's own folder is what Python adds).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_torch_distribution  # noqa: E402,F401
from helpers import FEATURES  # noqa: E402
from helpers import OUTPUTS  # noqa: E402
from helpers import data  # noqa: E402
from helpers import set_distribution  # noqa: E402


def train():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(OUTPUTS, name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    x, y = data(rows=64, features=FEATURES, outputs=OUTPUTS)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    weights = [np.asarray(w) for w in model.get_weights()]
    return np.asarray(history.history["loss"]), weights


def main():
    out = sys.argv[1]
    launched = "RANK" in os.environ
    if launched:
        keras.distribution.initialize()
    rank = keras_torch_distribution.process_id()
    print(f"host={socket.gethostname()} rank={rank}", flush=True)
    results = {}
    for kind in ("dp", "hybrid", "mp") if launched else (None,):
        set_distribution(kind)
        losses, weights = train()
        results[f"{kind}/losses"] = losses
        for i, w in enumerate(weights):
            results[f"{kind}/weight{i}"] = w
    if rank == 0:
        np.savez(out, **results)


if __name__ == "__main__":
    main()
