"""DTensor rules for attention (every SDPA op, masks included), index
writes (`x[index] = value`) and Keras' slice/scatter updates meeting
DTensors, against one process.

The CUDA attention kernels cannot run on CPU: their rules are checked
against the ops' schemas (one placement per tensor argument and result)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras_torch_distribution._distributed import attention_rules
from keras_torch_distribution._distributed import sharding_rules

B, H, L, D = 4, 2, 8, 4


def _spec(shape, placements=(Replicate(),), mesh_shape=(2,)):
    return SimpleNamespace(
        tensor_meta=SimpleNamespace(shape=tuple(shape)),
        placements=tuple(placements),
        mesh=SimpleNamespace(shape=tuple(mesh_shape)),
    )


def _arguments(op, mask_shape):
    """Positional args and kwargs for `op`'s rule: specs for its tensors
    (a mask of `mask_shape` where it takes one, None for no mask)."""
    args, kwargs = [], {}
    for argument in op._schema.arguments:
        kind = str(argument.type)
        role = attention_rules._ARGUMENT_ROLES.get(argument.name)
        if role == attention_rules.MASK:
            value = None if mask_shape is None else _spec(mask_shape)
        elif "Tensor" in kind:
            value = _spec(
                (B, H, L, D) if role == attention_rules.HEADS else (2,)
            )
        elif "bool[" in kind:
            value = [True] * 4
        elif "bool" in kind:
            value = False
        elif "float" in kind:
            value = 0.0
        else:
            value = L
        if argument.kwarg_only:
            kwargs[argument.name] = value
        else:
            args.append(value)
    return args, kwargs


@pytest.mark.parametrize("op", attention_rules.attention_ops(), ids=str)
@pytest.mark.parametrize(
    "mask_shape", [None, (B, 1, L, L), (B, H, L, L), (L, L)]
)
def test_attention_rules_place_every_tensor_of_the_schema(op, mask_shape):
    takes_mask = any(
        attention_rules._ARGUMENT_ROLES.get(a.name) == attention_rules.MASK
        for a in op._schema.arguments
    )
    if mask_shape is not None and not takes_mask:
        pytest.skip(f"{op} takes no mask")
    args, kwargs = _arguments(op, mask_shape)
    options = attention_rules.attention_rule(op)(*args, **kwargs)
    tensors = [
        name
        for name, value in zip(
            [a.name for a in op._schema.arguments], args + list(kwargs.values())
        )
        if value is not None and hasattr(value, "tensor_meta")
    ]
    mask_name = next(
        (n for n in ("attn_mask", "attn_bias") if n in tensors), None
    )
    assert all(p == Replicate() for p in options[0][1] if p is not None)
    if mask_name is None or mask_name not in kwargs:
        assert len(options) == 3, (
            options
        )  # replicated, sharded on batch, on heads
    for outputs, inputs in options:
        assert len(outputs) == len(op._schema.returns), (op, outputs)
        placed = [
            n
            for n, p in zip([a.name for a in op._schema.arguments], inputs)
            if p is not None
        ]
        assert placed == tensors, (op, inputs)
    if mask_name is None or mask_name in kwargs:
        return
    # A positional mask follows the heads where it spans them, and is
    # replicated where it broadcasts (the kwarg masks keep their placement).
    names = [a.name for a in op._schema.arguments]
    by_strategy = {
        repr(inputs[names.index("query")]): inputs[names.index(mask_name)]
        for _, inputs in options
    }
    heads = by_strategy[repr(Shard(1))]
    assert heads == (Shard(1) if mask_shape[-3:-2] == (H,) else Replicate()), (
        mask_shape
    )


def test_a_kwarg_mask_keeps_its_placement():
    """DTensor does not reshard kwargs: the CPU kernel's attn_mask must be
    used where it is, so only strategies that keep it are offered."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    rule = attention_rules.attention_rule(op)
    q = _spec((B, H, L, D))
    replicated_full = rule(q, q, q, attn_mask=_spec((B, H, L, L)))
    assert [o[1][0] for o in replicated_full] == [Replicate()]
    broadcast = rule(q, q, q, attn_mask=_spec((B, 1, L, L)))
    assert [o[1][0] for o in broadcast] == [Replicate(), Shard(1)]
    batch_sharded = rule(q, q, q, attn_mask=_spec((B, 1, L, L), (Shard(0),)))
    assert [o[1][0] for o in batch_sharded] == [Shard(0)]
    with pytest.raises(
        ValueError, match="placed the same way on every mesh axis"
    ):
        rule(
            q, q, q, attn_mask=_spec((B, H, L, L), (Shard(0), Shard(1)), (2, 2))
        )


