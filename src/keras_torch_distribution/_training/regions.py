"""`jit_compile=True` as torchtitan compiles: each repeated block once.

Keras' torch trainer compiles its whole train step. Dynamo then traces
every layer call of every block, Keras' name scopes and trees included,
and breaks the graph where it cannot follow: a 4-block keras_hub Llama
made 27 graphs and 33 graph breaks, 283 s before its first step on a CPU,
and its compiled step was slower than the eager one. torchtitan compiles
each transformer block on its own (`block.compile()`): identical blocks
share one graph, the time to the first step does not grow with depth,
and what is around the blocks stays eager.

Here, under `jit_compile=True`, a model's repeated blocks -- walking down
from the model, the first layers whose class occurs at least twice among
the model's layers and that hold layers of their own (keras_hub's decoder
blocks) -- run their `call` through one `torch.compile` of their class's
`call`, for the duration of each step (`compiled_blocks`). Keras' train
step, the layers around the blocks, the loss, the gradient sync and the
optimizer run as without compilation. While dynamo traces a block, no
Keras name scope opens (`name_scope_while_compiling`): a scope only names
the variables a call creates, and a built block creates none, but
opening one reads the layer's own path, which made dynamo compile every
block anew.

A model without repeated blocks (a Sequential of Dense layers), one
whose layout map lays out the output of a layer inside a block (Keras
reads that layer's path, which no scope gives while compiling), and one
with variables sharded on the batch axis (FSDP) are compiled as before
(`compiled`). A block that torch.compile cannot run
runs eagerly from then on, after one warning, with the same numbers.
"""

import contextlib
import functools
import weakref

import torch
import torch.distributed as dist

from keras_torch_distribution import _keras
from keras_torch_distribution._fsdp import gathering
from keras_torch_distribution._log import first_line
from keras_torch_distribution._log import innermost
from keras_torch_distribution._log import logger
from keras_torch_distribution._log import warn_once


def name_scope_while_compiling(original, layer):
    """Replaces Keras `Layer._open_name_scope`: no scope while dynamo
    traces a compiled block (see the module docstring), Keras' own
    otherwise."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return original(layer)


class CompiledBlocks:
    """Each model's repeated blocks (found once per model) and each block
    class's compiled `call` (made once per class: every instance shares
    its graphs)."""

    def __init__(self):
        self.clear()

    def blocks(self, model):
        """The blocks of `model` to compile (an empty list when none)."""
        found = self._by_model.get(model)
        if found is None:
            found = _find_blocks(model)
            if model.built:  # layers made when it builds are not there yet
                self._by_model[model] = found
            if found:
                logger.info(
                    "jit_compile=True: %d blocks of model %r (%s) run through "
                    "one compiled call per class",
                    len(found),
                    model.name,
                    ", ".join(sorted({type(b).__name__ for b in found})),
                )
        return found

    def call_of(self, cls):
        compiled = self._by_class.get(cls)
        if compiled is None:
            compiled = self._by_class[cls] = _CompiledCall(cls)
        return compiled

    def clear(self):
        self._by_model = weakref.WeakKeyDictionary()  # model -> [blocks]
        self._by_class = {}  # layer class -> _CompiledCall


compiled_blocks_state = CompiledBlocks()


def has_blocks(model):
    """True when `model` has repeated blocks to compile on their own, and
    no variable is sharded on the batch axis (FSDP's gathers and their
    regathering in backward are not traced in a block; the forward is then
    compiled whole, as before)."""
    return not gathering.plans_exist() and bool(
        compiled_blocks_state.blocks(model)
    )


@contextlib.contextmanager
def compiled_blocks(model):
    """Within the block, each of `model`'s repeated blocks calls its
    class's compiled `call`."""
    blocks = compiled_blocks_state.blocks(model)
    for block in blocks:
        call = compiled_blocks_state.call_of(type(block))
        block.__dict__["call"] = functools.partial(call, block)
    try:
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("call", None)


