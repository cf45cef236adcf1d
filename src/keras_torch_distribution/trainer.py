"""Keras training on N processes: the model boundary, gradient sync, metrics.

Replaces, through the seam, `Model.__call__` (outermost calls return plain
tensors), `Optimizer.apply` (gradients are aligned to their variables and
averaged over data-parallel replicas), `Model.get_metrics_result` (metric
states are summed over replicas before results are computed), and the
predict function (predictions of every replica are gathered in order).
"""

import types
import weakref

import keras
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keras_torch_distribution import _keras_compat
from keras_torch_distribution import data
from keras_torch_distribution import gradients
from keras_torch_distribution import overlap
from keras_torch_distribution import replicas
from keras_torch_distribution import runtime
from keras_torch_distribution import saving
from keras_torch_distribution import tensors
from keras_torch_distribution import variables
from keras_torch_distribution.log import warn_once

_apply_depth = [0]
_reducers = weakref.WeakKeyDictionary()  # optimizer -> OverlappedReducer
_compiled_forwards = weakref.WeakKeyDictionary()  # model -> _CompiledForward
_active_forward = [None]  # (model, _CompiledForward) while a compiled step runs


def _plain(value):
    return tensors.full_value(value) if isinstance(value, DTensor) else value


def layer_call(original, layer, *args, **kwargs):
    """Keras `Layer.__call__` once sharded variables exist: a layer's
    partial-sum outputs are reduced at its boundary (so a value every
    consumer reads, e.g. a vocabulary-sharded embedding lookup feeding two
    norms, is reduced once), and an outermost call returns plain tensors (the
    model replica's whole outputs), so losses, metrics and user code never
    meet DTensors. A model compiled with `jit_compile=True` under a
    distribution runs its outermost call through `torch.compile`."""
    outermost = _keras_compat.in_outer_call()
    if outermost:
        active = _active_forward[0]
        if active is not None and active[0] is layer and not torch.compiler.is_compiling():
            return active[1](original, layer, *args, **kwargs)
    return _layer_call(original, layer, outermost, *args, **kwargs)


def _layer_call(original, layer, outermost, *args, **kwargs):
    if not variables.has_sharded_variables():
        return original(layer, *args, **kwargs)
    outputs = original(layer, *args, **kwargs)
    convert = _plain if outermost else tensors.reduce_partial
    return keras.tree.map_structure(convert, outputs)


def _outermost_call(original, layer, *args, **kwargs):
    return _layer_call(original, layer, True, *args, **kwargs)


def optimizer_apply(original, optimizer, grads, trainable_variables=None):
    """Align each gradient to its variable's layout and average gradients
    over data-parallel replicas, then apply. Collective: call on every rank."""
    if _apply_depth[0] or len(grads) == 0:
        return original(optimizer, grads, trainable_variables)
    if torch.compiler.is_compiling():
        # Inside a torch.compile'd train step: gradient sync (collectives,
        # gradient hooks) and the update run eagerly, between the compiled
        # forward/backward graphs.
        return _eager_apply(original, optimizer, grads, trainable_variables)
    return _apply(original, optimizer, grads, trainable_variables)


def _apply(original, optimizer, grads, trainable_variables):
    variables = trainable_variables
    if variables is None:
        variables = _keras_compat.optimizer_variables(optimizer)
    grads = [
        gradients.align(g, _keras_compat.raw_value(v))
        for g, v in zip(grads, variables)
    ]
    group = replicas.current()
    if group.is_distributed:
        _synchronize(optimizer, grads, variables, group)
    _apply_depth[0] += 1
    try:
        return original(optimizer, grads, trainable_variables)
    finally:
        _apply_depth[0] -= 1


_eager_apply = torch._dynamo.disable(
    _apply, reason="keras_torch_distribution: gradient sync runs eagerly"
)


def _synchronize(optimizer, grads, variables, group):
    steps = optimizer.gradient_accumulation_steps
    reducer = None if steps else _overlapped_reducer(optimizer, variables, group)
    if reducer is not None and reducer.finish(grads):
        return
    local = [gradients.local_part(g) for g in grads if g is not None]
    scale = data.batch_scale()
    if steps:
        # Accumulate local gradients; average once per real step, together
        # with what was accumulated.
        if scale != 1.0:
            for t in local:
                t.mul_(scale)
        iteration = _keras_compat.apply_count(optimizer)
        if (iteration + 1) % steps:
            return
        accumulators = _keras_compat.gradient_accumulators(optimizer, variables)
        local += [gradients.local_part(_keras_compat.raw_value(a)) for a in accumulators]
        scale = 1.0
    gradients.all_reduce_mean(local, group.group, group.count, scale)


