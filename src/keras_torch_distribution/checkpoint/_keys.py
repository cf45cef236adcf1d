"""Keras variables by checkpoint key: what a checkpoint stores and matches.

- ``model/<path>`` for every variable of ``model.variables``, its Keras path
  without the model's own name (``model/col/kernel``), and
  ``model/<layer>/seed_generator_<i>`` for the states of the layers'
  SeedGenerators (what a resume needs for its random draws);
- ``optimizer/<path>`` for every variable of ``model.optimizer.variables``
  without the optimizer's name (``optimizer/iteration``,
  ``optimizer/col/kernel/momentum``: slots are keyed by their model
  variable's key).

So a checkpoint survives code that builds the same model again, even where
Keras numbers the model, optimizer or generator names differently.
"""

from keras_torch_distribution import _keras
from keras_torch_distribution.checkpoint._errors import CheckpointMismatchError

MODEL_PREFIX = "model/"
OPTIMIZER_PREFIX = "optimizer/"


def _strip(prefix, path):
    return path[len(prefix) :] if path.startswith(prefix) else path


def _model_keys(model):
    """{id(variable): key} for the model's variables.

    A key is the variable's Keras path without the model's own name (so a
    model rebuilt as `sequential_1` still matches `sequential`); the state of
    a SeedGenerator, whose path is a global counter, is keyed by its layer.
    """
    keys = {}
    for layer_name, states in _keras.layer_seed_states(model):
        for index, state in enumerate(states):
            keys[id(state)] = f"{layer_name}/seed_generator_{index}"
    prefix = model.name + "/"
    for variable in model.variables:
        keys.setdefault(id(variable), _strip(prefix, variable.path))
    return keys


def _optimizer_key(optimizer, variable, trainable_keys):
    """An optimizer variable's path without the optimizer's name, with the
    model variable it belongs to (if any) written as that variable's key:
    'adam_1/sequential_1_col_kernel_momentum' -> 'col/kernel/momentum'."""
    name = _strip(optimizer.name + "/", variable.path)
    best = None
    for underscored, key in trainable_keys:
        if name.startswith(underscored + "_") and (
            best is None or len(underscored) > len(best[0])
        ):
            best = (underscored, key)
    if best is None:
        return name
    return best[1] + "/" + name[len(best[0]) + 1 :]


def optimizer_of(model):
    """The model's optimizer, None for a model never compiled."""
    return getattr(model, "optimizer", None)


def variables_by_key(model, optimizer=True):
    """{checkpoint key: variable} of what `save` stores for `model` (no
    collective)."""
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so it has no variables to "
            "save or load. Build it first (call it on a batch, or "
            "`model.build(input_shape)`)."
        )
    model_keys = _model_keys(model)
    entries = [(MODEL_PREFIX + model_keys[id(v)], v) for v in model.variables]
    opt = optimizer_of(model)
    if optimizer and opt is not None and opt.built:
        trainable_keys = [
            (v.path.replace("/", "_"), model_keys[id(v)])
            for v in model.trainable_variables
        ]
        entries += [
            (OPTIMIZER_PREFIX + _optimizer_key(opt, v, trainable_keys), v)
            for v in opt.variables
        ]
    named = {}
    for key, variable in entries:
        if key in named and named[key] is not variable:
            raise ValueError(
                f"Two variables of model {model.name!r} have the checkpoint "
                f"key {key!r} ({named[key].path!r} and {variable.path!r}), so "
                "a checkpoint cannot tell them apart. Give the layers (or "
                "their weights) unique names."
            )
        named[key] = variable
    return named


def has_optimizer_state(keys):
    return any(k.startswith(OPTIMIZER_PREFIX) for k in keys)


def model_keys_only(saved):
    return {k: v for k, v in saved.items() if k.startswith(MODEL_PREFIX)}


def state_dict(variables):
    """{key: tensor} that DCP reads from and loads into: each variable's own
    storage (a DTensor for a sharded variable), without autograd."""
    return {key: _keras.raw_value(v).detach() for key, v in variables.items()}


def optimizer_ready_for(model, saved_keys):
    """Build the model's optimizer when the checkpoint holds its state."""
    opt = optimizer_of(model)
    if opt is None or opt.built:
        return
    if has_optimizer_state(saved_keys):
        opt.build(model.trainable_variables)


def check_matches(model, path, variables, saved):
    """Raise CheckpointMismatchError listing what does not match between the
    model's `variables` and the checkpoint's `saved` {key: shape}."""
    missing = sorted(k for k in variables if k not in saved)
    unexpected = sorted(k for k in saved if k not in variables)
    mismatched = sorted(
        (k, tuple(saved[k]), tuple(variables[k].shape))
        for k in variables
        if k in saved and tuple(saved[k]) != tuple(variables[k].shape)
    )
    if not (missing or unexpected or mismatched):
        return
    lines = [f"Checkpoint {path!r} does not match model {model.name!r}:"]
    if missing:
        lines.append(
            f"- missing from the checkpoint ({len(missing)}): {missing}"
        )
    if unexpected:
        lines.append(
            f"- in the checkpoint but not in the model ({len(unexpected)}): "
            f"{unexpected}"
        )
    if mismatched:
        lines.append(
            "- shape mismatches (checkpoint shape, model shape): "
            + ", ".join(f"{k}: {a} vs {b}" for k, a, b in mismatched)
        )
    hint = "Build the same model (same layer names) as the one saved"
    if has_optimizer_state(missing + unexpected):
        hint += (
            "; pass optimizer=False to load only the model variables "
            "(a checkpoint saved with optimizer=False, or a model compiled "
            "with another optimizer)"
        )
    lines.append(hint + ".")
    raise CheckpointMismatchError(
        "\n".join(lines), missing, unexpected, mismatched
    )