def test_rules_are_registered_and_cached_by_mask():
    propagator = DTensor._op_dispatcher.sharding_propagator
    registered = []
    for op in attention_rules.attention_ops():
        # torch's own single-dim strategy (CUDA attention on torch>=2.14)
        # takes precedence over any rule: ours is registered only elsewhere.
        if op in propagator.op_single_dim_strategy_funcs:
            assert op not in sharding_rules.registration.strategies, op
        else:
            assert op in propagator.op_strategy_funcs, op
            registered.append(op)
    assert (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        in registered
    )
    info = propagator.op_to_schema_info[
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    ]
    assert "attn_mask" in info.static_kwargkey


# ---------------------------------------------------------------------------
# Two processes
# ---------------------------------------------------------------------------


def attention_cases(cases):
    """F.scaled_dot_product_attention on DTensors: (placements, forward and
    gradient errors against plain tensors) per (mask shape, q/k/v placement,
    mask placement or None for a plain mask)."""
    import keras
    import torch.nn.functional as F
    from torch.distributed.tensor import distribute_tensor

    mesh = keras.distribution.DeviceMesh(
        (2,), ["model"], keras.distribution.list_devices()
    )
    results = []
    for mask_shape, dim, mask_dim in cases:
        torch.manual_seed(0)
        plain = [torch.randn(B, H, L, D, requires_grad=True) for _ in range(3)]
        mask = torch.where(torch.rand(*mask_shape) > 0.3, 0.0, -1e9)
        mask[..., 0] = 0.0
        want = F.scaled_dot_product_attention(*plain, attn_mask=mask)
        want.sum().backward()
        sharded = [
            distribute_tensor(
                t.detach(), mesh.backend_mesh, [Shard(dim)]
            ).requires_grad_()
            for t in plain
        ]
        if mask_dim is not None:
            mask = distribute_tensor(mask, mesh.backend_mesh, [Shard(mask_dim)])
        got = F.scaled_dot_product_attention(*sharded, attn_mask=mask)
        got.sum().backward()
        results.append(
            (
                str(tuple(got.placements)),
                float((got.full_tensor() - want).abs().max()),
                max(
                    float((s.grad.full_tensor() - p.grad).abs().max())
                    for s, p in zip(sharded, plain)
                ),
            )
        )
    return results


ATTENTION_CASES = [
    (
        (B, 1, L, L),
        1,
        None,
        "(Shard(dim=1),)",
    ),  # broadcast over heads: stays sharded
    ((L, L), 0, None, "(Shard(dim=0),)"),
    ((B, 1, L, L), 0, None, "(Replicate(),)"),  # plain batch mask: gathered
    ((B, H, L, L), 1, None, "(Replicate(),)"),
    (
        (B, 1, L, L),
        0,
        0,
        "(Shard(dim=0),)",
    ),  # a sharded mask keeps the batch sharded
    ((B, H, L, L), 1, 1, "(Shard(dim=1),)"),
]


def test_masked_attention_on_dtensors_matches_plain(pool2):
    cases = [case[:3] for case in ATTENTION_CASES]
    for results in pool2.run(attention_cases, cases):
        for (mask_shape, dim, mask_dim, placements), (
            got,
            forward,
            backward,
        ) in zip(ATTENTION_CASES, results):
            where = (mask_shape, dim, mask_dim)
            assert got == placements, where
            assert forward < 1e-5 and backward < 1e-5, (
                where,
                forward,
                backward,
            )


def updates_into_plain():
    """keras.ops.slice_update / scatter_update with plain inputs and DTensor
    updates or indices, as keras_hub's cached attention and samplers do."""
    import keras
    from torch.distributed.tensor import distribute_tensor

    mesh = keras.distribution.DeviceMesh(
        (2,), ["model"], keras.distribution.list_devices()
    )
    cache = torch.zeros(2, 6, 4)
    update = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 4)
    heads = distribute_tensor(update, mesh.backend_mesh, [Shard(2)])
    index = distribute_tensor(torch.tensor(3), mesh.backend_mesh, [Replicate()])
    sliced = keras.ops.slice_update(cache, [0, 1, 0], heads)
    at_index = keras.ops.slice_update(cache, [0, index, 0], update)
    rows = distribute_tensor(torch.ones(2, 4), mesh.backend_mesh, [Shard(0)])
    scattered = keras.ops.scatter_update(torch.zeros(5, 4), [[1], [3]], rows)
    # keras_hub's cached attention: heads-sharded keys written at a tensor
    # position (Keras flattens them for index_put_).
    keys = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 1, 2, 4)
    sharded_keys = distribute_tensor(keys, mesh.backend_mesh, [Shard(2)])
    at_position = keras.ops.slice_update(
        torch.zeros(2, 6, 2, 4), [0, index, 0, 0], sharded_keys
    )
    return [
        (type(t).__name__, np.asarray(keras.ops.convert_to_numpy(t)))
        for t in (sliced, at_index, scattered, at_position)
    ]


