"""Variables sharded on the batch axis: FSDP / ZeRO-3, the SimpleFSDP way.

The batch axis of a mesh is always data: processes at different coordinates
of it hold different rows of the global batch. A variable whose layout also
shards a dim on the batch axis is stored sharded there (with its optimizer
slots), and gathered along the batch axis for each use inside a layer call:

    stored (Shard(d) on batch, p on model axes)
      -> redistribute to Replicate on batch      all-gather; its backward is a
                                                 reduce-scatter of the gradient
      -> to_local(grad_placements=Partial on batch)   the gradients of the
                                                 replicas' rows are partial sums
      -> x (this replica's weight: batch weight / replicas)   average over rows
      -> a plain tensor, or a DTensor of the model axes (p kept) when the
         layout also shards a model axis (FSDP composed with tensor parallelism)

This is torchtitan's SimpleFSDP (`redistribute` + `to_local(grad_placements=)`)
on DTensor's own collectives: compute stays on local tensors, the gradient
arrives reduce-scattered and averaged in the variable's own layout, so the
trainer leaves it alone. Outside layer calls (the optimizer, saving, user
code) a variable is its stored sharded DTensor, whose global value is the
model's.

Inside a layer call that is an FSDP group (`_fsdp.groups`), variables are
not gathered one by one: the group's variables come from one flat
all-gather, their gradients go back in one flat reduce-scatter. The
per-variable path here serves the rest (variables read outside a group,
dims sharded on two axes, the compiled forward).

Gathered weights are not kept for backward: while a training forward runs
(`regathering_in_backward`), tensors that autograd saves which are views of a
gathered weight are replaced by a token, and gathered again when backward
needs them (a whole group at once, the next group prefetched), so the peak
is the shards plus the groups in use, as FSDP2's reshard-after-forward
gives.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_torch_distribution import _env
from keras_torch_distribution._distributed import layouts
from keras_torch_distribution._distributed import replicas
from keras_torch_distribution._distributed import tensors
from keras_torch_distribution._processes import runtime

if TYPE_CHECKING:
    from collections.abc import Iterator
    from collections.abc import Sequence

    import keras
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement


@dataclass(frozen=True)
class GatherPlan:
    """How one variable layout is gathered along the batch axis."""

    mesh: DeviceMesh  # the variable's torch DeviceMesh
    # the variable's placements (Shard on the batch axis)
    stored: tuple[Placement, ...]
    # the same with Replicate on the batch axis
    gathered: tuple[Placement, ...]
    grad: tuple[Placement, ...]  # the same with Partial on the batch axis
    replicas: int  # the batch axis' size
    shape: tuple[int, ...]  # the variable's global shape
    plain: bool  # nothing sharded once gathered: use a plain tensor
    axis: int  # the batch axis' index in the mesh
    dim: int  # the dim the batch axis shards
    # The gathered value as layers compute with it: on the mesh of the
    # other axes, with their placements (`layouts.compute_layout`).
    compute: layouts.TorchLayout
    # Only Shard and Replicate placements, and no other axis shards `dim`:
    # the local shard is a `torch.chunk` piece of the gathered local
    # tensor, so it can travel in a group's flat all-gather (_fsdp.groups).
    groupable: bool

    @property
    def group(self) -> ProcessGroup:
        """The process group of the batch axis."""
        return self.mesh.get_group(self.axis)

    def gather(
        self, value: DTensor, raw: DTensor | None = None
    ) -> torch.Tensor:
        """`value` (a DTensor of `stored`) whole along the batch axis, for
        computing on this replica's rows. `raw`: the variable's stored
        value when `value` is its autocast (mixed precision): then the
        gather carries `value`'s dtype and the gradient is reduced in
        `raw`'s (`_LowGatherFullReduce`). Collective: call on every rank."""
        factor = replicas.gradient_factor(self.replicas)
        if (
            raw is not None
            and raw.dtype != value.dtype
            and torch.is_grad_enabled()
            and raw.requires_grad
        ):
            local = _LowGatherFullReduce.apply(raw, self, value.dtype, factor)
        else:
            gathered = value.redistribute(self.mesh, self.gathered)
            local = gathered.to_local(grad_placements=self.grad)
            if torch.is_grad_enabled() and local.requires_grad:
                local = _ReplicaWeight.apply(local, factor)
        if self.plain:
            return local
        return self.as_model_dtensor(local)

    def as_model_dtensor(self, local: torch.Tensor) -> DTensor:
        """`local`, this rank's gathered block, as a DTensor of `gathered`
        (sharded on the model axes only) on the mesh of those axes
        (`compute`: the batch axis is data, see `layouts.compute_layout`)."""
        return DTensor.from_local(
            local,
            self.compute.mesh,
            self.compute.placements,
            run_check=False,
            shape=torch.Size(self.shape),
            stride=layouts.contiguous_stride(self.shape),
        )


