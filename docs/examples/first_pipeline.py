# first_pipeline.py: run with   torchrun --nproc-per-node 2 first_pipeline.py
import torch, torch.distributed as dist
from zbpp import PipelineStage, ScheduleZBVZeroBubble  # was: from torch.distributed.pipelining import ...

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # every rank builds the same 2 * world layers
layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(2 * world)]
mine = [rank, 2 * world - 1 - rank]  # ZB-V: rank r holds stages r and 2*world-1-r
stages = [PipelineStage(layers[s], s, 2 * world, torch.device("cpu")) for s in mine]
schedule = ScheduleZBVZeroBubble(stages, n_microbatches=8, loss_fn=torch.nn.functional.mse_loss)
opt = torch.optim.SGD([p for s in mine for p in layers[s].parameters()], lr=0.05)
x, y = torch.randn(64, 64), torch.randn(64, 64)
for step in range(1, 7):
    losses = []
    schedule.step(x, target=y, losses=losses) if rank == 0 else schedule.step()  # rank 0: first and last stage
    opt.step(), opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {torch.stack(losses).mean():.4f}")
timeline = schedule.timeline()  # the last step as measured; every rank calls it
if rank == 0:
    timeline.save("first_pipeline.svg"), print(timeline.to_text())
dist.destroy_process_group()
