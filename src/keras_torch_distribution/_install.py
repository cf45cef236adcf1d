"""The top layer: install / uninstall / is_installed, and the exit hook.

Only `__init__.py` imports this module. It applies the patch table
(`_patches`): it checks that every target exists before changing anything,
keeps the originals, and `uninstall()` puts everything back and clears
every cache. Rows whose owners are in libraries on Keras (keras_hub) are
applied when the library's module is imported (`after_imports`), never
importing it.
"""

import atexit
import gc
import importlib.abc
import sys
import warnings

import keras

from keras_torch_distribution import _keras
from keras_torch_distribution import _saving
from keras_torch_distribution._backend import float8 as backend_float8
from keras_torch_distribution._batch import position
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import sharding_rules
from keras_torch_distribution._distributed import stored_values
from keras_torch_distribution._fsdp import flat_shards
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._fsdp import groups
from keras_torch_distribution._patches import _patch_table
from keras_torch_distribution._patches import after_import
from keras_torch_distribution._processes import join
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._training import boundary
from keras_torch_distribution._training import compiled
from keras_torch_distribution._training import gradients
from keras_torch_distribution._training import metric_states
from keras_torch_distribution._training import optimizer_update
from keras_torch_distribution._training import reductions
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
    _apply(table)
    born_sharded.enable_implicit_replication()
    sharding_rules.register()
    after_imports.watch(after_import())
    if not _exit_registered:
        # Registered at import, before the application's own hooks: those
        # run first (atexit runs newest first) and may still use the group.
        atexit.register(exit_sequence)
        _exit_registered.append(True)


_exit_registered = []


def _apply(table):
    for patch in table:
        patch.original = patch.owner.__dict__.get(patch.name, _MISSING)
        patch.inherited = patch.original is _MISSING
        if patch.inherited:
            patch.original = getattr(patch.owner, patch.name)
    for patch in table:
        setattr(patch.owner, patch.name, _bind(patch))
        _installed.append(patch)


class AfterImports(importlib.abc.MetaPathFinder):
    """The patch table's rows for modules of libraries on Keras
    (`_patches.after_import`), applied when such a module is imported: at
    `install()` where it already is, else by this finder, first on
    `sys.meta_path` while rows wait, which lets the other finders find the
    module and applies its rows once it has run. The package never imports
    these modules."""

    def __init__(self):
        self.waiting = {}  # module name -> function of it giving rows

    def watch(self, rows_by_module):
        for name, rows in rows_by_module.items():
            if name in sys.modules:
                _apply_after_import(name, rows, sys.modules[name])
            else:
                self.waiting[name] = rows
        if self.waiting and self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def clear(self):
        self.waiting.clear()
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = (
                None
                if finder is self or find is None
                else find(name, path, target)
            )
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenPatch(spec.loader, self._imported)
        return spec

    def _imported(self, module):
        rows = self.waiting.pop(module.__name__, None)
        if not self.waiting:
            self.clear()
        if rows is not None and _installed:
            _apply_after_import(module.__name__, rows, module)


class _ThenPatch(importlib.abc.Loader):
    """A module's own loader, then the patch table's rows for it; the
    module keeps its own loader."""

    def __init__(self, loader, then):
        self._loader = loader
        self._then = then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _apply_after_import(name, rows, module):
    """Apply `rows(module)`; where the library no longer has what they
    replace, warn and leave it as it is (its own behaviour, as without the
    package)."""
    try:
        table = rows(module)
        missing = [p.describe() for p in table if not hasattr(p.owner, p.name)]
    except AttributeError as error:
        missing = [str(error)]
    if missing:
        warnings.warn(
            f"keras_torch_distribution cannot find {missing} in {name}, "
            "which it replaces to load that library's files shard by shard; "
            "they load as the library loads them (every rank reads whole "
            "tensors). Install the versions the package was tested with "
            "(keras-hub 0.32).",
            stacklevel=2,
        )
        return
    _apply(table)


after_imports = AfterImports()


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
        _saving.sharded_ports,  # keras_hub ports into sharded variables
        _saving.loader_paths,  # the safetensors file keras_hub opens next
        after_imports,  # rows waiting for their library's import
        # overlapped reducers and their gradient hooks
        gradients.optimizer_sync,
        reductions.state,  # whether the step in progress shares its loss
        backend_float8.probes,  # where torch._scaled_mm runs
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
