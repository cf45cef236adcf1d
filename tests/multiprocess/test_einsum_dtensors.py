"""Keras' einsum on DTensors sharded on any one dim (keras_hub's attention
and MoE equations), forward and gradients, against plain tensors.

torch<2.13 cannot flatten dims of which a later one is sharded; the
package's einsum puts sharded dims first (`einsum_grad.sharded_dims_first`).
"""

import itertools

import numpy as np

# equation: operand shapes (each sharded dim of size 4 or 2, even on 2 ranks)
EQUATIONS = {
    "bquh,uhm->bqm": ((2, 3, 4, 2), (4, 2, 6)),  # attention output
    "bqm,muh->bquh": ((2, 3, 6), (6, 4, 2)),  # query projection
    "btkgh,bskh->bkgts": ((2, 3, 2, 4, 2), (2, 5, 2, 2)),  # Gemma's logits
    "bkgts,bskh->btkgh": ((2, 2, 4, 3, 5), (2, 5, 2, 2)),  # Gemma's values
    "ebc,ecd->ebd": ((4, 3, 2), (4, 2, 6)),  # MoE experts
}


def _reference(equation, table):
    """(a (2,) torch mesh, the operand shapes, plain operands, their einsum,
    a gradient for it, the operands' gradients) for `equation` of
    `table`."""
    import keras
    import torch

    mesh = keras.distribution.DeviceMesh(
        (2,), ["model"], keras.distribution.list_devices()
    ).backend_mesh
    shapes = table[equation]
    generator = torch.Generator().manual_seed(0)
    plain = [
        torch.randn(s, generator=generator).requires_grad_() for s in shapes
    ]
    want = keras.ops.einsum(equation, *plain)
    grad = torch.randn(want.shape, generator=generator)
    want_grads = torch.autograd.grad(want, plain, grad)
    return mesh, shapes, plain, want, grad, want_grads


def einsums(equation):
    """(sharded dims, forward error, gradient error) for one sharded dim
    (of even size) per operand, or none, against plain tensors."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    mesh, shapes, plain, want, grad, want_grads = _reference(
        equation, EQUATIONS
    )
    choices = [
        [None] + [d for d in range(len(s)) if s[d] % 2 == 0] for s in shapes
    ]
    results = []
    for dims in itertools.product(*choices):
        sharded = [
            distribute_tensor(
                p.detach(), mesh, [Replicate() if d is None else Shard(d)]
            ).requires_grad_()
            for p, d in zip(plain, dims)
        ]
        got = keras.ops.einsum(equation, *sharded)
        full = got.full_tensor() if hasattr(got, "full_tensor") else got
        grads = torch.autograd.grad(
            got,
            sharded,
            distribute_tensor(grad, mesh, [Replicate()])
            if hasattr(got, "full_tensor")
            else grad,
        )
        results.append(
            (
                dims,
                float((full - want).abs().max()),
                max(
                    float((g.full_tensor() - w).abs().max())
                    for g, w in zip(grads, want_grads)
                ),
            )
        )
    return results


def sharded_gradients(equation):
    """(dim, gradient error) for replicated operands whose output's
    gradient arrives sharded on `dim` (Qwen's attention: replicated
    heads, an output kernel sharded on them)."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    mesh, shapes, plain, want, grad, want_grads = _reference(
        equation, EQUATIONS
    )
    results = []
    for dim in range(want.ndim):
        if want.shape[dim] % 2:
            continue
        replicated = [
            distribute_tensor(p.detach(), mesh, [Replicate()]).requires_grad_()
            for p in plain
        ]
        got = keras.ops.einsum(equation, *replicated)
        grads = torch.autograd.grad(
            got, replicated, distribute_tensor(grad, mesh, [Shard(dim)])
        )
        results.append(
            (
                dim,
                max(
                    float((g.full_tensor() - w).abs().max())
                    for g, w in zip(grads, want_grads)
                ),
            )
        )
    return results


def test_einsum_of_sharded_operands_matches_plain(pool2):
    for equation, shapes in EQUATIONS.items():
        for results in pool2.run(einsums, equation):
            assert len(results) == np.prod(
                [1 + sum(n % 2 == 0 for n in s) for s in shapes]
            ), equation
            for dims, forward, backward in results:
                assert forward < 1e-5 and backward < 1e-5, (
                    equation,
                    dims,
                    forward,
                    backward,
                )


def test_einsum_gradient_sharded_where_its_output_was_not_matches_plain(pool2):
    for equation in EQUATIONS:
        for results in pool2.run(sharded_gradients, equation):
            assert results, equation
            for dim, error in results:
                assert error < 1e-5, (equation, dim, error)


# Qwen MoE's expert equations with 3 experts on 2 ranks: a dim sharded
# unevenly, which torch.einsum would flatten with others (keras_hub's
# Qwen1.5 MoE, 60 experts on a model axis of 8, failed so).
UNEVEN = {
    "th,ehm->etm": ((4, 2), (3, 2, 6)),  # gate and up projections
    "eti,eih->eth": ((3, 4, 2), (3, 2, 5)),  # down projection
}


def unevenly_sharded(equation):
    """(what is sharded, forward error, gradient error) for each operand,
    then the output's gradient, sharded on a dim of size 3 (uneven on 2
    ranks), against plain tensors. The gradient cases run as under FSDP
    (`einsum_grad._Einsum`, as in the Qwen MoE that failed): torch's own
    einsum backward still refuses a gradient sharded unevenly on a dim it
    flattens."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras_torch_distribution._fsdp import gathering

    mesh, shapes, plain, want, grad, want_grads = _reference(equation, UNEVEN)
    cases = [
        (f"operand {i} dim {d}", i, d, None)
        for i, s in enumerate(shapes)
        for d in range(len(s))
        if s[d] == 3
    ] + [(f"gradient dim {d}", None, None, d) for d in range(want.ndim)]
    results = []
    for name, operand, dim, grad_dim in cases:
        if grad_dim is not None and want.shape[grad_dim] != 3:
            continue
        sharded = [
            distribute_tensor(
                p.detach(),
                mesh,
                [Shard(dim) if i == operand else Replicate()],
            ).requires_grad_()
            for i, p in enumerate(plain)
        ]
        saved = gathering.plans_exist
        if grad_dim is not None:
            gathering.plans_exist = lambda: True
        try:
            got = keras.ops.einsum(equation, *sharded)
            placements = [Replicate() if grad_dim is None else Shard(grad_dim)]
            grads = torch.autograd.grad(
                got, sharded, distribute_tensor(grad, mesh, placements)
            )
        finally:
            gathering.plans_exist = saved
        results.append(
            (
                name,
                float((got.full_tensor() - want).abs().max()),
                max(
                    float((g.full_tensor() - w).abs().max())
                    for g, w in zip(grads, want_grads)
                ),
            )
        )
    return results


def test_einsum_sharded_unevenly_on_a_flattened_dim_matches_plain(pool2):
    for equation in UNEVEN:
        for results in pool2.run(unevenly_sharded, equation):
            assert any(name.startswith("gradient") for name, *_ in results)
            for name, *errors in results:
                assert max(errors) < 1e-5, (equation, name, errors)