def _overlapped_reducer(optimizer, variables, group):
    """The optimizer's overlapped reducer when every trainable variable is a
    plain tensor (data parallelism); None otherwise. Built on the first step
    (whose gradients are then averaged synchronously), reused after."""
    params = [_keras_compat.raw_value(v) for v in variables]
    reducer = _reducers.get(optimizer)
    if reducer is not None and [id(p) for p in reducer.params] == [id(p) for p in params]:
        return reducer
    if reducer is not None:
        reducer.remove()
        del _reducers[optimizer]
    if any(isinstance(p, DTensor) or not p.requires_grad for p in params):
        return None
    reducer = overlap.OverlappedReducer(params, group.group, group.count)
    _reducers[optimizer] = reducer
    return reducer


def metrics_result(original, model):
    """Metric results computed from states summed over replicas, identical
    on every rank. Collective: call on every rank."""
    group = replicas.current()
    if not group.is_distributed:
        return original(model)
    metrics = list(model.metrics)
    states = [v for m in metrics for v in m.variables]
    reduced = _reduce_states(states, group)
    results = {}
    start = 0
    for metric in metrics:
        count = len(metric.variables)
        result = metric.stateless_result(reduced[start : start + count])
        start += count
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def _reduce_states(states, group):
    values = [_plain(v.value).detach() for v in states]
    if not values:
        return []
    flat = torch.cat([v.reshape(-1).to(torch.float64) for v in values])
    weights = torch.cat(
        [
            torch.full((v.numel(),), _state_weight(s, group), dtype=torch.float64)
            for v, s in zip(values, states)
        ]
    ).to(flat.device)
    flat.mul_(weights)
    dist.all_reduce(flat, group=group.group)
    reduced, offset = [], 0
    for v in values:
        n = v.numel()
        reduced.append(flat[offset : offset + n].view(v.shape).to(v.dtype))
        offset += n
    return reduced


def _state_weight(variable, group):
    aggregation = variable.aggregation
    if aggregation == "mean":
        return 1.0 / group.count
    if aggregation == "only_first_replica":
        return 1.0 if group.index == 0 else 0.0
    return 1.0  # "sum" (Keras metrics' default) and "none"


def make_predict_function(original, model, force=False):
    """The predict function returns the predictions of every replica, in
    input order (and, as `make_train_function`, compiles the model's
    outermost call under jit_compile=True). Collective per batch: call on
    every rank."""
    if _builds_compiled_step(model, model.predict_function, force):
        model.predict_function = _step_function(model, model.predict_step, True)
        result = model.predict_function
    else:
        result = original(model, force)
    function = model.predict_function
    if getattr(function, "_ktd_gathers", False):
        return result

    def predict_on_every_replica(data_batch):
        outputs = function(data_batch)
        group = replicas.current()
        if not group.is_distributed:
            return outputs
        return keras.tree.map_structure(
            lambda t: _gather_rows(t, group), outputs
        )

    predict_on_every_replica._ktd_gathers = True
    predict_on_every_replica._ktd_compiled_forward = getattr(
        function, "_ktd_compiled_forward", False
    )
    model.predict_function = predict_on_every_replica
    return result


def _gather_rows(tensor, group):
    tensor = _plain(tensor).detach().contiguous()
    sizes = [None] * group.count
    dist.all_gather_object(sizes, int(tensor.shape[0]), group=group.group)
    largest = max(sizes)
    padded = torch.zeros(
        (largest,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    padded[: tensor.shape[0]] = tensor
    pieces = [torch.empty_like(padded) for _ in range(group.count)]
    dist.all_gather(pieces, padded, group=group.group)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)], dim=0)


def quiet_on_other_ranks(original, model, *args, **kwargs):
    """fit / evaluate / predict print progress, and file-writing callbacks
    write, on rank 0 only. Variables created before the distribution was set, that it would shard,
    get one warning each."""
    variables.warn_if_created_outside(
        model.variables, _keras_compat.current_distribution()
    )
    if runtime.process_id() != 0:
        kwargs["verbose"] = 0
        kwargs["callbacks"] = saving.callbacks_for_this_rank(kwargs.get("callbacks"))
    return original(model, *args, **kwargs)


# ---------------------------------------------------------------------------
# jit_compile=True under a distribution.
#
# Keras' torch trainer compiles its whole per-step function. Under a
# distribution that cannot work as such: `loss.backward()` breaks the graph
# and the autograd engine then runs AOTAutograd's DTensor backward wrappers
# inside the compiling frame, where dynamo fails on their symbolic shapes
# (torch 2.13); the gradient hooks of the overlapped all-reduce and c10d
# collectives with async_op=True break the graph on every bucket. So the step
# stays Keras' own eager step (train_step / test_step / predict_step, user
# overrides included) and the model's outermost call -- forward, DTensor
# redistributions as functional collectives, the conversion to plain
# outputs -- runs through torch.compile; its backward is AOTAutograd's
# compiled backward. Gradient sync and the optimizer update run eagerly,
# overlapped with that backward as without compilation.
# ---------------------------------------------------------------------------


