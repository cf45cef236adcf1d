"""The patch table: every Keras attribute the package replaces, and with
what (`_patch_table()`; the fast ops, `_fast_ops`; Keras 3.16's own
distribution turned off, `_native_distribution_off`; attributes of
libraries on Keras, applied when they are imported, `after_import`).

Every owner comes from `_keras/`; `_install` applies the table.
docs/architecture.md lists it (tests/unit/test_docs.py checks both ways).
"""

import functools

from keras_torch_distribution import _env
from keras_torch_distribution import _keras
from keras_torch_distribution import _saving
from keras_torch_distribution._backend import core as backend_core
from keras_torch_distribution._backend import distribution_lib
from keras_torch_distribution._backend import keras_ops
from keras_torch_distribution._backend import nn as backend_nn
from keras_torch_distribution._backend import numpy as backend_numpy
from keras_torch_distribution._batch import adapter
from keras_torch_distribution._batch import position
from keras_torch_distribution._batch import random_slices
from keras_torch_distribution._batch import sync_batch_norm
from keras_torch_distribution._distributed import masked_lookup
from keras_torch_distribution._fsdp import einsum_grad
from keras_torch_distribution._training import batch_logs
from keras_torch_distribution._training import boundary
from keras_torch_distribution._training import compiled
from keras_torch_distribution._training import float8
from keras_torch_distribution._training import optimizer_update
from keras_torch_distribution._training import quantized
from keras_torch_distribution._training import reductions
from keras_torch_distribution._training import regions
from keras_torch_distribution._training import remat
from keras_torch_distribution._training import replica_start
from keras_torch_distribution._training import trainer
from keras_torch_distribution._variables import born_sharded
from keras_torch_distribution.checkpoint import callbacks


class Patch:
    """Replace `owner.name` with `replacement`; `wrap=True` passes the
    original as the replacement's first argument."""

    def __init__(self, owner, name, replacement, wrap=False):
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.wrap = wrap
        self.original = None
        self.inherited = False

    def describe(self):
        owner = getattr(self.owner, "__qualname__", None) or getattr(
            self.owner, "__name__", repr(self.owner)
        )
        return f"{owner}.{self.name}"


def _quantized_calls(k):
    """Keras' float8 layers: one process's bias gradients under every
    distribution; float8 matrix products where the GPU has them. Keras'
    int8 layers under FSDP: the gathered kernel gathered again in
    backward, not kept by Keras' custom gradient.

    Keras 3.15 calls both through the layers' methods; 3.16 through the
    modes' strategies (`k.Float8Strategy`), where float8 is replaced and
    int8 keeps Keras' call (its numbers are one process's; under FSDP each
    int8 layer's gathered kernel then lives until its backward)."""
    if k.Float8Strategy is not None:
        return [
            Patch(k.Float8Strategy, "call", float8.strategy_call, wrap=True)
        ]
    return [
        Patch(k.Dense, "_float8_call", float8.layer_call, wrap=True),
        Patch(k.EinsumDense, "_float8_call", float8.layer_call, wrap=True),
        Patch(k.Dense, "_int8_call", quantized.dense_int8_call, wrap=True),
        Patch(
            k.EinsumDense,
            "_int8_call",
            quantized.einsum_dense_int8_call,
            wrap=True,
        ),
    ]