class FsdpState:
    """Whether any variable is gathered for use, and the regatherer of the
    training forward in progress."""

    def __init__(self):
        self.clear()

    def clear(self):
        # True once a variable of this process is sharded on the batch
        # axis: until then layer calls skip the regathering hooks.
        self.plans_exist = False
        self.regatherer = None
        # The group calls in progress (_fsdp.groups), innermost last: a
        # variable read inside one takes its value from the group's gather.
        self.groups = []


state = FsdpState()


def plans_exist() -> bool:
    """True once a variable of this process is sharded on the batch axis."""
    return state.plans_exist


def plan_for(
    torch_layout: layouts.TorchLayout,
    shape: Sequence[int],
    batch_axis: str | None,
) -> GatherPlan | None:
    """The GatherPlan of a variable of `shape` and `torch_layout` on a mesh
    whose batch axis is named `batch_axis`; None when the layout does not
    shard that axis (or the axis has one coordinate)."""
    names = tuple(torch_layout.mesh.mesh_dim_names or ())
    if batch_axis not in names:
        return None
    index = names.index(batch_axis)
    replicas = torch_layout.mesh.size(index)
    stored = tuple(torch_layout.placements)
    if replicas == 1 or not isinstance(stored[index], Shard):
        return None
    gathered = stored[:index] + (Replicate(),) + stored[index + 1 :]
    grad = stored[:index] + (Partial(),) + stored[index + 1 :]
    dim = stored[index].dim
    others = stored[:index] + stored[index + 1 :]
    groupable = all(type(p) in (Shard, Replicate) for p in stored) and not any(
        isinstance(p, Shard) and p.dim == dim for p in others
    )
    compute = layouts.compute_layout(
        layouts.without_axis(torch_layout, batch_axis), batch_axis
    )
    state.plans_exist = True
    return GatherPlan(
        mesh=torch_layout.mesh,
        stored=stored,
        gathered=gathered,
        grad=grad,
        replicas=replicas,
        shape=tuple(int(n) for n in shape),
        plain=all(isinstance(p, Replicate) for p in gathered),
        axis=index,
        dim=dim,
        compute=compute,
        groupable=groupable,
    )


class _ReplicaWeight(torch.autograd.Function):
    """Identity forward; the gradient is multiplied by this replica's weight
    (its rows' share of the global batch) before the batch axis sums it."""

    @staticmethod
    def forward(ctx, value, factor):
        ctx.factor = factor
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        # A plain gathered weight used with DTensors gets a DTensor gradient.
        return tensors.full_value(grad) * ctx.factor, None


