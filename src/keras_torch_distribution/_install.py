"""The top layer: install / uninstall / is_installed, and the exit hook.

Only `__init__.py` imports this module. It applies the patch table
(`_patches`): it checks that every target exists before changing anything,
keeps the originals, and `uninstall()` puts everything back and clears
every cache.
"""

import atexit
import gc
import warnings

import keras

from keras_torch_distribution import _keras
from keras_torch_distribution import _saving
from keras_torch_distribution._batch import position
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import sharding_rules
from keras_torch_distribution._distributed import stored_values
from keras_torch_distribution._fsdp import flat_shards
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._fsdp import groups
from keras_torch_distribution._patches import _patch_table
from keras_torch_distribution._processes import join
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._training import boundary
from keras_torch_distribution._training import compiled
from keras_torch_distribution._training import gradients
from keras_torch_distribution._training import metric_states
from keras_torch_distribution._training import optimizer_update
from keras_torch_distribution._training import regions
from keras_torch_distribution._training import replica_start
from keras_torch_distribution._variables import born_sharded
from keras_torch_distribution._variables import copies
from keras_torch_distribution.checkpoint import _dcp

_MISSING = object()
_installed = []


def _bind(patch):
    if not patch.wrap:
        return patch.replacement
    original, replacement = patch.original, patch.replacement

    def patched(*args, **kwargs):
        return replacement(original, *args, **kwargs)

    patched.__name__ = getattr(original, "__name__", patch.name)
    patched.__doc__ = getattr(original, "__doc__", None)
    patched.__wrapped__ = original
    return patched


def install():
    """Install the torch distribution backend into Keras. Idempotent.

    In this order: check Keras; check every patch target; replace them;
    let plain tensors meet DTensors as replicated values; register the
    DTensor sharding rules torch lacks.
    """
    if _installed:
        return
    _keras.check_environment()
    table = _patch_table()
    missing = [p.describe() for p in table if not hasattr(p.owner, p.name)]
    if missing:
        raise ImportError(
            "keras_torch_distribution cannot install into keras "
            f"{keras.__version__}: these internals are missing: {missing} "
            f"(expected in keras{_keras.SUPPORTED_KERAS_TEXT}, tested with "
            f"{_keras.TESTED_KERAS_TEXT}). Install one of those: "
            f"pip install 'keras{_keras.SUPPORTED_KERAS_TEXT}'."
        )
    if _keras.newer_keras():
        _warn_newer_keras(len(table))
    for patch in table:
        patch.original = patch.owner.__dict__.get(patch.name, _MISSING)
        patch.inherited = patch.original is _MISSING
        if patch.inherited:
            patch.original = getattr(patch.owner, patch.name)
    for patch in table:
        setattr(patch.owner, patch.name, _bind(patch))
        _installed.append(patch)
    born_sharded.enable_implicit_replication()
    sharding_rules.register()
    if not _exit_registered:
        # Registered at import, before the application's own hooks: those
        # run first (atexit runs newest first) and may still use the group.
        atexit.register(exit_sequence)
        _exit_registered.append(True)


_exit_registered = []


def _warn_newer_keras(patch_count):
    """Warn once per process that Keras is newer than any this package was
    tested with, saying what was checked."""
    if _warned_newer:
        return
    _warned_newer.append(True)
    checked = "; ".join(_keras.differences())
    warnings.warn(
        f"keras_torch_distribution was tested with keras"
        f"{_keras.SUPPORTED_KERAS_TEXT} ({_keras.TESTED_KERAS_TEXT}), but "
        f"keras {keras.__version__} is installed. It checked that all "
        f"{patch_count} Keras internals it replaces exist, and found: "
        f"{checked}. It installed; if results differ from one process, "
        f"install a tested version: pip install "
        f"'keras{_keras.SUPPORTED_KERAS_TEXT}'.",
        stacklevel=3,
    )


_warned_newer = []


def exit_sequence():
    """The package's one exit hook, in this order, while the interpreter is
    still whole:

    1. async saves never completed with `result()` are completed (they need
       the process group);
    2. the process group this package started is destroyed, with every
       group torch made on it (a group the application started is left to
       it);
    3. every reference the package holds to process groups, meshes and
       gradient hooks is dropped, and garbage is collected, so that torch's
       native objects (gloo contexts and their threads, stores) are
       destroyed now. Left for interpreter finalization, a native thread
       that needs the interpreter then aborts the process after the script
       succeeded ("terminate called without an active exception").

    Collective: every rank exits through it.
    """
    _dcp.complete_at_exit()
    join.shutdown()
    if not runtime.is_initialized():  # the meshes' groups are dead now
        layouts.torch_meshes.release_process_groups()
    _dcp.forget_process_groups()
    for state in _state_objects():
        state.clear()
    gc.collect()


def uninstall():
    """Put back every original Keras attribute `install()` replaced, take
    out the DTensor rules and gradient hooks, and clear every cache."""
    if not _installed:
        return
    while _installed:
        patch = _installed.pop()
        if patch.inherited:
            delattr(patch.owner, patch.name)
        else:
            setattr(patch.owner, patch.name, patch.original)
    for state in _state_objects():
        state.clear()


def _state_objects():
    """Every object that keeps state between calls, in the order
    `uninstall()` clears them: the DTensor rules and implicit replication
    first (torch goes back to its own behaviour), then gradient hooks and
    per-model caches, then the mesh caches they were built on."""
    return (
        sharding_rules.registration,  # torch's own rules and handlers back
        # implicit replication off; no sharded variables seen
        born_sharded.state,
        stored_values.reads,  # bytes read from weights files
        _saving.archive_loads,  # .keras archives being loaded
        # overlapped reducers and their gradient hooks
        gradients.optimizer_sync,
        metric_states.state,  # models whose metric states fold, the last sum
        compiled.compiled_forwards,
        regions.compiled_blocks_state,
        optimizer_update.updates,
        boundary.active_forward,
        gathering.state,
        groups.state,
        flat_shards.streams,
        replica_start.equalized,
        copies.pending,
        replicas.batch_weight,
        position.state,
        replicas.cache,
        layouts.torch_meshes,
    )


def is_installed():
    return bool(_installed)