def test_slice_and_scatter_updates_write_dtensors_into_plain_tensors(pool2):
    cache = np.zeros((2, 6, 4), "float32")
    update = np.arange(16, dtype="float32").reshape(2, 2, 4)
    want_sliced = cache.copy()
    want_sliced[:, 1:3] = update
    want_index = cache.copy()
    want_index[:, 3:5] = update
    want_scattered = np.zeros((5, 4), "float32")
    want_scattered[[1, 3]] = 1.0
    want_position = np.zeros((2, 6, 2, 4), "float32")
    want_position[:, 3:4] = np.arange(16, dtype="float32").reshape(2, 1, 2, 4)
    for sliced, at_index, scattered, at_position in pool2.run(
        updates_into_plain
    ):
        assert sliced[0] == "DTensor" and scattered[0] == "DTensor"
        np.testing.assert_array_equal(sliced[1], want_sliced)
        np.testing.assert_array_equal(at_index[1], want_index)
        np.testing.assert_array_equal(scattered[1], want_scattered)
        assert at_position[0] == "DTensor"
        np.testing.assert_array_equal(at_position[1], want_position)


# (name, self shape, indices as (dim or None, values) per entry, values
# shape, accumulate): rows, rows into a broadcast value, rows accumulated
# twice, a later dim, two dims side by side, two dims apart (the indexed
# dims go first in values), a boolean mask of rows.
INDEX_WRITES = [
    ("rows", (5, 4), ([1, 3],), (2, 4), False),
    ("broadcast", (5, 4), ([1, 3],), (1, 4), False),
    ("accumulate", (5, 4), ([1, 1, 3],), (3, 4), True),
    ("later dim", (2, 6, 4), (None, [1, 3]), (2, 2, 4), False),
    ("side by side", (4, 5, 4), ([1, 3], [0, 2]), (2, 4), False),
    ("apart", (4, 4, 6), ([1, 3], None, [0, 5]), (2, 4), False),
    ("mask", (5, 4), ([True, False, True, False, False],), (2, 4), False),
]


def index_writes():
    """aten.index_put / index_put_ (`x[index] = value`, Keras'
    scatter_update) on DTensors of each placement, values plain or placed:
    (case, self placement, values placement, in place, result placements
    or the error, error against plain tensors)."""
    mesh = _mesh_1d()
    results = []
    for name, shape, entries, values_shape, accumulate in INDEX_WRITES:
        generator = torch.Generator().manual_seed(0)
        base = torch.randn(shape, generator=generator)
        values = torch.randn(values_shape, generator=generator)
        indices = [None if e is None else torch.tensor(e) for e in entries]
        want = torch.ops.aten.index_put.default(
            base, indices, values, accumulate
        )
        self_placements = [Replicate()] + [Shard(d) for d in range(len(shape))]
        values_placements = [None, Replicate()] + [
            Shard(d)
            for d in range(len(values_shape))
            if values_shape[d] % 2 == 0
        ]
        for self_placement in self_placements:
            for values_placement in values_placements:
                for in_place in (False, True):
                    x = distribute_tensor(base.clone(), mesh, [self_placement])
                    v = (
                        values
                        if values_placement is None
                        else distribute_tensor(values, mesh, [values_placement])
                    )
                    op = (
                        torch.ops.aten.index_put_
                        if in_place
                        else torch.ops.aten.index_put
                    )
                    where = (
                        name,
                        repr(self_placement),
                        repr(values_placement),
                        in_place,
                    )
                    try:
                        got = op.default(x, indices, v, accumulate)
                    except RuntimeError as error:
                        results.append((*where, f"RuntimeError: {error}", None))
                        continue
                    error = float((got.full_tensor() - want).abs().max())
                    results.append((*where, repr(tuple(got.placements)), error))
    return results


