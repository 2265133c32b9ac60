"""Train a small GPT with a zero-bubble pipeline: `python3 -m zbpp.examples.train_gpt`.

What this is: the main job. It starts one process per pipeline rank (torch.multiprocessing.spawn
with gloo; under torchrun it uses the processes torchrun started), cuts the GPT of gpt.py into
stages, splits the backward of every Linear (zbpp.split_linear), and trains it with a zbpp schedule
(zb-auto, one stage per rank, by default; any kind with --schedule) on generated text.
The zero-bubble kinds are planned from measured costs: steps 2-3 are timed, every stage's F, B, W,
transfer time and activation memory are gathered, and the kind is planned again for them from
step 4 on (--no-plan-from-measured keeps the equal-cost plan). Each step prints the loss, tokens/s
and the bubble rate measured from the runner's own timestamps, next to the plan's simulated one
once there is a plan from measured costs; at the end the last step's measured timeline is written
as SVG and as a Chrome trace (open in https://ui.perfetto.dev), and the measured costs as
zbpp-costs JSON (`zbpp schedule KIND --stage-times FILE` reads it).

--device cuda runs the stages on GPUs (zbpp's CUDA backend, the W GEMMs through the W store on torch's
stream, activations over the library's NCCL transport with one GPU per rank; ranks that share a GPU,
which NCCL refuses, go through host memory instead, with a warning); --ranks 1 runs every stage in
one process on one GPU.
What this is not: a benchmark; the model is small enough for a 2-core machine to finish the CPU
defaults in about a minute.
"""

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

__all__ = ["main", "parse_args", "train", "stage_layout"]

