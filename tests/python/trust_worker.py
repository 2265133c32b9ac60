"""One rank of the failure and trust tests (test_trust.py), run as its own process so the test
sees how it ends: its exit code (a signal shows as a negative code) and what it wrote.

    python trust_worker.py RANK WORLD STORE_FILE OUT_FILE CONFIG_JSON

CONFIG_JSON (every key optional):
  kind        schedule kind for every rank ("1f1b"), or kinds: {rank: kind}
  m           microbatches (4), or ms: {rank: m}
  steps       steps to run (4)
  timeout     the schedule's timeout in seconds (10)
  fault       {"rank": r, "step": k, "where": w}: rank r fails at step k (counted from 1) in
              "forward", "loss", "backward", "split" (a batch that does not split on that rank),
              "kill" (SIGKILL itself in a forward), "hang" (sleeps `hang_s` in a forward, then goes
              on), "nontensor" (the stage returns a string), "shape" / "dtype" (the stage's output
              changes shape / dtype), "exit_before" (the process exits before its first step),
              "optimizer" (the torch optimizer's step raises; with postval, inside the exchange)
  hang_s      how long "hang" sleeps (timeout + 2)
  postval     wrap the optimizer in PostValidatedOptimizer (false), or postvals: {rank: bool}
  width       {rank: width}: the width of that rank's layers (a shape mismatch between ranks)
  rss_every   record the process's RSS every this many steps (0: never)
  exit        "return" (the default: catch the error, write it, try one more step, return from main
              normally), "destroy" (the same, then torch.distributed.destroy_process_group()) or
              "raise" (let it propagate)
  model       "tanh" (the default) or "tied": integer-valued linear stages whose first and last
              stage share one weight (exact arithmetic: any summation order gives the same bits)

The output file gets one JSON object: error ("Type: message" or null), again (what a step after
the error raised), started / failed (epoch seconds of the first step and of the error), steps
(finished), losses, rss ([(step, kB)]), grads (the tied model's gradients, {stage: [values]}).
Nothing here asserts.
"""

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def _rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class _Stage(torch.nn.Module):
    def __init__(self, width_in, width_out, index, fault, rank):
        super().__init__()
        self.lin = torch.nn.Linear(width_in, width_out)
        self.index, self.fault, self.rank = index, fault, rank
        self.step = 0  # set by the driver before each step

    def forward(self, x):
        f = self.fault
        if f and f["rank"] == self.rank and f["step"] == self.step:
            where = f["where"]
            if where == "forward":
                raise ValueError(f"forward of stage {self.index} failed on purpose")
            if where == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if where == "hang":
                time.sleep(f["hang_s"])
            if where == "nontensor":
                return "not a tensor"
            if where == "shape":
                return torch.tanh(self.lin(x))[:, :-1]
            if where == "dtype":
                return torch.tanh(self.lin(x)).double()
            if where == "backward":
                return _Boom.apply(torch.tanh(self.lin(x)))
        return torch.tanh(self.lin(x))


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("backward failed on purpose")