class _LowGatherFullReduce(torch.autograd.Function):
    """Mixed precision as FSDP2's MixedPrecisionPolicy(param_dtype=dtype,
    reduce_dtype=the stored dtype), the policy of the grouped path too
    (`_fsdp.groups`): the stored shard (float32) is cast to `dtype` (Keras'
    autocast: bfloat16) and all-gathered in it; the gradient (in `dtype`)
    is cast back, scaled by this replica's weight and reduce-scattered in
    the stored dtype. Keras' own autocast before a DTensor gather would
    reduce the gradient in `dtype` (a bfloat16 sum over replicas)."""

    @staticmethod
    def forward(ctx, raw, plan, dtype, factor):
        ctx.plan, ctx.factor, ctx.stored_dtype = plan, factor, raw.dtype
        gathered = raw.to(dtype).redistribute(plan.mesh, plan.gathered)
        return gathered.to_local()

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        # A plain gathered weight used with DTensors gets a DTensor gradient.
        grad = tensors.full_value(grad).to(ctx.stored_dtype)
        if ctx.factor != 1.0:
            grad = grad * ctx.factor
        partial = DTensor.from_local(
            grad.contiguous(),
            plan.mesh,
            plan.grad,
            run_check=False,
            shape=torch.Size(plan.shape),
            stride=layouts.contiguous_stride(plan.shape),
        )
        return partial.redistribute(plan.mesh, plan.stored), None, None, None


def storage_key(local: torch.Tensor) -> int:
    """The key under which `_Regatherer` finds a saved view of a gathered
    weight: its storage's data pointer. `ktd plan`'s step on fake tensors
    (`plan._fake_step`), whose data pointers are all 0, replaces this
    function with the storage's identity for its duration."""
    return local.untyped_storage().data_ptr()


class _Regatherer:
    """Saved-tensor hooks that keep no gathered weight between forward and
    backward: a saved view of a gathered weight becomes a token, gathered
    again when backward unpacks it (the same collectives on every rank, in
    autograd's order).

    What a token is gathered from is its source: a group's flat gather
    (`_fsdp.groups`, one collective for the whole group, kept until the
    group's gradients are reduce-scattered) or one variable's DTensor
    redistribute (`_VariableSource`). Sources that backward will gather
    again (a token was packed) are kept in the order of the forward; when
    backward regathers one, the regathers of the sources before it
    (backward's next) are started too, up to KTD_FSDP_PREFETCH in
    flight."""

    def __init__(self, prefetch):
        self.prefetch = prefetch
        # storage_key of a gathered local tensor ->
        #   (weakref to it, its storage offset, source, key for the source)
        self.gathered = {}
        # The sources of the tokens packed, in the order of their first.
        self.sources = []
        self.position = {}  # id(source) -> its index in `sources`

    def register(self, view, source, key=None):
        local = view._local_tensor if isinstance(view, DTensor) else view
        if local.numel() == 0 or not local.is_contiguous():
            return
        self.gathered[storage_key(local)] = (
            weakref.ref(local),
            local.storage_offset(),
            source,
            key,
        )

    def pack(self, tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if local.layout != torch.strided or local.numel() == 0:
            return tensor
        entry = self.gathered.get(storage_key(local))
        if entry is None or entry[0]() is None:
            return tensor
        _, base_offset, source, key = entry
        if id(source) not in self.position:  # backward will regather it
            self.position[id(source)] = len(self.sources)
            self.sources.append(source)
        is_dtensor = isinstance(tensor, DTensor)
        return _Token(
            self,
            source,
            key,
            tensor.device_mesh if is_dtensor else None,
            tensor.placements if is_dtensor else None,
            tuple(tensor.shape),
            tensor.stride() if is_dtensor else None,
            (
                tuple(local.shape),
                local.stride(),
                local.storage_offset() - base_offset,
            ),
        )

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, _Token):
            return packed
        return packed.restore()

    def regathered(self, source, key):
        """The local tensor `source` gathers for `key`, its regather started
        now if need be, with the next sources' regathers prefetched.
        Collective: call on every rank."""
        # Copied out before the next regather starts, so that one group's
        # flat buffer at most is alive beside the group in use.
        regathered = source.regathered(key)
        position = self.position.get(id(source))
        if position is not None and self.prefetch:
            in_flight = 0
            for earlier in reversed(self.sources[:position]):
                if in_flight >= self.prefetch:
                    break
                if earlier.in_flight():
                    in_flight += 1
                elif earlier.prefetchable():
                    earlier.start_regather()
                    in_flight += 1
        return regathered