V_KINDS = ("zb-v", "v-half", "v-min")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python3 -m zbpp.examples.train_gpt",
        description="Train a small GPT on CPU with a zero-bubble pipeline (one process per rank).")
    ap.add_argument("--schedule", default="zb-auto",
                    help="schedule kind: zb-auto (default), zb-v, zb-h1, zb-h2, v-half, v-min, 1f1b, "
                         "interleaved-1f1b, gpipe, or torch's names (ZBVZeroBubble, 1F1B, ...)")
    ap.add_argument("--ranks", type=int, default=2, help="pipeline ranks = processes (default 2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the stages run (default cpu). cuda: rank r on GPU r modulo the GPUs there are, on "
                         "zbpp's CUDA backend; activations between ranks go over NCCL with a GPU per rank, else "
                         "through host memory")
    ap.add_argument("--chunks", type=int, default=None,
                    help="stages per rank (default: 2 for V kinds and interleaved-1f1b, else 1; zb-auto takes "
                         "1 or 2, in a V)")
    ap.add_argument("--no-plan-from-measured", dest="plan_from_measured", action="store_false",
                    help="keep the plan made for equal F/B/W costs (default: the zero-bubble kinds are "
                         "planned again from the costs measured in --profile-steps)")
    ap.add_argument("--profile-steps", default="2-3",
                    help="the steps whose measured costs the plan is made from, FIRST-LAST (default 2-3; "
                         "the new plan runs from the step after LAST)")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    ap.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    ap.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument("--mem-limit", default=None,
                    help="zb-auto's memory limit: microbatches (6, 2p) or activation bytes per rank (8MB)")
    ap.add_argument("--offload", action="store_true",
                    help="PipeOffload: activations to host memory where the copies hide (offload='auto'), with "
                         "any schedule; the copies are timed in --profile-steps and placed after them")
    ap.add_argument("--vocab-size", type=int, default=32,
                    help="the vocabulary (default 32, the text's characters; larger adds ids the text never uses, "
                         "as a large tokenizer's vocabulary costs: the output layer and embedding grow)")
    ap.add_argument("--vocab-parallel", "--enable-vocab-parallel", dest="vocab_parallel", action="store_true",
                    help="Vocabulary Parallelism: the output layer and token embedding split over every rank "
                         "(zbpp.VocabParallel), their passes placed in the schedule")
    ap.add_argument("--disable-backward-fusion", dest="backward_fusion", action="store_false",
                    help="with --vocab-parallel: the output layer's input gradient in its T pass (two barriers a "
                         "microbatch) instead of fused into S (one)")
    ap.add_argument("--no-post-validation", dest="post_validation", action="store_false",
                    help="step the optimizer after a global sync instead of with post-validation "
                         "(the default: speculative step, exact rollback)")
    ap.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping norm (0: off; default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a transfer may take (default 120)")
    ap.add_argument("--out", default=os.environ.get("ZBPP_OUT", "zbpp-out"),
                    help="directory for the timeline SVG and Chrome trace (default ./zbpp-out or $ZBPP_OUT)")
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = ap.parse_args(argv)
    for name in ("ranks", "microbatches", "batch", "steps", "seq", "d_model", "layers", "heads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.vocab_size < 32:
        ap.error(f"--vocab-size {args.vocab_size}: the text has 32 characters, so at least 32")
    if not args.backward_fusion and not args.vocab_parallel:
        ap.error("--disable-backward-fusion goes with --vocab-parallel")
    if args.vocab_parallel and args.offload:
        ap.error("--vocab-parallel does not go with --offload yet")
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    first, _, last = args.profile_steps.partition("-")
    try:
        args.profile_steps = (int(first), int(last or first))
    except ValueError:
        ap.error(f"--profile-steps wants FIRST-LAST such as 2-3, got {args.profile_steps!r}")
    if not 1 <= args.profile_steps[0] <= args.profile_steps[1]:
        ap.error(f"--profile-steps {first}-{last}: steps count from 1 and FIRST <= LAST")
    return args


def stage_layout(kind, chunks=None):
    """(canonical kind name, stages per rank) for a schedule name."""
    from zbpp.pipelining import get_schedule_class

    cls = get_schedule_class(kind)
    if chunks is None:
        chunks = 2 if cls.kind in V_KINDS or cls.kind == "interleaved-1f1b" else 1
    return cls, chunks


def train(rank, ranks, args, group=None, report=print):
    """Trains on this rank; returns a dict with the losses (on the loss stage's rank), this rank's
    parameters by name (stage index prefixed), the measured bubble rates and, when the schedule
    was planned from measured costs, "plan" (the step after which it was, its simulated bubble
    rate, the previous plan's measured one, the costs as a dict)."""
    import torch

    import zbpp
    from zbpp.examples import gpt

    torch.set_num_threads(1)  # the ranks share the cores; also keeps results independent of threads
    cls, chunks = stage_layout(args.schedule, args.chunks)
    S = ranks * chunks
    device = _rank_device(args.device, rank)
    config = gpt.GPTConfig(vocab=args.vocab_size, seq=args.seq, d_model=args.d_model, n_head=args.heads,
                           n_layer=args.layers)
    vp = None
    if args.vocab_parallel:
        modules, tok, head = gpt.build_vocab_parallel_stages(config, S, seed=args.seed)
        vp = zbpp.VocabParallel(head, tok, fused=args.backward_fusion)
        del tok, head  # each rank keeps its rows only (the schedule shards them)
    else:
        modules = gpt.build_stages(config, S, seed=args.seed)
    probe = zbpp.Schedule.generate(cls.kind, p=ranks, m=args.microbatches, v=chunks)
    mine = probe.rank_stages(rank)
    probe.close()
    stages = [zbpp.PipelineStage(zbpp.split_linear(modules[s].to(device)), s, S, device, group=group)
              for s in mine]
    kwargs = {"mem_limit": args.mem_limit} if args.mem_limit else {}
    if not args.plan_from_measured:
        kwargs["plan_from_measured"] = False
    if args.offload:
        kwargs["offload"] = "auto"
    if vp is not None:
        # The passes are placed from the times the schedule measures in step 2 (its own replan,
        # which --no-plan-from-measured turns off as it does the stages' profile).
        kwargs.update(vocab_parallel=vp)
    else:
        kwargs.update(loss_fn=gpt.loss_fn, profile_steps=args.profile_steps)
    sched = cls(stages, args.microbatches, timeout=args.timeout, **kwargs)
    params = [p for st in stages for p in st.submod.parameters()] + (vp.parameters() if vp is not None else [])
    opt = torch.optim.AdamW(params, lr=args.lr, foreach=False)
    # The optimizer steps through the post-validation protocol either way (it also does the global
    # clipping); --no-post-validation makes it synchronise first, the reference path.
    post = zbpp.PostValidatedOptimizer.for_schedule(opt, sched, clip_grad=args.clip_grad,
                                                    post_validation=args.post_validation)
    data = gpt.Batches(args.seq, args.batch, seed=args.seed)
    tokens = args.batch * args.seq
    out = {"losses": [], "bubbles": [], "rolled_back": 0, "step_seconds": []}
    for step in range(args.steps):
        x, y = data.next()  # every rank draws the batch so the data streams stay in step
        x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        losses = []
        if sched.holds_first and sched.holds_loss:
            sched.step(x, target=y, losses=losses)
        elif sched.holds_first:
            sched.step(x)
        elif sched.holds_loss:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        res = post.step()
        out["rolled_back"] += int(res.rolled_back)
        post.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        timeline = sched.timeline()
        bubble, idle = timeline.measured.bubble_rate, timeline.measured.idle_rate
        timeline.close()
        out["bubbles"].append(bubble)
        out.setdefault("idle", []).append(idle)
        out["step_seconds"].append(dt)
        info = sched.plan_info
        # The plan made after this step runs from the next one on.
        planned = "" if info is None or info.step > step else f" | plan {100 * _plan_bubble(info):4.1f}%"
        if losses:
            loss = float(torch.stack(losses).mean())
            out["losses"].append([float(v) for v in losses])
            if not args.quiet:
                report(f"step {step + 1:3d}/{args.steps} | loss {loss:.4f} | {tokens / dt:7,.0f} tokens/s "
                       f"| bubble {100 * bubble:5.1f}% idle {100 * idle:5.1f}% (measured){planned} "
                       f"| grad norm {res.grad_norm:6.3f}"
                       f"{' clipped' if res.clipped else ''}{' rolled back' if res.rolled_back else ''}",
                       flush=True)
                if info is not None and info.step == step + 1:
                    report(_plan_lines(info), flush=True)
    final = sched.timeline()
    info = sched.plan_info
    out["offload"] = sched.offload_report() if args.offload else None
    out["offloaded"] = sum(op.type == "OFFLOAD" for op in sched.schedule.rank_ops(rank))
    sched.schedule.simulate()
    out["plan_peak"] = sched.schedule.rank_memory(rank)[0]  # device-resident, microbatches
    if info is not None:
        out["plan"] = {"step": info.step, "simulated": info.simulated.bubble_rate, "measured": info.measured_bubble,
                       "expected": info.expected_bubble,
                       "switched": info.switched, "reverted": info.reverted,
                       "before": None if info.before is None else info.before.bubble_rate,
                       "costs": None if info.costs is None else info.costs.to_dict()}
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"train_gpt-{sched.schedule.kind}")
        final.save(base + ".svg", "svg")
        final.save(base + "-trace.json", "chrome")
        out["files"] = [base + ".svg", base + "-trace.json"]
        if info is not None and info.costs is not None:
            out["files"].append(info.costs.save(base + "-costs.json"))
            # The plan (simulated on the measured costs, in ms) above what the last step measured,
            # on one time scale.
            r = sched.schedule.simulate()
            m = final.measured
            sched.schedule.set_display(f"{sched.schedule.kind}, planned", "ms")
            picture = zbpp.stack_svgs([
                (f"plan: {sched.schedule.kind} on the "
                 + (f"costs measured in steps {info.profile_steps[0]}-{info.profile_steps[1]}"
                    if info.profile_steps else "given costs")
                 + f", simulated bubble {100 * r.bubble_rate:.1f}%, idle {100 * r.idle_rate:.1f}%"
                 + ("" if info.expected_bubble is None else f" ({100 * info.expected_bubble:.1f}% expected as measured)"),
                 sched.schedule),
                (f"measured: step {args.steps}, bubble {100 * m.bubble_rate:.1f}%, idle {100 * m.idle_rate:.1f}%",
                 final)])
            with open(base + "-plan-vs-measured.svg", "w", encoding="utf-8") as f:
                f.write(picture)
            out["files"].append(base + "-plan-vs-measured.svg")
    final.close()
    out["params"] = {f"{st.stage_index}.{n}": p.detach().clone() for st in stages
                     for n, p in st.submod.named_parameters()}
    if vp is not None:
        out["params"].update({f"vocab.{n}": w.detach().clone() for n, w in vp.named_parameters()})
    out["peak_rss_mib"] = _peak_rss_mib()
    # On a GPU what a rank holds there (model, optimizer state, activations, the vocabulary's
    # logits): where Vocabulary Parallelism's balance shows.
    out["peak_gpu_mib"] = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None)
    out["kind"] = sched.schedule.kind
    sched.close()
    return out