def _patch_table():
    """Every Keras attribute the package replaces, grouped by concern.

    Two changes sit outside this table, both undone by `uninstall()` too:
    `_distributed.sharding_rules.register()` adds DTensor rules to torch's
    own tables (`DTensor._op_dispatcher`; clearing
    `sharding_rules.registration` puts torch's back), and
    `_keras.initializers_drawing_from` swaps Keras' initializers' random
    module inside one `with` block while a sharded variable is initialised
    (`_variables.sharded_init`).
    """
    k = _keras
    fast = _env.fast_ops()
    return [
        # The backend module keras.distribution calls.
        Patch(k.keras_backend_module, "distribution_lib", distribution_lib),
        Patch(
            k.keras_distribution_module, "distribution_lib", distribution_lib
        ),
        # Variables: born sharded, gathered for use on the batch axis (FSDP),
        # reassigned in place, read as global values.
        Patch(
            k.TorchVariable, "_initialize", born_sharded.initialize, wrap=True
        ),
        Patch(
            k.TorchVariable,
            "_initialize_with_initializer",
            born_sharded.initialize_with_initializer,
            wrap=True,
        ),
        Patch(
            k.TorchVariable,
            "_direct_assign",
            born_sharded.direct_assign,
            wrap=True,
        ),
        Patch(
            k.TorchVariable,
            "_convert_to_tensor",
            born_sharded.convert_for_assign,
            wrap=True,
        ),
        Patch(
            k.TorchVariable,
            "_maybe_autocast",
            born_sharded.value_for_use,
            wrap=True,
        ),
        Patch(k.TorchVariable, "__array__", born_sharded.to_numpy, wrap=True),
        Patch(k.TorchVariable, "__repr__", born_sharded.describe, wrap=True),
        # Under FSDP, einsum keeps its operands for backward (gathered
        # kernels are then regathered), not copies of them (with the fast
        # ops, a matrix product where the equation is one, first).
        Patch(
            k.torch_numpy_module,
            "einsum",
            backend_numpy.einsum if fast else einsum_grad.einsum,
            wrap=True,
        ),
        *[
            Patch(owner, "convert_to_numpy", keras_ops.to_numpy, wrap=True)
            for owner in k.CONVERT_TO_NUMPY_OWNERS
        ],
        # In-place writes that meet DTensors (keras_hub's KV cache, samplers,
        # BatchNormalization's scaling by sharded parameters).
        Patch(
            k.torch_core_module,
            "slice_update",
            keras_ops.slice_update,
            wrap=True,
        ),
        Patch(
            k.torch_core_module,
            "scatter_update",
            keras_ops.scatter_update,
            wrap=True,
        ),
        Patch(
            k.torch_nn_module,
            "batch_normalization",
            keras_ops.batch_normalization,
            wrap=True,
        ),
        # The model boundary and jit_compile.
        Patch(
            k.torch_nn_module,
            "_can_use_flash_attention",
            compiled.can_use_flash_attention,
            wrap=True,
        ),
        Patch(k.Layer, "__call__", boundary.layer_call, wrap=True),
        # Rematerialization: the recompute replays the forward's layer calls
        # in the forward's Keras call context (inner calls, not outermost).
        *[
            Patch(owner, "remat", remat.remat, wrap=True)
            for owner in k.REMAT_OWNERS
        ],
        # RematScope("larger_than") decides on the global batch's output.
        Patch(
            k.Operation,
            "rematerialized_call",
            remat.rematerialized_call,
            wrap=True,
        ),
        # No Keras name scope while dynamo traces a compiled block.
        Patch(
            k.Layer,
            "_open_name_scope",
            regions.name_scope_while_compiling,
            wrap=True,
        ),
        Patch(k.Layer, "_get_own_losses", boundary.plain_losses, wrap=True),
        Patch(
            k.Layer,
            "_get_regularization_losses",
            boundary.plain_losses,
            wrap=True,
        ),
        # A mesh shaped for another number of devices says what to change.
        Patch(
            k.DeviceMesh,
            "__init__",
            distribution_lib.check_device_mesh,
            wrap=True,
        ),
        # Distributions check their batch axis and mesh when constructed.
        Patch(
            k.Distribution,
            "__init__",
            distribution_lib.check_distribution,
            wrap=True,
        ),
        # Step functions, one factory for train / test / predict: replicas
        # made equal before the first step, then Keras' step (the model call
        # compiled under jit_compile=True); predictions of every replica.
        *[
            Patch(
                k.TorchTrainer,
                f"make_{kind}_function",
                functools.partial(replica_start.make_step_function, kind),
                wrap=True,
            )
            for kind in compiled.STEP_KINDS
        ],
        # A replica's rows (and a sharded activation's columns) of the random
        # draws one process makes for the global batch.
        Patch(
            k.torch_random_module, "dropout", random_slices.dropout, wrap=True
        ),
        Patch(k.torch_random_module, "normal", random_slices.normal, wrap=True),
        Patch(
            k.torch_random_module, "uniform", random_slices.uniform, wrap=True
        ),
        Patch(
            k.torch_random_module, "randint", random_slices.randint, wrap=True
        ),
        *_quantized_calls(k),
        # Moments over the global batch (all replicas' rows).
        Patch(
            k.BatchNormalization, "_moments", sync_batch_norm.moments, wrap=True
        ),
        # Data: each replica its rows of the global batch.
        Patch(
            k.epoch_iterator_data_adapters,
            "get_data_adapter",
            adapter.get_data_adapter,
            wrap=True,
        ),
        # Training: gradients averaged over replicas, metrics summed, Adam in
        # place.
        Patch(k.BaseOptimizer, "apply", trainer.optimizer_apply, wrap=True),
        # LossScaleOptimizer judges the averaged gradients finite or not:
        # every rank skips or applies the same step.
        Patch(
            k.LossScaleOptimizer, "apply", trainer.optimizer_apply, wrap=True
        ),
        # The loss each replica backpropagates: its share of the global
        # batch's (the gradients are then summed).
        Patch(k.BaseOptimizer, "scale_loss", reductions.scale_loss, wrap=True),
        Patch(
            k.LossScaleOptimizer,
            "scale_loss",
            reductions.scale_loss,
            wrap=True,
        ),
        Patch(
            k.TorchAdam,
            "_parallel_update_step",
            optimizer_update.adam_update,
            wrap=True,
        ),
        Patch(k.Model, "get_metrics_result", trainer.metrics_result, wrap=True),
        Patch(k.Model, "fit", trainer.fit_evaluate_predict, wrap=True),
        Patch(k.Model, "evaluate", trainer.fit_evaluate_predict, wrap=True),
        Patch(k.Model, "predict", trainer.fit_evaluate_predict, wrap=True),
        # Files: Keras files from rank 0, sharded checkpoints for backups.
        Patch(k.Model, "save", _saving.save, wrap=True),
        Patch(k.Model, "save_weights", _saving.save_weights, wrap=True),
        Patch(k.Model, "load_weights", _saving.load_weights, wrap=True),
        Patch(k.Model, "summary", _saving.summary, wrap=True),
        Patch(
            k.keras_file_utils_module, "makedirs", _saving.makedirs, wrap=True
        ),
        *[
            Patch(store, name, replacement, wrap=True)
            for store in k.KERAS_FILE_STORES
            for name, replacement in (
                ("__init__", _saving.store_init),
                ("close", _saving.store_close),
            )
        ],
        # Loading: a sharded variable reads only its block of the file.
        Patch(k.H5IOStore, "__getitem__", _saving.stored_item, wrap=True),
        Patch(
            k.keras_saving_lib_module,
            "_load_model_from_fileobj",
            _saving.load_archive,
            wrap=True,
        ),
        Patch(
            k.keras_saving_lib_module,
            "is_memory_sufficient",
            _saving.whole_file_in_memory,
            wrap=True,
        ),
        Patch(
            k.BackupAndRestore, "_save_model", callbacks.backup_save, wrap=True
        ),
        Patch(
            k.BackupAndRestore, "_load_model", callbacks.backup_load, wrap=True
        ),
        Patch(
            k.BackupAndRestore,
            "on_train_end",
            callbacks.backup_train_end,
            wrap=True,
        ),
        Patch(
            k.BackupAndRestore,
            "_should_save_on_batch",
            callbacks.backup_should_save_on_batch,
            wrap=True,
        ),
        # Resume: where fit is in its data, saved with backups and resumed
        # at exactly that batch.
        Patch(
            k.EpochIterator,
            "_enumerate_iterator",
            position.enumerate_batches,
            wrap=True,
        ),
        *_native_distribution_off(k),
        *(_fast_ops(k) if fast else []),
    ]


