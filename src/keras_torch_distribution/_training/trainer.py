"""Keras training on N processes: gradient sync, metrics, predictions, logs.

Replaces, through the seam, `Optimizer.apply` (gradients are aligned to
their variables and averaged over data-parallel replicas),
`Model.get_metrics_result` (metric states are summed over replicas before
results are computed, in the step's gradient all-reduce when it has one:
`metric_states`) and fit / evaluate / predict (logs and files from
rank 0); gathers the predictions of every replica, in order, for the
predict step (`replica_start.make_step_function`). The model boundary is
`boundary.py`, jit_compile `compiled.py`.
"""

import keras
import torch
import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution import _saving
from keras_torch_distribution._batch import position
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._log import say_grouped
from keras_torch_distribution._preemption import agreed_stop
from keras_torch_distribution._preemption import signals
from keras_torch_distribution._processes import runtime
from keras_torch_distribution._training import boundary
from keras_torch_distribution._training import call_agreement
from keras_torch_distribution._training import gradients
from keras_torch_distribution._training import metric_states
from keras_torch_distribution._variables import born_sharded
from keras_torch_distribution._variables import left_whole


def optimizer_apply(original, optimizer, grads, trainable_variables=None):
    """Keras `BaseOptimizer.apply` and `LossScaleOptimizer.apply`: align
    each gradient to its variable's layout and average gradients over
    data-parallel replicas, then apply. An optimizer that wraps another
    (LossScaleOptimizer) synchronises before it looks at the gradients, so
    that every rank judges the same averaged gradients finite or not and
    skips or applies the same step; the inner optimizer's `apply` then
    synchronises nothing. Collective: call on every rank."""
    if not torch.compiler.is_compiling():
        say_grouped()  # the model's and its slots' findings, before a step
    if gradients.optimizer_sync.apply_depth or len(grads) == 0:
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
        variables = _keras.optimizer_variables(optimizer)
    grads = [
        gradients.align(g, _keras.raw_value(v))
        for g, v in zip(grads, variables)
    ]
    group = replicas.current()
    if group.is_distributed:
        gradients.synchronize(optimizer, grads, variables, group)
    gradients.optimizer_sync.apply_depth += 1
    try:
        return original(optimizer, grads, trainable_variables)
    finally:
        gradients.optimizer_sync.apply_depth -= 1
        replicas.batch_weight.reset()


_eager_apply = torch._dynamo.disable(
    _apply, reason="keras_torch_distribution: gradient sync runs eagerly"
)


def metrics_result(original, model):
    """Keras `Model.get_metrics_result`: metric results computed from
    states summed over replicas, identical on every rank. Collective: call
    on every rank."""
    group = replicas.current()
    if not group.is_distributed:
        # Not Keras 3.16's torch override (`original` there), which
        # all-reduces the states of processes that are no replicas.
        return _keras.metrics_result_of_this_process(model)
    metrics = list(model.metrics)
    states = [v for m in metrics for v in m.variables]
    reduced = metric_states.reduced_states(states, group)
    metric_states.remember(model)
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


def no_ddp(original, model):
    """Keras 3.16 `Trainer._initialize_ddp`: nothing. Keras wraps the model
    in DistributedDataParallel under DataParallel (and with no distribution
    whenever a process group exists); this package averages gradients over
    the batch axis itself (bucketed, overlapped with backward: `gradients`),
    so DDP would reduce every gradient a second time. `model.ddp_model`
    stays None."""
    del original, model


def gather_predictions(outputs):
    """The outputs of one predict step with the rows of every replica, in
    input order (as one process predicting on the global batch returns
    them). Collective: call on every rank."""
    group = replicas.current()
    if not group.is_distributed:
        return outputs
    return keras.tree.map_structure(lambda t: _gather_rows(t, group), outputs)


def _gather_rows(tensor, group):
    tensor = boundary.plain(tensor).detach().contiguous()
    sizes = [None] * group.count
    dist.all_gather_object(sizes, int(tensor.shape[0]), group=group.group)
    largest = max(sizes)
    padded = torch.zeros(
        (largest,) + tuple(tensor.shape[1:]),
        dtype=tensor.dtype,
        device=tensor.device,
    )
    padded[: tensor.shape[0]] = tensor
    pieces = [torch.empty_like(padded) for _ in range(group.count)]
    dist.all_gather(pieces, padded, group=group.group)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes)], dim=0)


def _with_last(callbacks, callback, model):
    """`callbacks` (None, a list, or Keras' CallbackList) with `callback`
    added last; the user's list is not changed. A CallbackList is made
    anew, so that Keras decides again whether it may run batch callbacks
    in a background thread (not with this one, which runs a collective)."""
    if callbacks is None:
        return [callback]
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return keras.callbacks.CallbackList(
            list(callbacks.callbacks) + [callback],
            model=model,
            **(callbacks.params or {}),
        )
    return list(callbacks) + [callback]


def fit_evaluate_predict(original, model, *args, **kwargs):
    """Keras `Model.fit` / `evaluate` / `predict`: progress is printed, and
    file-writing callbacks write, on rank 0 only. Variables created
    before the distribution was set, that it would shard, get one
    warning each, and so do large variables the layout map leaves whole
    (`_variables.left_whole`). Ranks that disagree on the call (model,
    distribution, input sizes) raise, naming the difference. A
    multi-process `fit` under a distribution gets `PreemptTogether` last:
    the ranks stop together, and a preemption signal writes its backups at
    one agreed step (`preemption`). Collective: call on every rank."""
    call_agreement.check(original.__name__, model, args, kwargs)
    if original.__name__ != "fit":  # fit's come with its first update
        say_grouped()
    distribution = _keras.current_distribution()
    born_sharded.warn_if_created_outside(model.variables, distribution)
    left_whole.warn_if_left_whole(model.variables, distribution)
    if runtime.process_id() != 0:
        kwargs["verbose"] = 0
        kwargs["callbacks"] = _saving.callbacks_for_this_rank(
            kwargs.get("callbacks")
        )
    catches_signals = False
    if (
        original.__name__ == "fit"
        and _keras.current_distribution() is not None
        and runtime.is_multi_process()
    ):
        catches_signals = True
        callbacks = kwargs.get("callbacks")
        last = agreed_stop.PreemptTogether(
            agreed_stop.backup_callbacks(callbacks)
        )
        kwargs["callbacks"] = _with_last(callbacks, last, model)
    elif (
        original.__name__ == "evaluate"
        and not position.state.running  # not fit's validation
        and _keras.current_distribution() is not None
        and runtime.is_multi_process()
    ):
        catches_signals = True
        kwargs["callbacks"] = _with_last(
            kwargs.get("callbacks"), agreed_stop.PreemptEvaluation(), model
        )
    try:
        return original(model, *args, **kwargs)
    finally:
        replicas.batch_weight.forget()
        if catches_signals:
            signals.release()
        if original.__name__ == "fit":
            position.end()