def _peak_rss_mib():
    """This process's peak resident memory (MiB): what the rank held at its fullest, model,
    optimizer and activations together, as `top` would have shown it."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _rank_device(kind, rank):
    """The torch device of `rank`'s stages: the CPU, or GPU rank modulo the GPUs there are."""
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda: torch {torch.__version__} sees no CUDA device "
                           f"(torch.cuda.is_available() is false; torch's CUDA: {torch.version.cuda})")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _plan_bubble(info):
    """The plan's bubble as the runner measures it (each op's runtime overhead idle), or its
    simulated bubble when it was not planned from measured costs."""
    return info.simulated.bubble_rate if info.expected_bubble is None else info.expected_bubble


def _plan_lines(info):
    """What the replan found, for the log: the measured costs and the plan's simulated bubble."""
    a, b = info.profile_steps or (None, None)
    head = (f"planned {info.kind} from the costs measured in steps {a}-{b}" if a is not None
            else f"planned {info.kind} again")
    lines = [f"{head} (runs from step {info.step + 1}):"]
    if info.costs is not None:
        lines += ["  " + line for line in info.costs.table().splitlines()]
    if info.switched:
        sim = f"  the new plan's simulated bubble {100 * info.simulated.bubble_rate:.1f}%"
        if info.before is not None:
            sim += f"; the plan it replaces: {100 * info.before.bubble_rate:.1f}% on these costs"
    else:
        sim = (f"  kept the plan in force: {100 * info.simulated.bubble_rate:.1f}% simulated on these costs; the "
               f"new plan would not be faster ({100 * info.candidate.bubble_rate:.1f}%)")
    if info.measured_bubble is not None:
        sim += f", {100 * info.measured_bubble:.1f}% measured"
    if info.expected_bubble is not None and info.costs is not None:
        sim += (f"\n  expected as measured: {100 * info.expected_bubble:.1f}% (the runtime's own time after each op "
                f"counted as idle, as the runner's timestamps count it, and op times drawn from those measured)")
    return "\n".join(lines + [sim])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, ranks, port, args, queue):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=max(60.0, args.timeout)))
    try:
        result = train(rank, ranks, args)
        result.pop("params", None)
        queue.put((rank, result))
    except Exception as exc:
        # torch.multiprocessing shows the first failed rank's traceback only: every rank says its own.
        print(f"[rank {rank}] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    # The ranks share the cores: one BLAS thread per rank for the W GEMMs (as torch.set_num_threads(1)
    # for torch's), set before any process loads the library. Otherwise OpenBLAS's threads of the
    # ranks compete, and the measured W (what the plan is made from) is mostly that contention.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch  # noqa: F401 - before zbpp loads its library (DESIGN.md section 5)
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # Under torchrun: one process per rank already exists.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(60.0, args.timeout)))
        train(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"train_gpt: --device cuda, but torch {torch.__version__} sees no CUDA device "
              f"(torch.cuda.is_available() is false; torch's CUDA: {torch.version.cuda})", file=sys.stderr)
        return 2
    cls, chunks = stage_layout(args.schedule, args.chunks)
    from zbpp.pipelining import PLANNED_KINDS

    a, b = args.profile_steps
    how = (f", planned from the costs measured in steps {a}-{b}" if args.plan_from_measured and cls.kind in PLANNED_KINDS
           else ", planned for equal F/B/W costs" if cls.kind in PLANNED_KINDS else "")
    print(f"zbpp {cls.kind}{how}: {args.ranks} processes x {chunks} stage(s) on {args.device}, {args.layers} layers, d_model "
          f"{args.d_model}, {args.microbatches} microbatches of {args.batch // args.microbatches} x "
          f"{args.seq} tokens, {args.steps} steps, AdamW with "
          f"{'post-validation' if args.post_validation else 'a global sync'} (clip {args.clip_grad})", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    t0 = time.time()
    mp.spawn(_spawned, args=(args.ranks, _free_port(), args, queue), nprocs=args.ranks, join=True)
    results = dict(queue.get() for _ in range(args.ranks))
    losses = [r["losses"] for r in results.values() if r["losses"]][0]
    first, last = sum(losses[0]) / len(losses[0]), sum(losses[-1]) / len(losses[-1])
    bubbles = results[0]["bubbles"]
    seconds = results[0]["step_seconds"]
    plan = results[0].get("plan")
    # The steady state: after the first step, or after the replan when there is one.
    start = plan["step"] if plan else 1
    if start >= len(bubbles):  # the plan changed after the last step (too few steps to see it run)
        start = min(1, len(bubbles) - 1)
    steady = sorted(bubbles[start:] or bubbles)
    rate = args.batch * args.seq * len(seconds[start:]) / max(sum(seconds[start:]), 1e-9) if seconds[start:] else 0.0
    rolled = sum(r["rolled_back"] for r in results.values())
    print(f"done in {time.time() - t0:.1f} s: loss {first:.3f} -> {last:.3f}, measured bubble "
          f"{100 * statistics.median(steady):.1f}% (median of steps {start + 1}-{len(bubbles)}), "
          f"{rate:,.0f} tokens/s over those steps, "
          f"{rolled} speculative step(s) rolled back by post-validation")
    if plan:
        before = "" if plan["measured"] is None else f"; the steps profiled measured {100 * plan['measured']:.1f}%"
        what = ("plan from measured costs" if plan["switched"] else
                "the plan from measured costs measured slower in its first steps; the one before it is back"
                if plan.get("reverted") else "equal-cost plan kept after measuring")
        expected = "" if plan.get("expected") is None else f" ({100 * plan['expected']:.1f}% expected as measured)"
        print(f"  {what}: simulated bubble {100 * plan['simulated']:.1f}%{expected} on the measured costs, measured "
              f"{100 * statistics.median(steady):.1f}% in steps {start + 1}-{len(bubbles)}{before}")
    if args.offload:
        moved = sum(r["offloaded"] for r in results.values())
        reps = [(q, r["offload"]) for q, r in sorted(results.items()) if r["offload"] is not None]
        print(f"  offload: {moved} activations moved to host memory a step", flush=True)
        for q, rep in reps:
            print(f"    rank {q}: saved activations at once {rep['device_peak_bytes'] / 2**10:,.0f} KiB on the device "
                  f"(plan: {rep['planned_device_peak']:g} microbatches, {rep['planned_device_peak_bytes'] / 2**10:,.0f} KiB), "
                  f"{rep['host_peak_bytes'] / 2**10:,.0f} KiB in host memory")
    print("  the plan's peak of saved activations on the device per rank (microbatches through the rank's "
          "layers): " + ", ".join(f"rank {q} {r['plan_peak']:g}" for q, r in sorted(results.items())), flush=True)
    print("  peak resident memory per rank: " + ", ".join(
        f"rank {q} {r['peak_rss_mib']:,.0f} MiB" for q, r in sorted(results.items())), flush=True)
    if all(r.get("peak_gpu_mib") is not None for r in results.values()):
        print("  peak GPU memory per rank (torch.cuda.max_memory_allocated): " + ", ".join(
            f"rank {q} {r['peak_gpu_mib']:,.0f} MiB" for q, r in sorted(results.items())), flush=True)
    for f in results[0].get("files", []):
        print(f"  wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
