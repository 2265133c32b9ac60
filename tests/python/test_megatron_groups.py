"""zbpp.megatron's gloo side group: in a real Megatron job the pipeline group is an NCCL subgroup of
the world (any TP or DP > 1), and zbpp's host messages (the NCCL unique id, post-validation's norms)
need a group that takes CPU tensors over the same ranks. new_group is a collective of the whole
world, so every rank must make every pipeline's group. Checked here with 4 processes and two
pipelines of 2 ranks (pp=2, dp=2 in Megatron's rank order), the NCCL-ness simulated."""

import datetime
import os
import traceback

import pytest

torch = pytest.importorskip("torch")

import pipeline_worker  # noqa: E402 - tests/python is on sys.path under pytest


def _worker(rank, key, out_dir):
    import torch.distributed as dist

    from zbpp.megatron import placement

    dist.init_process_group("gloo", init_method=pipeline_worker.store_url(key), rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    try:
        pipelines = [[0, 2], [1, 3]]  # Megatron's pp groups for tp=1, dp=2, pp=2
        groups = [dist.new_group(r) for r in pipelines]
        mine = groups[rank % 2]
        placement.takes_cpu = lambda g: g is not mine and g is not None  # "mine is NCCL"
        side = placement.pipeline_cpu_group(mine)
        again = placement.pipeline_cpu_group(mine)
        ranks = dist.get_process_group_ranks(side)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=side)
        with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
            f.write(f"{ranks} {t.item()} {side is again} {side is not mine}")
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
            f.write("ERROR " + traceback.format_exc())
    finally:
        dist.destroy_process_group()


def test_pipeline_cpu_group_over_subgroups(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(pipeline_worker.fresh_key("groups"), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        text = (tmp_path / f"{rank}.txt").read_text()
        assert not text.startswith("ERROR"), text
        pipeline = [0, 2] if rank % 2 == 0 else [1, 3]
        # The side group spans exactly this rank's pipeline, works, and is made once.
        assert text == f"{pipeline} {float(sum(pipeline))} True True", f"rank {rank}: {text}"
