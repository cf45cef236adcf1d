"""`uninstall()` undoes everything `install()` and training left behind:
torch's own DTensor rules and handlers, implicit replication off, gradient
hooks off the parameters, and every state object cleared. No process group."""

import os
import subprocess
import sys

import keras
import pytest
import torch
from torch.distributed.tensor import DTensor

import keras_torch_distribution
from keras_torch_distribution import _install
from keras_torch_distribution import _patches
from keras_torch_distribution._distributed import older_torch_rules
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import sharding_rules
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._training import gradients
from keras_torch_distribution._training import overlap
from keras_torch_distribution._training import replica_start
from keras_torch_distribution._variables import born_sharded

_RULE_OPS = (
    torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)
# Index writes: the package's strategy where torch has no single-dim one.
_INDEX_PUT_OPS = (
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
)
# Stack: torch's own strategy, given a non-negative dim.
_STACK = torch.ops.aten.stack.default
# Squeezes: the package's strategy where torch does not rewrite them.
_SQUEEZE_OPS = (
    torch.ops.aten.squeeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
)


@pytest.fixture
def reinstall():
    yield
    keras_torch_distribution.install()
    assert keras_torch_distribution.is_installed()


def _dtensor_tables():
    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    return {
        op: (
            propagator.op_strategy_funcs.get(op),
            propagator.op_to_schema_info.get(op),
            propagator.op_single_dim_strategy_funcs.get(op),
            dispatcher._custom_op_handlers.get(op),
        )
        for op in _RULE_OPS + _INDEX_PUT_OPS + (_STACK,) + _SQUEEZE_OPS
    }


def _implicit_replication():
    return DTensor._op_dispatcher._allow_implicit_replication


def test_uninstall_gives_torch_its_own_rules_and_handlers_back(reinstall):
    keras_torch_distribution.uninstall()
    torch_own = _dtensor_tables()
    assert not _implicit_replication()
    conv, backward, attention = _RULE_OPS
    # torch handles convolution with its own handler until we install.
    assert torch_own[conv][3] is not None and torch_own[backward][3] is not None

    keras_torch_distribution.install()
    ours = _dtensor_tables()
    assert _implicit_replication()
    # Its handlers are out; ours is registered for CPU attention, which
    # torch has no strategy for.
    assert ours[conv][3] is None and ours[backward][3] is None
    assert torch_own[attention][0] is None and ours[attention][0] is not None
    if torch_own[conv][2] is not None:
        # torch>=2.13: its own convolution strategies stay in use (the
        # backward one wrapped).
        assert ours[conv][:3] == torch_own[conv][:3]
        assert ours[backward][2] is not torch_own[backward][2]
    else:
        # Before: the package's strategies, not torch's older rules.
        for op in (conv, backward):
            assert torch_own[op][0] is None and ours[op][0] is not None, op
    for op in _INDEX_PUT_OPS:
        if torch_own[op][2] is None:  # torch has no single-dim strategy
            assert ours[op][0] is not torch_own[op][0], op
            assert ours[op][0] is older_torch_rules.index_put_strategy, op
        else:
            assert ours[op] == torch_own[op], op
    if torch_own[_STACK][0] is not None:
        assert ours[_STACK][0] is not torch_own[_STACK][0]
        assert ours[_STACK][1:] == torch_own[_STACK][1:]
    rewrites = hasattr(
        DTensor._op_dispatcher.sharding_propagator, "squeeze_op_to_dims_variant"
    )
    for op in _SQUEEZE_OPS:
        if rewrites:
            assert ours[op] == torch_own[op], op
        else:
            assert ours[op][0] is older_torch_rules.squeeze_strategy, op

    keras_torch_distribution.uninstall()
    assert _dtensor_tables() == torch_own
    assert not _implicit_replication()
    assert not sharding_rules.registration.active


def test_uninstall_removes_gradient_hooks_and_clears_state(reinstall):
    params = [
        torch.nn.Parameter(torch.ones(3)),
        torch.nn.Parameter(torch.ones(2)),
    ]
    reducer = overlap.OverlappedReducer(params, group=None, count=2)
    optimizer = keras.optimizers.SGD()
    gradients.optimizer_sync.reducers[optimizer] = reducer
    assert all(p._post_accumulate_grad_hooks for p in params)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    replica_start.equalized.models.add(model)
    gathering.state.plans_exist = True
    born_sharded.state.sharded_exist = True
    replicas.batch_weight.set(0.5, rows=(8, 0, 4))
    replicas.cache.by_key["key"] = replicas.Replicas(2, 0, None)

    keras_torch_distribution.uninstall()

    assert not any(p._post_accumulate_grad_hooks for p in params)
    assert len(gradients.optimizer_sync.reducers) == 0
    assert gradients.optimizer_sync.apply_depth == 0
    assert model not in replica_start.equalized.models
    assert not gathering.plans_exist()
    assert not born_sharded.has_sharded_variables()
    assert (replicas.batch_weight.value, replicas.batch_weight.rows) == (
        1.0,
        None,
    )
    assert replicas.cache.by_key == {}
    # Every state object has a clear() that uninstall calls.
    for state in _install._state_objects():
        assert callable(state.clear), state


_KERAS_HUB_ROWS = """
import sys
import keras_torch_distribution
from keras_torch_distribution import _install
from keras_torch_distribution import _patches

assert "keras_hub" not in sys.modules, "the package imported keras_hub"
assert _install.after_imports in sys.meta_path
from keras_hub.src.utils.transformers import safetensor_utils

loader = safetensor_utils.SafetensorLoader
assert loader.port_weight.__wrapped__.__module__ == safetensor_utils.__name__
assert "enter_context" in vars(loader)  # ExitStack's, overridden
assert safetensor_utils.__loader__.__module__ != _install.__name__
assert _install.after_imports not in sys.meta_path  # nothing left to wait for
keras_torch_distribution.uninstall()
assert not hasattr(loader.port_weight, "__wrapped__")
assert "enter_context" not in vars(loader)
keras_torch_distribution.install()  # keras_hub imported: applied at once
assert hasattr(loader.port_weight, "__wrapped__")
print("ok")
"""


def test_keras_hub_rows_wait_for_its_import_and_come_out_again():
    """The package never imports keras_hub; its rows are applied when
    keras_hub imports the module, and taken out by uninstall()."""
    pytest.importorskip("keras_hub")
    env = dict(os.environ, OMP_NUM_THREADS="1", KERAS_BACKEND="torch")
    result = subprocess.run(
        [sys.executable, "-c", _KERAS_HUB_ROWS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_a_library_without_what_its_rows_replace_is_left_alone():
    import types

    module = types.SimpleNamespace()  # no SafetensorLoader

    def rows(module):
        return [_patches.Patch(module.SafetensorLoader, "port_weight", print)]

    installed = list(_install._installed)
    with pytest.warns(UserWarning, match="cannot find .* in keras_hub.x"):
        _install._apply_after_import("keras_hub.x", rows, module)
    assert _install._installed == installed
