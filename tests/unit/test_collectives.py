"""collectives.buckets and FlatBucket's copy back, without a process group."""

import torch

from keras_torch_distribution._distributed import collectives


def test_buckets_split_by_dtype_and_size_in_order_of_completion():
    f = [torch.zeros(256) for _ in range(4)]  # 1 KiB each
    h = [torch.zeros(256, dtype=torch.float16) for _ in range(2)]
    tensors = [f[0], h[0], f[1], f[2], h[1], f[3]]
    found = collectives.buckets(tensors, bucket_bytes=2048)
    ids = [[id(t) for t in bucket] for bucket in found]
    # float32 cut after 2 KiB; float16 never full; listed by their last tensor.
    assert ids == [
        [id(f[0]), id(f[1])],
        [id(h[0]), id(h[1])],
        [id(f[2]), id(f[3])],
    ]


def test_buckets_without_limit_one_per_dtype():
    tensors = [
        torch.zeros(3),
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(5),
    ]
    found = collectives.buckets(tensors, bucket_bytes=None)
    assert [len(b) for b in found] == [1, 2]
    assert found[0][0].dtype == torch.float64


def test_one_dtype_cut_once_a_bucket_holds_the_size():
    tensors = [torch.zeros(1024) for _ in range(5)]  # 4 KiB each
    found = collectives.buckets(tensors, bucket_bytes=8 * 1024)
    assert [len(b) for b in found] == [2, 2, 1]


def test_copy_back_skips_missing_targets():
    a, b = torch.arange(4.0).reshape(2, 2), torch.arange(4.0, 7.0)
    bucket = collectives.FlatBucket([a, b])
    bucket.flat.mul_(10)
    other = torch.zeros(3)
    bucket.copy_back([None, other])
    assert torch.equal(other, torch.tensor([40.0, 50.0, 60.0]))
    assert torch.equal(a, torch.arange(4.0).reshape(2, 2))
    bucket.copy_back()
    assert torch.equal(a, 10 * torch.arange(4.0).reshape(2, 2))


def test_unscaled_tensors_ride_in_the_last_bucket_of_their_kind(monkeypatch):
    """The metric states' fold (`metric_states`): summed with the
    gradients' last float32 bucket, not scaled; no collective of their own."""
    calls = []
    monkeypatch.setattr(
        collectives.dist,
        "all_reduce",
        lambda flat, group=None, async_op=False: calls.append(flat.numel()),
    )
    grads = [
        torch.ones(1024),
        torch.ones(1024),
        torch.ones(8, dtype=torch.float16),
    ]
    states = [torch.full((2,), 3.0)]
    collectives.all_reduce(
        grads, None, scale=0.5, bucket_bytes=4096, unscaled=states
    )
    # float32 cut after each 4 KiB gradient; the states join the second.
    assert calls == [1024, 1026, 8]
    assert torch.equal(grads[0], torch.full((1024,), 0.5))
    assert torch.equal(grads[1], torch.full((1024,), 0.5))
    assert torch.equal(states[0], torch.full((2,), 3.0))


def test_unscaled_tensors_without_a_bucket_of_their_kind_get_their_own(
    monkeypatch,
):
    calls = []
    monkeypatch.setattr(
        collectives.dist,
        "all_reduce",
        lambda flat, group=None, async_op=False: calls.append(flat.dtype),
    )
    collectives.all_reduce(
        [torch.ones(4, dtype=torch.float16)], None, unscaled=[torch.ones(2)]
    )
    assert calls == [torch.float16, torch.float32]
