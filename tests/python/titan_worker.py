"""torchtitan's pipeline code on 2 gloo processes, with torch's torch.distributed.pipelining or with
zbpp aliased in for it (test_torch_behaviours.py runs it; nothing here asserts).

    python titan_worker.py IMPL SCHEDULE OUT [CSV]

IMPL "torch" or "zbpp"; SCHEDULE a name torchtitan's pipeline_parallel_schedule takes, or "csv"
(torchtitan's pipeline_parallel_schedule_csv: CSV is a compute-only order of 4 stages in a loop).
torchtitan (on PYTHONPATH) is used as it is: _get_pipeline_metadata, _generate_llm_fqn_per_model_part,
_pipeline_module_split (its deep copy and pruning of the whole model, PipelineStage with group= and
get_mesh=) and _build_pipeline_schedule (the class by name, scale_grads=False,
backward_requires_autograd, _load_csv), with torchtitan's CrossEntropyLoss. The step is called as
torchtitan's trainer calls it (pp_forward_backward_step: arg_mbs on the first stage's rank, kwarg_mbs
everywhere, target_mbs on the last stage's, losses, loss_kwargs with global_valid_tokens,
return_outputs=False); a torch whose step() lacks arg_mbs (2.13 and older: pytorch/pytorch#188500
came after) gets the same microbatches as one batch, which it splits into the same chunks.

The model is shaped like torchtitan's decoders (tok_embeddings, layers as a ModuleDict, norm,
lm_head, a forward that skips what the split removed). Its layers compute through
torch.nn.functional.linear on Parameters rather than nn.Linear, so that zbpp's zero-bubble classes
split their backward through the autograd graph (torch's own matmul in W) and the runs can be
compared to the bit. OUT gets {"losses", "params", "schedule_class"} (rank 0 merges both ranks').
"""

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, N_MB, STEPS, VOCAB, DIM, LAYERS, BATCH, SEQ = 2, 4, 3, 32, 16, 6, 8, 6


def alias_zbpp():
    """zbpp in torch's place, as a user would put it: the package and the submodules torchtitan
    imports from, before torchtitan is imported."""
    import zbpp.pipelining as zp
    from zbpp.pipelining import _utils, microbatch, schedules, stage

    sys.modules["torch.distributed.pipelining"] = zp
    for name, module in (("schedules", schedules), ("stage", stage), ("microbatch", microbatch), ("_utils", _utils)):
        sys.modules[f"torch.distributed.pipelining.{name}"] = module


class Affine(torch.nn.Module):
    def __init__(self, n_in, n_out, bias=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.bias = torch.nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(DIM)
        self.up = Affine(DIM, 2 * DIM)
        self.down = Affine(2 * DIM, DIM)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class TinyDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = torch.nn.RMSNorm(DIM)
        self.lm_head = Affine(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.lm_head(h).flatten(0, 1) if self.lm_head is not None else h


class _Config:
    layers = [None] * LAYERS  # what _get_pipeline_metadata counts


class _Dims:
    pp = WORLD


def main(rank, impl, schedule, out, csv, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    if impl == "zbpp":
        alias_zbpp()
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import pipeline_parallel as tpp

    name = "Interleaved1F1B" if schedule == "csv" else schedule
    parallelism = ParallelismConfig(pipeline_parallel_degree=WORLD, pipeline_parallel_schedule=name,
                                    pipeline_parallel_schedule_csv=csv if schedule == "csv" else "",
                                    num_pp_microbatches=N_MB)
    num_stages, num_layers, w_in, w_out = tpp._get_pipeline_metadata(_Dims(), parallelism, _Config())
    names = tpp._generate_llm_fqn_per_model_part(num_stages, num_layers, w_in, w_out)
    torch.manual_seed(0)
    model = TinyDecoder()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("pp",))
    stages, parts = tpp._pipeline_module_split(model, mesh, name, torch.device("cpu"), names, get_mesh=None)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    sched = tpp._build_pipeline_schedule(parallelism=parallelism, num_microbatches=N_MB, stages=stages,
                                         loss_fn=loss_fn)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    g = torch.Generator().manual_seed(1)
    step_losses = []
    presplit = impl == "zbpp" or "arg_mbs" in __import__("inspect").signature(sched.step).parameters
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        token_mbs, label_mbs = tokens.chunk(N_MB), [y.flatten() for y in labels.chunk(N_MB)]
        tokens_valid = torch.tensor(labels.numel())
        losses = [] if last else None
        if presplit:  # torchtitan's trainer (pp_forward_backward_step)
            sched.step(arg_mbs=[(t,) for t in token_mbs] if first else None, kwarg_mbs=[{} for _ in token_mbs],
                       target_mbs=label_mbs if last else None, losses=losses,
                       loss_kwargs={"global_valid_tokens": tokens_valid}, return_outputs=False)
        else:  # the same microbatches as one batch, for a torch without pre-split steps
            args = (tokens,) if first else ()
            target = {"target": labels.flatten()} if last else {}
            sched.step(*args, **target, losses=losses, loss_kwargs={"global_valid_tokens": tokens_valid},
                       return_outputs=False)
        opt.step()
        opt.zero_grad()
        if last:
            step_losses.append(float(torch.sum(torch.stack(losses))))
    mine = {"losses": step_losses,
            "params": {n: p.detach().clone() for part in parts for n, p in part.named_parameters()},
            "schedule_class": f"{type(sched).__module__}.{type(sched).__name__}"}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        merged = {"losses": next(r["losses"] for r in gathered if r["losses"]), "params": {},
                  "schedule_class": gathered[0]["schedule_class"]}
        for r in gathered:
            merged["params"].update(r["params"])
        torch.save(merged, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    impl, schedule, out = sys.argv[1], sys.argv[2], sys.argv[3]
    csv = sys.argv[4] if len(sys.argv) > 4 else ""
    store = tempfile.mktemp(prefix="zbpp-titan-store-")
    try:
        mp.spawn(main, args=(impl, schedule, out, csv, store), nprocs=WORLD, join=True)
    finally:
        if os.path.exists(store):
            os.remove(store)