def after_import():
    """Rows whose owners are modules of libraries on Keras, which the
    package never imports: {module name: function of the imported module
    giving its rows}. `_install` applies a module's rows when it is
    imported (at once where it already is), and `uninstall()` takes them
    out with the others."""
    return {_keras.KERAS_HUB_SAFETENSORS_MODULE: _keras_hub_safetensors}


def _keras_hub_safetensors(module):
    """keras_hub's loader of Hugging Face checkpoints: a tensor ported into
    a sharded variable is read block by block (`_saving.port_weight`)."""
    loader = _keras.keras_hub_safetensor_loader(module)
    return [
        Patch(loader, "port_weight", _saving.port_weight, wrap=True),
        Patch(loader, "enter_context", _saving.loader_file, wrap=True),
        # The path of the file the loader opens next: its blocks are read
        # from it with positioned reads (no memory map).
        Patch(
            _keras.keras_hub_safetensors_paths(module),
            "get_file",
            _saving.loader_path,
            wrap=True,
        ),
    ]


def _fast_ops(k):
    """Keras' own torch ops made faster, each with Keras' numbers
    (KTD_FAST_OPS=0 leaves them out; the einsum row above then wraps
    Keras' einsum for FSDP only)."""
    return [
        # A Python number becomes a tensor on the device without a copy
        # from the host (no host sync).
        *[
            Patch(
                owner,
                "convert_to_tensor",
                backend_core.convert_to_tensor,
                wrap=True,
            )
            for owner in k.CONVERT_TO_TENSOR_OWNERS
        ],
        # A batch's logs read on the host only when shown or used.
        Patch(
            k.CallbackList,
            "_on_train_batch_end",
            batch_logs.train_batch_end,
            wrap=True,
        ),
        Patch(
            k.CallbackList,
            "_on_test_batch_end",
            batch_logs.test_batch_end,
            wrap=True,
        ),
        # SGD without reading the learning rate on the host.
        Patch(
            k.TorchSGD,
            "_parallel_update_step",
            optimizer_update.sgd_update,
            wrap=True,
        ),
        # torch's DTensor: a vocabulary-sharded lookup's masked rows zeroed
        # without a host sync.
        *(
            [
                Patch(
                    masked_lookup.MaskBuffer,
                    "apply_mask",
                    masked_lookup.apply_mask,
                    wrap=True,
                )
            ]
            if masked_lookup.MaskBuffer is not None
            else []
        ),
        # A floating tensor to a Python number's power: the number stays a
        # number (no tensor-to-tensor power and its backward).
        Patch(
            k.torch_numpy_module,
            "power",
            backend_numpy.power,
            wrap=True,
        ),
        # The cross-entropy of (rows, classes), the class dim contiguous.
        Patch(
            k.torch_nn_module,
            "sparse_categorical_crossentropy",
            backend_nn.sparse_categorical_crossentropy,
            wrap=True,
        ),
    ]


