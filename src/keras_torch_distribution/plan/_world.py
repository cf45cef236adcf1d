"""The simulated world: this process as rank 0 of N, over torch's fake
process group (`torch.testing._internal.distributed.fake_pg`), whose
collectives return at once without moving data.

Only `ktd plan` starts it, inside `simulated()`, which destroys it on the
way out: a normal run never meets the fake group.
"""

import contextlib
import os

import torch.distributed as dist

from keras_torch_distribution._processes import join
from keras_torch_distribution._processes import rendezvous
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._processes import seeds


def check_world(world):
    """`world` as an int >= 1, or a ValueError that names it."""
    try:
        value = int(world)
    except (TypeError, ValueError):
        value = None
    if value is None or value < 1 or str(world).strip() != str(value):
        raise ValueError(
            f"--world {world!r} is not a number of processes: give a whole "
            "number >= 1, the world size to plan for (e.g. --world 8)."
        )
    return value


@contextlib.contextmanager
def simulated(world):
    """Within the block, this process is rank 0 of `world` processes on
    the CPU (KTD_DEVICE=cpu), over the fake process group."""
    world = check_world(world)
    if runtime.is_initialized():
        raise RuntimeError(
            "ktd plan: a torch.distributed process group already runs in "
            f"this process (world {dist.get_world_size()}); the plan needs "
            "a process of its own. Run `ktd plan` as its own command."
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = {k: os.environ.get(k) for k in ("KTD_DEVICE", "KERAS_BACKEND")}
    os.environ["KTD_DEVICE"] = "cpu"
    os.environ.setdefault("KERAS_BACKEND", "torch")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    rendezvous.started.group = dist.group.WORLD
    try:
        runtime.keep_keras_on_cpu()
        seeds.initialize_rng(runtime.cpu_group())
        yield world
    finally:
        join.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def is_simulated():
    """True while the running process group is the fake one."""
    return runtime.is_initialized() and dist.get_backend() == "fake"
