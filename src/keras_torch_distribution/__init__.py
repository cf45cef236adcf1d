"""keras.distribution on the PyTorch backend of Keras.

`import keras_torch_distribution` (after or before `import keras`, with
KERAS_BACKEND=torch) installs the torch distribution backend into Keras, so
that DeviceMesh, TensorLayout, LayoutMap, DataParallel, ModelParallel,
distribute_tensor, initialize and list_devices work as on JAX.
"""

import os

# Imported before Keras, this package makes Keras pick the torch backend
# (unless KERAS_BACKEND says otherwise, which `install()` then reports).
os.environ.setdefault("KERAS_BACKEND", "torch")

from keras_torch_distribution import callbacks  # noqa: E402
from keras_torch_distribution import checkpoint  # noqa: E402
from keras_torch_distribution._install import install  # noqa: E402
from keras_torch_distribution._install import is_installed  # noqa: E402
from keras_torch_distribution._install import uninstall  # noqa: E402
from keras_torch_distribution._keras import SUPPORTED_KERAS_TEXT  # noqa: E402
from keras_torch_distribution._log import rank_zero_print  # noqa: E402
from keras_torch_distribution._preemption import Preempted  # noqa: E402
from keras_torch_distribution._processes.join import initialize  # noqa: E402
from keras_torch_distribution._processes.runtime import num_processes  # noqa: E402
from keras_torch_distribution._processes.runtime import process_id  # noqa: E402
from keras_torch_distribution._report import report  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "Preempted",
    "SUPPORTED_KERAS_TEXT",
    "callbacks",
    "checkpoint",
    "initialize",
    "install",
    "is_installed",
    "num_processes",
    "process_id",
    "rank_zero_print",
    "report",
    "uninstall",
]

install()