def main():
    rank, world, store_file, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = json.loads(sys.argv[5])
    import zbpp

    dist.init_process_group("gloo", init_method="file://" + store_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    kind = cfg.get("kinds", {}).get(str(rank), cfg.get("kind", "1f1b"))
    m = cfg.get("ms", {}).get(str(rank), cfg.get("m", 4))
    steps, timeout = cfg.get("steps", 4), cfg.get("timeout", 10.0)
    fault = cfg.get("fault")
    if fault:
        fault.setdefault("hang_s", timeout + 2.0)
    width = cfg.get("width", {}).get(str(rank), 8)
    cls = zbpp.get_schedule_class(kind)
    probe = zbpp.Schedule.generate(kind, p=world, m=max(m, 2 * world), v=2 if kind in ("zb-v", "v-half", "v-min")
                                   else 1)
    mine, S = probe.rank_stages(rank), probe.stages
    probe.close()
    torch.manual_seed(0)
    if cfg.get("model") == "tied":
        mods = {s: m_ for s, m_ in tied_stages(S).items() if s in mine}
        x, y = tied_batch()
    else:
        mods = {s: zbpp.split_linear(_Stage(8 if s else width, width if s < S - 1 else 8, s, fault, rank))
                for s in mine}
    stages = [zbpp.PipelineStage(mods[s], s, S, "cpu") for s in mine]
    loss_fn = tied_loss if cfg.get("model") == "tied" else _loss(fault, rank)
    sched = cls(stages, m, loss_fn=loss_fn, timeout=timeout)
    params = [p for mod in mods.values() for p in mod.parameters()]
    opt = _SGD(params, lr=0.01, fault=fault, rank=rank)
    if cfg.get("postvals", {}).get(str(rank), cfg.get("postval")):
        opt = zbpp.PostValidatedOptimizer.for_schedule(opt, sched)
    if cfg.get("model") != "tied":
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    out = {"error": None, "again": None, "started": None, "failed": None, "steps": 0, "losses": [], "rss": []}
    every = cfg.get("rss_every", 0)
    if fault and fault["where"] == "exit_before" and fault["rank"] == rank:
        os._exit(0)  # gone before the first step, its connections closed
    out["started"] = time.time()
    try:
        for k in range(1, steps + 1):
            _LOSS_STEP[0] = k
            for mod in mods.values():
                mod.step = k
            if cfg.get("model") == "tied":
                opt.zero_grad()
            batch = x
            if fault and fault["where"] == "split" and fault["rank"] == rank and fault["step"] == k:
                batch = torch.randn(7, 8)
            losses = []
            args = (batch,) if sched.holds_first else ()
            kw = {"target": y, "losses": losses} if sched.holds_loss else {}
            sched.step(*args, **kw)
            if cfg.get("model") == "tied":
                out["grads"] = {s: [p.grad.tolist() for p in mods[s].parameters()] for s in mods}
                out["steps"] = k
                continue
            opt.step()
            opt.zero_grad()
            out["steps"] = k
            if not every:  # a soak keeps nothing per step: its RSS is zbpp's
                out["losses"].append([float(v) for v in losses])
            if every and k % every == 0:
                out["rss"].append((k, _rss_kb()))
    except Exception as exc:  # noqa: BLE001 - written for the test
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["failed"] = time.time()
        if cfg.get("exit") == "raise":
            _write(out_file, out)
            raise
        try:
            sched.step(*args, **kw)
        except Exception as again:  # noqa: BLE001 - written for the test
            out["again"] = f"{type(again).__name__}: {again}"
    _write(out_file, out)
    if cfg.get("exit") == "destroy":  # as torch's examples end
        dist.destroy_process_group()


_LOSS_STEP = [0]


class _SGD(torch.optim.SGD):
    """SGD whose step raises on the fault's rank and step when the fault is "optimizer"."""

    def __init__(self, params, lr, fault, rank):
        super().__init__(params, lr=lr)
        self._fault, self._rank = fault, rank

    def step(self, closure=None):
        f = self._fault
        if f and f["where"] == "optimizer" and f["rank"] == self._rank and f["step"] == _LOSS_STEP[0]:
            raise ValueError("optimizer step failed on purpose")
        return super().step(closure)


def tied_stages(S, split=True):
    """The "tied" model: S bias-free Linear(8, 8) stages with weights in {-1, 0, 1}, the last one
    sharing the first one's weight (as a GPT's LM head shares its embedding), split_linear'ed."""
    import zbpp

    g = torch.Generator().manual_seed(3)
    mods = {}
    for s in range(S):
        lin = torch.nn.Linear(8, 8, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randint(-1, 2, (8, 8), generator=g).float())
        if s == S - 1:
            lin.weight = mods[0].weight
        mods[s] = zbpp.split_linear(lin) if split else lin
    return mods


def tied_batch():
    """Integer inputs and targets in [-2, 2] for the tied model (8 rows)."""
    g = torch.Generator().manual_seed(4)
    return torch.randint(-2, 3, (8, 8), generator=g).float(), torch.randint(-2, 3, (8, 8), generator=g).float()


def tied_loss(out, y):
    return (out * y).sum()


def _loss(fault, rank):
    def loss_fn(out, y):
        if fault and fault["where"] == "loss" and fault["rank"] == rank and fault["step"] == _LOSS_STEP[0]:
            raise ValueError("loss_fn failed on purpose")
        return ((out - y) ** 2).mean()

    return loss_fn


def _write(path, out):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
