"""Variables allocated, never initialised, while planning.

Keras' initialisers are what cost a plan its time and memory: an 8 B
model's random draws take minutes, and every drawn page is resident. In
`unmaterialised()` every variable is created through the installed
born-sharded path with an initialiser that allocates its block with
`torch.empty` and writes nothing: rank 0's shards exist, with their real
shapes, dtypes and layouts, but the pages nobody writes cost no resident
memory. Values are garbage; the plan reads only their sizes (and a
simulated step computes on them: its collectives are counted, its
numbers meaningless).

The initialiser is a `Constant`, so that copies of a variable are not
broadcast at creation (`_variables.copies`): there is nothing to make equal.
"""

import contextlib

import keras
import torch

from keras_torch_distribution import _keras
from keras_torch_distribution._variables import sharded_init


class Unwritten(keras.initializers.Constant):
    """An initialiser that allocates and writes nothing (plans only)."""

    def __call__(self, shape, dtype=None):
        return _empty(shape, dtype)


_UNWRITTEN = Unwritten()


def _empty(shape, dtype):
    torch_dtype = _keras.to_torch_dtype(dtype or "float32")
    return torch.empty(
        tuple(int(n) for n in shape),
        dtype=torch_dtype,
        device=_keras.torch_device(),
    )


@contextlib.contextmanager
def unmaterialised():
    """Within the block, variables are born as unwritten blocks."""
    block = sharded_init.init_block

    def initialize_with_initializer(variable, initializer):
        return installed(variable, _UNWRITTEN)

    installed = _keras.swap_variable_initializer_call(
        initialize_with_initializer
    )

    def init_block(initializer, shape, dtype, box, path):
        if isinstance(initializer, Unwritten):
            return _empty([hi - lo for lo, hi in box], dtype)
        return block(initializer, shape, dtype, box, path)

    sharded_init.init_block = init_block
    try:
        yield
    finally:
        _keras.swap_variable_initializer_call(installed)
        sharded_init.init_block = block