def _mesh_1d():
    import keras

    return keras.distribution.DeviceMesh(
        (2,), ["model"], keras.distribution.list_devices()
    ).backend_mesh


def test_index_writes_into_dtensors_match_plain(pool2):
    """Every write gives the plain tensors' numbers. A tensor sharded on a
    dim it is not indexed on keeps its placement; one sharded on an indexed
    dim is replicated for an out-of-place write, and an in-place write into
    it is refused (it cannot keep its placement): never wrong rows."""
    indexed_dims = {
        name: {d for d, e in enumerate(entries) if e is not None}
        for name, _, entries, _, _ in INDEX_WRITES
    }
    for results in pool2.run(index_writes):
        assert len(results) == 188, len(results)
        for (
            name,
            self_placement,
            values_placement,
            in_place,
            got,
            error,
        ) in results:
            where = (name, self_placement, values_placement, in_place)
            on_indexed = any(
                self_placement == repr(Shard(d)) for d in indexed_dims[name]
            )
            if got.startswith("RuntimeError"):
                assert in_place and on_indexed, (where, got)
                continue
            assert error < 1e-6, (where, got, error)
            if self_placement.startswith("Shard") and not on_indexed:  # kept
                assert got == f"({self_placement},)", (where, got)


def stacks():
    """torch.stack of DTensors sharded on each dim, at each dim (negative
    ones included): (dims, placements, error against plain tensors)."""
    mesh = _mesh_1d()
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(4, 2, 6, generator=generator) for _ in range(2)]
    results = []
    for shard_dim in range(3):
        sharded = [
            distribute_tensor(p, mesh, [Shard(shard_dim)]) for p in plain
        ]
        for dim in range(-4, 4):
            got = torch.stack(sharded, dim=dim)
            want = torch.stack(plain, dim=dim)
            full = got.full_tensor()
            error = (
                float((full - want).abs().max())
                if full.shape == want.shape
                else float("inf")
            )
            results.append(
                ((shard_dim, dim), repr(tuple(got.placements)), error)
            )
    return results


def test_stack_of_sharded_tensors_matches_plain(pool2):
    """torch<2.13 normalised stack's negative dim against the inputs' rank:
    stacking at dim=-2 tensors sharded on dim 2 (keras_hub's rotary
    embedding of heads-sharded queries) came out labelled Shard(3)."""
    for results in pool2.run(stacks):
        assert len(results) == 24
        for (shard_dim, dim), placements, error in results:
            inserted = dim % 4
            want = shard_dim + 1 if shard_dim >= inserted else shard_dim
            assert placements == repr((Shard(want),)), (
                shard_dim,
                dim,
                placements,
            )
            assert error == 0.0, (shard_dim, dim, error)


# squeeze arguments: none, one dim, several (negative ones included).
SQUEEZES = [
    (),
    (0,),
    (1,),
    (-1,),
    ((0, 1),),
    ((0, 2),),
    ((0, 1, 2, 3, 4),),
    ((-5, -3),),
]


def squeezes():
    """torch.squeeze of a (1, 2, 3, 1, 4) DTensor sharded on each dim (2
    over 2 processes: blocks of one entry; 3 over 2: 2 and 1): (dim,
    arguments, placements, error against the plain tensor)."""
    mesh = _mesh_1d()
    plain = torch.randn(
        1, 2, 3, 1, 4, generator=torch.Generator().manual_seed(0)
    )
    results = []
    for shard_dim in (1, 2, 4):
        sharded = distribute_tensor(plain, mesh, [Shard(shard_dim)])
        for args in SQUEEZES:
            got = torch.squeeze(sharded, *args)
            want = torch.squeeze(plain, *args)
            full = got.full_tensor()
            error = (
                float((full - want).abs().max())
                if full.shape == want.shape
                else float("inf")
            )
            results.append(
                (shard_dim, args, repr(tuple(got.placements)), error)
            )
    return results


def test_squeeze_of_sharded_tensors_matches_plain(pool2):
    """torch<2.13 has no squeeze.dims strategy (Keras' BatchNormalization
    squeezes its moments by axes), and its squeeze drops a sharded dim whose
    local block has one entry."""
    for results in pool2.run(squeezes):
        assert len(results) == 3 * len(SQUEEZES)
        for shard_dim, args, placements, error in results:
            assert error == 0.0, (shard_dim, args, placements, error)
            if shard_dim == 4:  # 4 over 2 never squeezed: stays sharded
                assert placements.startswith("(Shard(dim="), (args, placements)
