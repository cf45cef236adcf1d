"""Every process agrees on seeds."""

import random

import torch
import torch.distributed as dist

from keras_torch_distribution import _keras


def initialize_rng(group=None):
    """Make every process use one global seed (agreed over `group`, the
    world's group for CPU tensors; default: the world group).

    When `keras.utils.set_random_seed` was not called, rank 0 draws a seed and
    broadcasts it, so unseeded initializers (whose default seeds come from
    Python's `random`) give the same values on every rank. Collective: call on
    every rank.
    """
    seed = _keras.get_random_seed()
    if dist.is_initialized() and dist.get_world_size() > 1:
        proposal = seed if seed is not None else random.randint(1, 2**31 - 1)
        box = [proposal]
        dist.broadcast_object_list(box, src=0, group=group)
        if seed is not None and box[0] != seed:
            raise ValueError(
                f"keras.utils.set_random_seed({seed}) on rank "
                f"{dist.get_rank()} but rank 0 set {box[0]}. Set the same "
                "seed on every process."
            )
        seed = box[0]
    elif seed is None:
        return
    _keras.set_random_seed(seed)
    torch.manual_seed(seed)