def _native_distribution_off(k):
    """Keras 3.16's torch backend distributes data, wraps DDP and
    distributes variables itself; each of these the package does its own
    way (README, "Supported versions"), so exactly one of the two does it:
    the native ones are turned off here, where they exist. Keras 3.15 has
    none of them (see `_keras`, "What differs between the Keras versions").
    Metric reduction and the compiled step's `autograd.grad` are handled
    where the package does them (`trainer.metrics_result`,
    `_keras.train_step_calls_backward`)."""
    patches = []
    if k.NATIVE_TORCH_TRAINING:
        patches += [
            # Batches stay each replica's plain rows: no DTensor of the
            # global batch (the epoch iterator, train/test/predict_on_batch).
            Patch(
                k.torch_trainer_module,
                "distribute_data_input",
                distribution_lib.distribute_data_input,
            ),
            Patch(
                k.TorchEpochIterator,
                "_get_iterator",
                adapter.torch_dataloader_batches,
                wrap=True,
            ),
            # No DistributedDataParallel: gradients are averaged once.
            Patch(k.TorchTrainer, "_initialize_ddp", trainer.no_ddp, wrap=True),
        ]
    if k.NATIVE_VARIABLE_DISTRIBUTION:
        # Born sharded, not distributed from a full value.
        patches.append(
            Patch(
                k.TorchVariable,
                "_initialize_distributed",
                born_sharded.not_natively_distributed,
                wrap=True,
            )
        )
    return patches