def _find_blocks(model):
    """The repeated blocks of `model` (see the module docstring)."""
    layers = _keras.sublayers(model, recursive=True)
    composite = [layer for layer in layers if _keras.sublayers(layer)]
    counts = {}
    for layer in composite:
        counts[type(layer)] = counts.get(type(layer), 0) + 1
    repeated = {cls for cls, count in counts.items() if count >= 2}
    found = []

    def walk(layer):
        for sublayer in _keras.sublayers(layer):
            if type(sublayer) in repeated:
                found.append(sublayer)
            else:
                walk(sublayer)

    walk(model)
    if found and _output_laid_out_inside(found):
        logger.info(
            "jit_compile=True: model %r's layout map lays out an output "
            "inside its blocks; its forward is compiled whole instead",
            model.name,
        )
        return []
    return found


def _output_laid_out_inside(blocks):
    """True when the distribution lays out the output of a layer inside
    one of `blocks` (Keras looks `<path>/output` up in its layout map)."""
    distribution = _keras.current_distribution()
    if distribution is None:
        return False
    for block in blocks:
        for layer in _keras.sublayers(block, recursive=True):
            if distribution.get_tensor_layout(f"{layer.path}/output"):
                return True
    return False


class _CompiledCall:
    """A layer class's `call` through torch.compile; eager (after one
    warning) once torch.compile cannot run it."""

    def __init__(self, cls):
        self.cls = cls
        # Static shapes, as for the compiled forward (`compiled`): a last
        # partial batch costs one recompile. No FX graph cache: its key
        # leaves out process-group names (see `compiled`).
        self.compiled = torch.compile(
            cls.call, dynamic=False, options={"fx_graph_cache": False}
        )
        self.error = None

    def __call__(self, layer, *args, **kwargs):
        if self.error is not None:
            return self.cls.call(layer, *args, **kwargs)
        try:
            return self.compiled(layer, *args, **kwargs)
        except Exception as error:
            if unrecoverable_cause(error) is not None:
                raise
            # As for the compiled forward: every rank fails alike here, and
            # a block's forward changes no state but in-forward updates.
            outputs = self.cls.call(layer, *args, **kwargs)
            self.error = error
            warn_once(
                ("jit-compile-block-fallback", self.cls.__name__),
                "jit_compile=True: torch.compile could not run the blocks of "
                "class %s (%s); they run eagerly from now on, with the same "
                "numbers. To silence this, compile the model with "
                "jit_compile=False.",
                self.cls.__name__,
                why_not_compiled(error),
            )
            return outputs


# Errors a compiled call must not fall back from: running out of (GPU)
# memory, and torch.distributed's errors (DistError: DistBackendError from
# NCCL / gloo and the watchdog, DistNetworkError, DistStoreError). Both hit
# one rank only (an OOM) or leave the ranks' collectives out of step, and
# are not torch.compile's fault.
UNRECOVERABLE = tuple(
    cls
    for cls in (
        getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError,
        getattr(dist, "DistError", None),
    )
    if cls is not None
)


def unrecoverable_cause(error):
    """The out-of-memory or torch.distributed error in `error`'s chain of
    causes (dynamo and Keras wrap the error raised inside), or None."""
    seen = []
    while error is not None and not any(error is e for e in seen):
        if isinstance(error, UNRECOVERABLE):
            return error
        seen.append(error)
        error = error.__cause__ or error.__context__
    return None


def why_not_compiled(error):
    """ "Type: message" of the error behind a failed compilation: the
    innermost of its causes (torch wraps the model's own error in its
    tracing errors, Keras in a layer-call error), with the outer type."""
    root = innermost(error)
    text = f"{type(root).__name__}: {first_line(root) or 'no message'}"
    if root is not error:
        text = f"{type(error).__name__}, caused by {text}"
    return text
