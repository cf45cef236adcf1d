"""A script's own collectives, which the simulated world cannot answer.

The plan runs rank 0 alone over torch's fake process group, whose
collectives return at once and move nothing: an all-reduce leaves rank 0's
tensor as it was, an all-gather of objects gives rank 0's object for every
rank, a broadcast of objects from another rank fails inside torch with a
nonsensical allocation. Within the plan's own machinery (this package's
initialize, FSDP, the training step, DTensor's redistributions) that is
what the plan wants: the values are meaningless, the calls are counted.
But a script that calls such a collective itself and goes on with its
result (a vocabulary size agreed by an all-gather, a config broadcast from
rank 1, a loss averaged by hand) would run on with a silently wrong value.

`refusing(script)` wraps, for the block, the collectives of
`torch.distributed` whose result on rank 0 depends on the other ranks
(`NEEDS_PEERS`, and the rooted ones of `ROOTED` where the root is not
rank 0, or where rank 0 is the root of a gather or reduce). Called from the
script's code (the calling frame's file lies outside torch, Keras and this
package) outside a fit, one raises `NeedsPeers`, whose message names the
caller's file and line, the collective and the fix: skip it while planning
(`keras_torch_distribution.plan.is_planning()`), or measure with a real
launch. Collectives that leave rank 0's values as on N ranks pass
(`barrier`, `send`, a broadcast or scatter from rank 0, a gather to
another rank), and so does everything inside a fit (`allowing()`): the
simulated step's values are meaningless anyway, and its collectives are
counted.
"""

import contextlib
import functools
import inspect
import os
import sys

import keras
import torch
import torch.distributed as dist

import keras_torch_distribution

# Collectives whose result on every rank depends on the other ranks'.
NEEDS_PEERS = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "recv",
    "irecv",
    "recv_object_list",
    "batch_isend_irecv",
)
# Rooted collectives: name -> (the root's argument, its group-rank
# argument, True where the root receives from the others (a gather or
# reduce: rank 0 needs peers when it is the root), False where it sends to
# them (a broadcast or scatter: rank 0 needs peers when it is not)).
ROOTED = {
    "gather": ("dst", "group_dst", True),
    "gather_object": ("dst", "group_dst", True),
    "reduce": ("dst", "group_dst", True),
    "broadcast": ("src", "group_src", False),
    "broadcast_object_list": ("src", "group_src", False),
    "scatter": ("src", "group_src", False),
    "scatter_object_list": ("src", "group_src", False),
}

# Files under these folders are the plan's machinery, not the script's.
_LIBRARIES = tuple(
    os.path.dirname(os.path.realpath(module.__file__)) + os.sep
    for module in (torch, keras, keras_torch_distribution)
)


class NeedsPeers(BaseException):
    """The script called a collective whose result needs real peers (a
    BaseException, so that a script's own `except Exception` does not
    swallow it; `_runner` reports it as a plan error)."""


class _State:
    allowed = 0  # > 0 inside a fit (`allowing`)


_state = _State()


@contextlib.contextmanager
def allowing():
    """Within the block (a fit's simulated step), the script's own
    collectives run over the fake group, counted like the step's."""
    _state.allowed += 1
    try:
        yield
    finally:
        _state.allowed -= 1


@contextlib.contextmanager
def refusing(script):
    """Within the block, a collective of `torch.distributed` that needs real
    peers, called from the code of `script` (or of a module outside torch,
    Keras and this package) outside a fit, raises `NeedsPeers`."""
    script = os.path.realpath(script)
    names = NEEDS_PEERS + tuple(ROOTED)
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, original in saved.items():
        setattr(dist, name, _refused(name, original, script))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _refused(name, original, script):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        caller = sys._getframe(1)
        if (
            not _state.allowed
            and not _is_library(caller.f_code.co_filename)
            and _needs_peers(name, signature.bind(*args, **kwargs).arguments)
        ):
            raise NeedsPeers(_message(name, caller, script))
        return original(*args, **kwargs)

    return collective


def _is_library(filename):
    return os.path.realpath(filename).startswith(_LIBRARIES)


def _needs_peers(name, arguments):
    """True if rank 0's result of collective `name` called with
    `arguments` depends on the other ranks."""
    if name not in ROOTED:
        return True
    root_name, group_root_name, root_receives = ROOTED[name]
    group = arguments.get("group")
    if group is not None and dist.get_rank(group) < 0:
        return False  # rank 0 is not in the group: the call passes it by
    if arguments.get(group_root_name) is not None:
        is_root = arguments[group_root_name] == dist.get_rank(group)
    else:  # a global rank; torch's default root is rank 0
        is_root = (arguments.get(root_name) or 0) == dist.get_rank()
    return is_root if root_receives else not is_root


def _where(frame):
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _message(name, caller, script):
    where = _where(caller)
    if os.path.realpath(caller.f_code.co_filename) != script:
        outer = caller.f_back
        while outer is not None:
            if os.path.realpath(outer.f_code.co_filename) == script:
                where += f" (called from {_where(outer)})"
                break
            outer = outer.f_back
    return (
        f"ktd plan: {where} calls torch.distributed.{name}, whose result on "
        "rank 0 depends on the other ranks; the plan runs rank 0 alone over "
        "a fake process group whose collectives move nothing, so the script "
        "would go on with a value no real run gives. Skip the call while "
        "planning (`from keras_torch_distribution.plan import is_planning`; "
        f"`if not is_planning(): torch.distributed.{name}(...)`, rank 0 "
        "keeping its own value), or measure the script in a real run "
        "(`ktd run` / torchrun) instead of planning it."
    )