class _CompiledForward:
    """A model's outermost call through torch.compile; eager (after one
    warning) once torch.compile cannot handle it."""

    def __init__(self, model):
        self.model_name = model.name
        # Static shapes: a dynamic batch dim fails where plain tensors meet
        # DTensors (implicit replication calls numel() on symbolic sizes,
        # torch 2.13); a last partial batch costs one recompile instead. A
        # code object of its own per model keeps each model's compiled
        # graphs apart from torch's per-code recompile limit. No FX graph
        # cache: its key leaves out process-group names, so on a 2x2 mesh a
        # rank loaded another rank's graph and its group name (torch 2.13:
        # "Could not resolve the process group registered under the name").
        function = types.FunctionType(
            _outermost_call.__code__.replace(), globals(), "ktd_compiled_forward"
        )
        self.compiled = torch.compile(
            function, dynamic=False, options={"fx_graph_cache": False}
        )
        self.error = None

    def __call__(self, original, layer, *args, **kwargs):
        if self.error is not None:
            return _layer_call(original, layer, True, *args, **kwargs)
        try:
            return self.compiled(original, layer, *args, **kwargs)
        except Exception as error:
            # Dynamo/inductor errors, and DTensor errors raised by compiled
            # code (e.g. AOTAutograd regenerating an output view with
            # as_strided, which DTensor refuses) reach here re-wrapped by
            # Keras' layer call as plain exceptions. Every rank fails alike,
            # and the forward of a step changes no state but in-forward
            # updates (BatchNormalization's moving statistics, which may then
            # be updated twice on this one step), so run it eagerly: if that
            # fails too, the error is the model's own and is raised as it
            # is; if not, torch.compile cannot handle this model: warn once
            # and stay eager.
            outputs = _layer_call(original, layer, True, *args, **kwargs)
            self.error = error
            reason = str(error).strip().splitlines()
            warn_once(
                ("jit-compile-fallback", self.model_name),
                "jit_compile=True: torch.compile could not run the forward "
                "of model %r under the current distribution (%s: %s); it "
                "runs eagerly from now on, with the same numbers. To silence "
                "this, compile the model with jit_compile=False.",
                self.model_name,
                type(error).__name__,
                " ".join(line.strip() for line in reason[:3]) or "no message",
            )
            return outputs


def can_use_flash_attention(original, *args, raise_error=False, **kwargs):
    """Keras' check whether `dot_product_attention` may force the flash
    kernel builds a `torch.backends.cuda.SDPAParams`, a C++ object dynamo
    cannot trace: every attention call broke the compiled graph, inside a
    `name_scope` where dynamo cannot resume, so whole layers ran eagerly.
    While compiling, answer "no": Keras then calls the same
    `scaled_dot_product_attention` without restricting its kernels, and
    torch's own kernel choice (flash first where it applies) decides. When
    the user asks for flash attention (`raise_error=True`), Keras' check
    runs as it is."""
    if torch.compiler.is_compiling() and not raise_error:
        return False
    return original(*args, raise_error=raise_error, **kwargs)


def compiles_under_distribution(model):
    """True when `model` was compiled with jit_compile=True and a
    distribution is set: its outermost call runs through torch.compile."""
    return (
        _keras_compat.current_distribution() is not None
        and getattr(model, "jit_compile", False) is True
    )


def _builds_compiled_step(model, existing, force):
    return (
        compiles_under_distribution(model)
        and (force or existing is None)
        and model.steps_per_execution == 1
    )


def _compiled_forward(model):
    forward = _compiled_forwards.get(model)
    if forward is None:
        forward = _compiled_forwards[model] = _CompiledForward(model)
    return forward


def make_train_function(original, model, force=False):
    """Keras' train function; for a model compiled with jit_compile=True
    under a distribution, Keras' eager step with the model's outermost call
    through torch.compile (see above), also when user code calls
    `make_train_function()` itself."""
    if _builds_compiled_step(model, model.train_function, force):
        model.train_function = _step_function(model, model.train_step, False)
        return model.train_function
    return original(model, force)


def make_test_function(original, model, force=False):
    """As `make_train_function`, for evaluate."""
    if _builds_compiled_step(model, model.test_function, force):
        model.test_function = _step_function(model, model.test_step, True)
        return model.test_function
    return original(model, force)


def _step_function(model, step, no_grad):
    """Keras' eager one-step function, with the model's outermost call (and
    only that call, not fit's symbolic build) through torch.compile."""
    forward = _compiled_forward(model)

    def one_step_on_data(data):
        # Gradients left by the last step would be inputs of the compiled
        # forward's guards and fake tensors (and dynamo cannot fake a DTensor
        # parameter's DTensor .grad with static shapes, torch 2.13). Keras'
        # train_step clears them before backward anyway (zero_grad).
        model.zero_grad(set_to_none=True)
        saved = _active_forward[0]
        _active_forward[0] = (model, forward)
        try:
            if no_grad:
                with torch.no_grad():
                    return step(data[0])
            return step(data[0])
        finally:
            _active_forward[0] = saved

    one_step_on_data._ktd_compiled_forward = True
    return one_step_on_data
