"""A process group the application started without a CPU backend (as
`init_process_group("nccl")` is on a GPU machine): the package's own
collectives on CPU tensors -- ranks agreeing before fit, stopping
together, the checkpoint files' agreement and barriers (all `agreement`),
the shared shuffle's generator state (`_batch.adapter`) -- run on a gloo
side group (`runtime.cpu_group()`).

On this CPU machine the group is "cuda:gloo": gloo for CUDA tensors only,
so a CPU tensor on it fails exactly as on an NCCL-only group ("No backend
type associated with device type cpu"); each worker checks that first.
"""

import os

import pytest

from helpers import POOL_TIMEOUT_S
from helpers import free_port
from keras_torch_distribution.testing import ProcessGroupPool

pytestmark = pytest.mark.slow


def _pid():
    return os.getpid()


def _cpu_collectives_on_a_group_without_cpu(address, rank_by_pid):
    import torch
    import torch.distributed as dist

    from keras_torch_distribution._batch import adapter
    from keras_torch_distribution._distributed import agreement
    from keras_torch_distribution._processes import runtime

    rank = rank_by_pid[os.getpid()]
    dist.init_process_group(
        "cuda:gloo", init_method=f"tcp://{address}", rank=rank, world_size=2
    )
    try:
        result = {"carries_cpu": runtime.carries_cpu_tensors(dist.group.WORLD)}
        try:  # the control: the world group itself refuses CPU tensors
            dist.all_reduce(torch.zeros(1))
            result["world_refuses_cpu"] = None
        except RuntimeError as error:
            result["world_refuses_cpu"] = str(error)
        result["side_group_is_world"] = runtime.cpu_group() is dist.group.WORLD
        result["side_group_again"] = runtime.cpu_group() is runtime.cpu_group()
        result["stopping"] = agreement.ranks_with_flag(rank == 1)
        result["agreed"] = len(agreement.compare("fit()", [("x", "same")]))
        try:
            agreement.compare("fit()", [("x", f"rank {rank}")])
            result["disagreement"] = None
        except agreement.RanksDisagreeError as error:
            result["disagreement"] = str(error)
        torch.manual_seed(100 + rank)  # ranks' generators differ ...
        # ... until rank 0's is shared
        adapter._same_torch_generator_everywhere()
        result["shuffle_draw"] = torch.rand(3).tolist()
        result["files_agree"] = agreement.agree(lambda: rank)
        agreement.barrier()
        return result
    finally:
        runtime.cpu_group()  # made by now; destroyed with the world below
        dist.destroy_process_group()
        runtime._cpu_group.clear()


def test_cpu_collectives_run_on_a_gloo_side_group(tmp_path):
    pool = ProcessGroupPool(2, timeout=POOL_TIMEOUT_S, initialize=False)
    try:
        ranks = {pid: rank for rank, pid in enumerate(pool.run(_pid))}
        results = pool.run(
            _cpu_collectives_on_a_group_without_cpu,
            f"127.0.0.1:{free_port()}",
            ranks,
        )
    finally:
        pool.close()
    for rank, result in enumerate(results):
        assert result["carries_cpu"] is False
        assert (
            "No backend type associated with device type cpu"
            in result["world_refuses_cpu"]
        )
        assert result["side_group_is_world"] is False
        assert result["side_group_again"] is True
        assert result["stopping"] == [1]
        assert result["agreed"] == 2
        assert result["disagreement"].startswith(
            "fit() differs between ranks in x: ranks [0]: rank 0; ranks [1]: "
            "rank 1."
        )
        assert result["files_agree"] == rank
    assert results[0]["shuffle_draw"] == results[1]["shuffle_draw"]