class _VariableSource:
    """One variable's gathered value, gathered again on its own (a DTensor
    redistribute of `stored` in `dtype`): variables outside any group."""

    def __init__(self, stored, plan, dtype=None):
        self.stored = stored
        self.plan = plan
        self.dtype = dtype

    def start_regather(self):
        pass

    def in_flight(self):
        return False

    def prefetchable(self):
        return False

    def regathered(self, key):
        with torch.no_grad():
            stored = (
                self.stored
                if self.dtype is None
                else self.stored.to(self.dtype)
            )
            whole = stored.redistribute(self.plan.mesh, self.plan.gathered)
            return whole.to_local().contiguous()


@dataclass
class _Token:
    """What backward needs to gather a saved weight view again."""

    regatherer: _Regatherer
    source: object
    key: object
    mesh: object  # of the saved DTensor; None for a plain tensor
    placements: tuple  # of the saved DTensor; None for a plain tensor
    global_shape: tuple
    global_stride: tuple
    local_geometry: tuple  # (size, stride, offset from the gathered base)

    def restore(self):
        base = self.regatherer.regathered(self.source, self.key)
        size, stride, offset = self.local_geometry
        view = base.as_strided(size, stride, base.storage_offset() + offset)
        if self.placements is None:
            return view
        return DTensor.from_local(
            view,
            self.mesh,
            self.placements,
            run_check=False,
            shape=torch.Size(self.global_shape),
            stride=self.global_stride,
        )


def prefetch_depth() -> int:
    """How many FSDP groups may be gathered ahead of the one in use
    (KTD_FSDP_PREFETCH). By default 1 on CUDA, where a gather on its own
    stream overlaps compute; 0 on CPU, where gloo's collective threads
    share the cores with compute, so that a prefetched group costs its
    memory and overlaps nothing measurable."""
    return _env.fsdp_prefetch(default=1 if runtime.uses_cuda() else 0)


@contextlib.contextmanager
def regathering_in_backward() -> Iterator[None]:
    """Within the block (a training forward), saved views of gathered
    weights are gathered again in backward instead of being kept."""
    if (
        state.regatherer is not None
        or not torch.is_grad_enabled()
        or torch.compiler.is_compiling()
    ):
        yield
        return
    regatherer = _Regatherer(prefetch_depth())
    state.regatherer = regatherer
    try:
        with torch.autograd.graph.saved_tensors_hooks(
            regatherer.pack, regatherer.unpack
        ):
            yield
    finally:
        state.regatherer = None
        regatherer.gathered.clear()


def gather_for_use(
    stored: DTensor,
    plan: GatherPlan,
    variable: keras.Variable | None = None,
    raw: DTensor | None = None,
) -> torch.Tensor:
    """`stored` (a variable's value, after Keras' autocast) gathered along
    the batch axis: from the flat gather of a group in progress that holds
    `variable` (see `_fsdp.groups`), else on its own (see GatherPlan.gather;
    `raw`: the variable's stored value before autocast, for mixed
    precision's full-precision gradient reduction), noted for regathering
    in backward when a training forward is in progress. Collective: call on
    every rank."""
    for call in reversed(state.groups):
        gathered = call.value_for(variable, stored.dtype)
        if gathered is not None:
            return gathered
    view = plan.gather(stored, raw)
    regatherer = state.regatherer
    if regatherer is not None and view.requires_grad:
        if raw is not None and raw.dtype != stored.dtype:
            source = _VariableSource(raw.detach(), plan, stored.dtype)
        else:
            source = _VariableSource(stored, plan)
        regatherer.register(view, source)
    return view


def gather_plan(variable: keras.Variable) -> GatherPlan | None:
    """The FSDP GatherPlan of a variable sharded on the batch axis, else
    None."""
    return getattr(variable, "_ktd_gather", None)
