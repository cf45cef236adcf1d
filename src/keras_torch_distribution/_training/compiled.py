"""`jit_compile=True` under a distribution.

Keras' torch trainer compiles its whole per-step function. Under a
distribution that cannot work as such: `loss.backward()` breaks the graph
and the autograd engine then runs AOTAutograd's DTensor backward wrappers
inside the compiling frame, where dynamo fails on their symbolic shapes
(torch 2.13); the gradient hooks of the overlapped all-reduce and c10d
collectives with async_op=True break the graph on every bucket. So the step
stays Keras' own eager step (train_step / test_step / predict_step, user
overrides included) and the model's outermost call -- forward, DTensor
redistributions as functional collectives, the conversion to plain
outputs -- runs through torch.compile; its backward is AOTAutograd's
compiled backward. Gradient sync and the optimizer update run eagerly,
overlapped with that backward as without compilation. Replaces, through
the seam, Keras' `make_train_function` / `make_test_function` /
`make_predict_function` (one factory, `make_step_function`, so steps made
by user code before `fit` get this too) and Keras' flash-attention check while
compiling.
"""

import functools
import types
import weakref

import torch

from keras_torch_distribution import _env
from keras_torch_distribution import _keras
from keras_torch_distribution._log import warn_once
from keras_torch_distribution._training import boundary
from keras_torch_distribution._training import optimizer_update
from keras_torch_distribution._training import regions


class CompiledForwards:
    """Each model's compiled outermost call, made once per model (torch
    compiles on its first call and reuses the graphs after)."""

    def __init__(self):
        self.clear()

    def get(self, model):
        forward = self._by_model.get(model)
        if forward is None:
            forward = self._by_model[model] = _CompiledForward(model)
        return forward

    def clear(self):
        self._by_model = (
            weakref.WeakKeyDictionary()
        )  # model -> _CompiledForward


compiled_forwards = CompiledForwards()


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
        eager = boundary.outermost_call
        function = types.FunctionType(
            eager.__code__.replace(), eager.__globals__, "ktd_compiled_forward"
        )
        self.compiled = torch.compile(
            function, dynamic=False, options={"fx_graph_cache": False}
        )
        self.error = None

    def __call__(self, original, layer, *args, **kwargs):
        if self.error is not None:
            return boundary.convert_outputs(
                original, layer, True, *args, **kwargs
            )
        try:
            return self.compiled(original, layer, *args, **kwargs)
        except Exception as error:
            if regions.unrecoverable_cause(error) is not None:
                # Out of memory, or a peer / the transport failed: not
                # torch.compile's fault, and it hits one rank only (an OOM)
                # or leaves the ranks' collectives out of step. Running
                # eagerly here would let ranks diverge (some compiled, some
                # eager) and hang in mismatched collectives.
                raise
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
            outputs = boundary.convert_outputs(
                original, layer, True, *args, **kwargs
            )
            self.error = error
            warn_once(
                ("jit-compile-fallback", self.model_name),
                "jit_compile=True: torch.compile could not run the forward "
                "of model %r under the current distribution (%s); it runs "
                "eagerly from now on, with the same numbers. To silence "
                "this, compile the model with jit_compile=False.",
                self.model_name,
                regions.why_not_compiled(error),
            )
            return outputs


def can_use_flash_attention(original, *args, raise_error=False, **kwargs):
    """Keras' torch `_can_use_flash_attention`: its check whether
    `dot_product_attention` may force the flash kernel builds a
    `torch.backends.cuda.SDPAParams`, a C++ object dynamo cannot trace:
    every attention call broke the compiled graph, inside a `name_scope`
    where dynamo cannot resume, so whole layers ran eagerly. While
    compiling, answer "no": Keras then calls the same
    `scaled_dot_product_attention` without restricting its kernels, and
    torch's own kernel choice (flash first where it applies) decides.
    When the user asks for flash attention (`raise_error=True`), Keras'
    check runs as it is."""
    if torch.compiler.is_compiling() and not raise_error:
        return False
    return original(*args, raise_error=raise_error, **kwargs)


def compiles_step(model):
    """True when the package makes `model`'s step under jit_compile=True:
    under a distribution (its outermost call, or its repeated blocks,
    through torch.compile), and, with the fast ops (KTD_FAST_OPS), for a
    model with repeated blocks (`regions`) also without one."""
    if getattr(model, "jit_compile", False) is not True:
        return False
    if _keras.current_distribution() is not None:
        return True
    return _env.fast_ops() and regions.has_blocks(model)


def _builds_compiled_step(model, existing, force):
    # steps_per_execution > 1 (Keras 3.16 on torch) reaches this step one
    # batch at a time (`replica_start`).
    return compiles_step(model) and (force or existing is None)


# The step kinds Keras makes functions for: kind -> whether its step runs
# without gradients.
STEP_KINDS = {"train": False, "test": True, "predict": True}


def make_step_function(kind, original, model, force=False):
    """Keras' `make_train_function` / `make_test_function` /
    `make_predict_function` (`kind`: "train", "test" or "predict";
    `original`: Keras' own). For a model compiled with jit_compile=True
    under a distribution, Keras' eager step with the model's outermost call
    through torch.compile (see above), also when user code calls
    `make_train_function()` itself."""
    if kind not in STEP_KINDS:
        raise ValueError(
            f"kind={kind!r} is not a step kind: expected one of "
            f"{sorted(STEP_KINDS)}, as in Keras' make_<kind>_function."
        )
    if _builds_compiled_step(
        model, _keras.model_step_function(model, kind), force
    ):
        step = getattr(model, f"{kind}_step")
        function = _step_function(model, step, STEP_KINDS[kind])
        _keras.set_model_step_function(model, kind, function)
        return function
    return original(model, force)


def _step_function(model, step, no_grad):
    """Keras' eager one-step function, with the model's repeated blocks
    (`regions`) or else its outermost call (and only that call, not fit's
    symbolic build) through torch.compile."""
    if _env.fast_ops() and regions.has_blocks(model):
        scope = functools.partial(regions.compiled_blocks, model)
    else:
        forward = compiled_forwards.get(model)
        scope = functools.partial(boundary.forward_through, model, forward)

    def one_step_on_data(data):
        # Gradients left by the last step would be inputs of the compiled
        # forward's guards and fake tensors (and dynamo cannot fake a DTensor
        # parameter's DTensor .grad with static shapes, torch 2.13). Keras'
        # train_step clears them before backward anyway (zero_grad).
        model.zero_grad(set_to_none=True)
        with scope(), optimizer_update.compiled_updates():
            if no_grad:
                with torch.no_grad():
                    return step(data[0])
            with _keras.train_step_calls_backward(model):
                return step(data[0])

    one_step_on_data._ktd_compiled_forward = True
    return one_step_on_data
