#!/usr/bin/env python3
"""bench_gpu.py - zbpp's CUDA backend against PyTorch on one GPU.

What it measures (each benchmark checks its results before it times anything; a failed check is
reported and that row is not timed):

  (a) W GEMM: zbpp's W store, dW[out, in] += dY^T X accumulated into an fp32 main_grad (cuBLASLt,
      one launch per entry), for bf16, fp16 and fp32 inputs, hidden 1024 to 8192, against
      torch.matmul(dy.t(), x) followed by main_grad.add_ (Megatron's unfused path) on the same
      shapes. TFLOP/s of both (2 * rows * in * out per GEMM), zbpp/torch, and zbpp's fraction of the
      bf16 peak the card shows on one large torch.matmul (measured after the rows).
  (b) Optimizer kernels over ~100M fp32 parameters: zb_optim_step AdamW without and with the undo
      copy (post-validation), zb_sq_norm of fp32 and bf16 gradients, torch's AdamW (foreach, and
      fused where this torch has it) for context. GB/s from the bytes each element touches (stated
      in the table) and the fraction of the device's copy bandwidth, measured here with a large
      tensor copy_ (read + write).
  (c) Runner overhead: a one-rank ZB-V schedule (two stages on one GPU, many microbatches) whose
      callbacks only copy the boundary buffer, on the CUDA backend and on the host backend:
      microseconds per op, with a ctypes copy (the runner's own cost) and with torch views of the
      buffers (what zbpp.PipelineStage's callbacks pay).

  (d) PipeOffload's copies: one transformer layer's activations (bf16, flash attention: 34 s h
      bytes per sequence of s tokens at hidden h, Korthikanti et al.) copied to pinned host memory
      and back on a stream of its own (zbpp.costs.measure_copy_time, what the torch layer's copies
      do), against the layer's F + B compute (two GEMMs of its 24 s h^2 forward FLOPs, bf16): the
      measured k = round trip / (F + B), the PipeOffload paper's "offload is free when k <= 1",
      next to the reference fork's formula k = 10 / (3 (6h + s)) * B_c / B_o with its table's
      A100/H100 figures and with this card's measured bf16 peak and copy bandwidth.

GPU times come from CUDA events around the timed calls on torch's current stream (zbpp's backend
is pointed at that stream), after warm-up; each figure is the median of the repeats. Host-side
overhead (c) is wall-clock time. The table starts with the device, the date and the versions.

Usage: python3 benchmarks/bench_gpu.py [--json out.json] [--quick] [--only a,b,c,d]
The library is found as zbpp finds it ($ZBPP_LIBRARY, or build/libzbpp.so of this checkout); pass
--library PATH to choose. Exits 1 with a message when there is no CUDA device, 3 when a
correctness check failed.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")
    ap.add_argument("--library", metavar="PATH", help="libzbpp.so to use (default: as zbpp finds it)")
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    ap.add_argument("--only", default="a,b,c,d", help="which benchmarks, e.g. 'a,c' (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (default 10; quick 3)")
    ap.add_argument("--host-only", action="store_true",
                    help="run only the host-backend half of (c): checks this script on a machine without a GPU")
    return ap.parse_args()


ARGS = _args()
if ARGS.library:
    os.environ["ZBPP_LIBRARY"] = os.path.abspath(ARGS.library)
try:
    import zbpp
except ImportError:
    sys.path.insert(0, os.path.join(_REPO, "bindings", "python"))
    import zbpp

import torch  # noqa: E402 - before zbpp loads the library, so it binds torch's cuBLASLt and NCCL

from zbpp import cuda as zcuda  # noqa: E402
from zbpp import runtime  # noqa: E402

REPEATS = ARGS.repeats or (3 if ARGS.quick else 10)
WARMUP = 2 if ARGS.quick else 3
FAILED = []  # correctness checks that failed


def log(msg):
    print(msg, flush=True)


# ---- timing ---------------------------------------------------------------------------------------

def gpu_time(fn, repeats=REPEATS, warmup=WARMUP):
    """Median seconds of fn() between two CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_time(fn, repeats=REPEATS, warmup=WARMUP):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(name, ok, detail):
    if not ok:
        FAILED.append(f"{name}: {detail}")
        log(f"  CHECK FAILED {name}: {detail}")
    return ok


# ---- (a) W GEMM -----------------------------------------------------------------------------------

def bf16_peak(dev):
    """TFLOP/s of one large bf16 torch.matmul (8192^3; --quick 4096^3) on this card: the yardstick
    the W GEMM rows are given as a fraction of (what the card shows, not its data-sheet figure)."""
    n = 4096 if ARGS.quick else 8192
    g = torch.Generator(device=dev).manual_seed(1)
    a = torch.randn(n, n, device=dev, generator=g).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev, generator=g).to(torch.bfloat16)
    t = gpu_time(lambda: torch.matmul(a, b))
    return {"n": n, "tflops": 2.0 * n ** 3 / t / 1e12}


def bench_wgemm(dev):
    rows = 2048 if ARGS.quick else 8192
    shapes = ([(1024, 1024), (4096, 4096), (8192, 8192)] if ARGS.quick
              else [(1024, 1024), (2048, 2048), (4096, 4096), (4096, 11008), (11008, 4096), (8192, 8192)])
    backend = zcuda.backend_for(dev)
    store = runtime.WStore(backend, lambda token, ran: None)
    out = []
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for fin, fout in shapes:
                row = {"dtype": str(dtype).replace("torch.", ""), "rows": rows, "in": fin, "out": fout}
                out.append(row)
                _wgemm_case(dev, backend, store, dtype, rows, fin, fout, row)
                torch.cuda.empty_cache()
    finally:
        store.close()
    return {"peak": bf16_peak(dev), "rows": out}


def _wgemm_case(dev, backend, store, dtype, rows, fin, fout, row):
    inner = 4  # GEMMs per timed call, all into the same main_grad (as W ops accumulate)
    code = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    g = torch.Generator(device=dev).manual_seed(fin * 7 + fout)
    x = torch.randn(rows, fin, device=dev, generator=g).to(dtype)
    dy = torch.randn(rows, fout, device=dev, generator=g).to(dtype)
    main = torch.zeros(fout, fin, device=dev, dtype=torch.float32)

    def zb_run(n):
        zcuda.use_current_stream(backend, dev)  # the GEMMs go on torch's current stream (the events')
        store.begin(0, 0)
        for _ in range(n):
            store.push(runtime.DTYPES[code], rows, fin, fout, x.data_ptr(), 0, dy.data_ptr(), 0,
                       main.data_ptr(), None, 0)
        store.end()
        store.pop_run(0)

    def torch_run(n):
        for _ in range(n):
            main.add_(torch.matmul(dy.t(), x))

    # Correctness: one GEMM into a zeroed main_grad against the fp32 product of the same values
    # (no TF32). Half inputs: the products are exact in fp32, only the summation order differs
    # (bound 1e-4). fp32 inputs: 1e-3, which admits TF32.
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = dy.float().t() @ x.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    zb_run(1)
    torch.cuda.synchronize()
    err = rel_err(main, ref)
    bound = 1e-3 if dtype == torch.float32 else 1e-4
    row["max_rel_err"] = err
    main.zero_()
    torch_run(1)
    torch.cuda.synchronize()
    row["torch_max_rel_err"] = rel_err(main, ref)
    if not check(f"W GEMM {row['dtype']} {rows}x{fin}x{fout}", err <= bound, f"relative error {err:.3g} > {bound}"):
        return
    flops = 2.0 * rows * fin * fout * inner
    t_zb = gpu_time(lambda: zb_run(inner))
    t_torch = gpu_time(lambda: torch_run(inner))
    row.update(zbpp_tflops=flops / t_zb / 1e12, torch_tflops=flops / t_torch / 1e12, ratio=t_torch / t_zb)


def print_wgemm(result):
    peak, rows = result["peak"], result["rows"]
    log("\n(a) W GEMM, dW += dY^T X into fp32 main_grad; torch: main_grad.add_(torch.matmul(dy.t(), x))")
    log(f"  bf16 peak as this card shows it: {peak['tflops']:.0f} TF/s (one {peak['n']}^3 bf16 torch.matmul); "
        "'of peak' is zbpp's TF/s over it")
    log(f"{'dtype':>9} {'rows':>6} {'in':>6} {'out':>6} {'zbpp TF/s':>10} {'torch TF/s':>11} {'zbpp/torch':>11} "
        f"{'of peak':>8} {'rel.err zbpp':>13} {'rel.err torch':>14}")
    for r in rows:
        zb = f"{r['zbpp_tflops']:.1f}" if "zbpp_tflops" in r else "-"
        frac = f"{r['zbpp_tflops'] / peak['tflops']:.2f}" if "zbpp_tflops" in r else "-"
        tc = f"{r['torch_tflops']:.1f}" if "torch_tflops" in r else "-"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        e1 = f"{r['max_rel_err']:.2e}" if "max_rel_err" in r else "-"
        e2 = f"{r['torch_max_rel_err']:.2e}" if "torch_max_rel_err" in r else "-"
        log(f"{r['dtype']:>9} {r['rows']:>6} {r['in']:>6} {r['out']:>6} {zb:>10} {tc:>11} {ratio:>11} {frac:>8} {e1:>13} "
            f"{e2:>14}")
    log("  rel.err: max |result - fp32 product| / max |fp32 product| of one GEMM (the torch path rounds the "
        "product to the input dtype before adding it)")


# ---- (b) optimizer kernels ---------------------------------------------------------------------------

def _param_sizes():
    if ARGS.quick:
        return [1 << 20] * 8 + [4096] * 8
    return [1 << 22] * 24 + [4096] * 48  # 100.9M + 0.2M: large matrices and small vectors


def _check_adamw(dev):
    """zb_optim_step against torch.optim.AdamW (foreach=False) and its undo, on a small case."""
    g = torch.Generator(device=dev).manual_seed(1)
    params = [torch.randn(n, device=dev, generator=g) for n in (1000, 333, 4096)]
    grads = [[torch.randn(p.shape, device=dev, generator=g) * 0.1 for p in params] for _ in range(3)]
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False)
    mine = [p.clone() for p in params]
    gbuf = [torch.zeros_like(p) for p in params]
    kern = zcuda.OptimKernel(mine, gbuf, kind="adamw", lr=1e-2, weight_decay=0.01)
    undo_ok = True
    for step in grads:
        for p, b, s in zip(ps, gbuf, step):
            p.grad = s.clone()
            b.copy_(s)
        opt.step()
        before = [t.clone() for t in mine + kern.state1 + kern.state2]
        buf = kern.undo_buffer()
        kern.step(undo=buf)
        kern.undo(buf)
        undo_ok &= all(torch.equal(a, b) for a, b in zip(before, mine + kern.state1 + kern.state2))
        kern.step()
    diff = max((a - b.detach()).abs().max().item() for a, b in zip(mine, ps))
    ok = all(torch.allclose(a, b.detach(), rtol=1e-6, atol=1e-7) for a, b in zip(mine, ps))
    return ok and undo_ok, f"max |zbpp - torch| {diff:.3g} (bound rtol 1e-6, atol 1e-7); undo exact: {undo_ok}"


def bench_optim(dev, copy_gbps):
    out = []
    ok, detail = _check_adamw(dev)
    if not check("zb_optim_step AdamW vs torch.optim.AdamW", ok, detail):
        return out
    log(f"  AdamW check: {detail}")
    sizes = _param_sizes()
    params = [torch.randn(s, device=dev) for s in sizes]
    grads = [torch.randn(s, device=dev) * 1e-3 for s in sizes]
    n = sum(sizes)

    def row(name, seconds, bytes_per_elem, note=""):
        gbps = n * bytes_per_elem / seconds / 1e9
        out.append({"name": name, "elements": n, "bytes_per_element": bytes_per_elem, "ms": seconds * 1e3,
                    "gbps": gbps, "of_copy": gbps / copy_gbps, "note": note})

    _time_zb_adamw(params, grads, row)
    torch.cuda.empty_cache()
    _time_torch_adamw(params, grads, row)
    torch.cuda.empty_cache()
    for dtype, nbytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        _time_sq_norm(grads if dtype == torch.float32 else [g.to(dtype) for g in grads], dtype, nbytes, row)
    return out


def _time_zb_adamw(params, grads, row):
    kern = zcuda.OptimKernel(params, grads, kind="adamw", lr=1e-4, weight_decay=0.01)
    # AdamW touches per element: reads p, g, m, v (16 B) and writes p, m, v (12 B); with undo it also
    # writes the old p, m, v (12 B) to the undo buffer.
    row("zb_optim_step AdamW", gpu_time(lambda: kern.step()), 28, "r p,g,m,v w p,m,v")
    undo = kern.undo_buffer()
    row("zb_optim_step AdamW + undo", gpu_time(lambda: kern.step(undo=undo)), 40, "+ w undo p,m,v")


def _time_torch_adamw(params, grads, row):
    flat = [p.clone().requires_grad_(True) for p in params]
    for p, g in zip(flat, grads):
        p.grad = g
    for label, kwargs in (("torch AdamW foreach", {"foreach": True}), ("torch AdamW fused", {"fused": True})):
        try:
            opt = torch.optim.AdamW(flat, lr=1e-4, weight_decay=0.01, **kwargs)
        except (TypeError, RuntimeError, ValueError) as exc:  # fused needs torch >= 2.0 on CUDA
            log(f"  {label}: not available in this torch ({exc})")
            continue
        row(label, gpu_time(opt.step), 28, "context")


def _time_sq_norm(gs, dtype, nbytes, row):
    name = str(dtype).replace("torch.", "")
    sq, bad = zcuda.sq_norm(gs)
    want = sum(float(t.double().pow(2).sum()) for t in gs)
    err = abs(sq.item() - want) / want
    if not check(f"zb_sq_norm {name}", err <= 1e-9 and bad.item() == 0,
                 f"relative error {err:.3g} against float64 (bound 1e-9), nonfinite {bad.item()}"):
        return
    row(f"zb_sq_norm {name}", gpu_time(lambda: zcuda.sq_norm(gs)), nbytes, "r g")
    if hasattr(torch, "_foreach_norm"):
        row(f"torch _foreach_norm {name}", gpu_time(lambda: torch.stack(torch._foreach_norm(gs)).norm()), nbytes,
            "context")


def measure_copy_bandwidth(dev):
    nbytes = (256 << 20) if ARGS.quick else (2 << 30)
    src = torch.empty(nbytes // 4, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = gpu_time(lambda: dst.copy_(src))
    if not check("device copy", torch.equal(dst[-1000:], src[-1000:]), "copy_ gave other values"):
        return float("nan")
    return 2 * nbytes / t / 1e9  # read + write


def print_optim(rows, copy_gbps):
    log(f"\n(b) optimizer kernels; device copy bandwidth (tensor copy_, read + write): {copy_gbps:.0f} GB/s")
    log(f"{'kernel':>32} {'elements':>11} {'B/elem':>7} {'ms':>8} {'GB/s':>8} {'of copy':>8}  note")
    for r in rows:
        log(f"{r['name']:>32} {r['elements']:>11,} {r['bytes_per_element']:>7} {r['ms']:>8.3f} {r['gbps']:>8.0f} "
            f"{r['of_copy']:>8.0%}  {r['note']}")


# ---- (c) runner overhead ---------------------------------------------------------------------------

def bench_runner(dev, kinds):
    m = 32 if ARGS.quick else 256
    nbytes = 64 << 10
    sched = zbpp.Schedule.generate("zb-v", p=1, m=m)
    n_ops = len(sched.rank_ops(0))
    out = []
    try:
        for kind in kinds:
            for variant in ("ctypes copy", "torch views"):
                out.append(_runner_case(sched, kind, variant, dev, nbytes, m, n_ops))
    finally:
        sched.close()
    return out


def _runner_case(sched, kind, variant, dev, nbytes, m, n_ops):
    backend = zcuda.backend_for(dev if kind == "cuda" else "cpu")
    store = runtime.WStore(backend, None)
    device = dev if kind == "cuda" else torch.device("cpu")
    source = torch.arange(nbytes, dtype=torch.int64, device=device).remainder(251).to(torch.uint8)
    sink = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    views = zcuda.DeviceViews(device) if kind == "cuda" else None

    def view(addr):
        if views is not None:
            return views.get(addr, 0, lambda a: views.buffer(a, nbytes))
        import ctypes
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(addr), dtype=torch.uint8)

    def copy(dst, src):
        if variant == "ctypes copy":
            backend.copy(dst, src, nbytes)
        else:
            view(dst).copy_(view(src) if src != source.data_ptr() else source)

    def forward(stage, mb, inp, outp):
        if stage == 0:
            copy(outp, source.data_ptr())  # stage 0 reads its own data
        elif variant == "ctypes copy":
            backend.copy(sink.data_ptr(), inp, nbytes)  # the loss stage consumes its input
        else:
            sink.copy_(view(inp))

    def backward(stage, mb, gout, gin):
        if stage == 1:
            copy(gin, source.data_ptr())  # the loss stage's gradient for stage 0

    runner = runtime.Runner(sched, 0, backend, store, None, [nbytes], forward, backward)
    try:
        if kind == "cuda":
            zcuda.use_current_stream(backend, dev)
        runner.run()
        if kind == "cuda":
            torch.cuda.synchronize()
        ok = torch.equal(sink.cpu(), source.cpu())
        check(f"runner {kind} {variant}", ok, "the last stage did not receive stage 0's bytes")
        t = wall_time(runner.run)  # zb_runner_run ends by synchronising the compute stream
        return {"backend": kind, "variant": variant, "microbatches": m, "ops": n_ops, "bytes": nbytes,
                "us_per_op": t / n_ops * 1e6, "ms_per_iteration": t * 1e3}
    finally:
        runner.close()
        store.close()
        if views is not None:
            views.clear()


def print_runner(rows):
    log("\n(c) runner overhead: one-rank ZB-V (2 stages on one device), callbacks copy the boundary buffer only")
    log(f"{'backend':>8} {'callback':>12} {'m':>5} {'ops':>6} {'bytes':>7} {'us/op':>8} {'ms/iter':>9}")
    for r in rows:
        log(f"{r['backend']:>8} {r['variant']:>12} {r['microbatches']:>5} {r['ops']:>6} {r['bytes']:>7} "
            f"{r['us_per_op']:>8.2f} {r['ms_per_iteration']:>9.2f}")


# ---- (d) PipeOffload's copies --------------------------------------------------------------------------

# The reference fork's table (megatron/core/zbpp_utils.py get_gpu_flops_and_offload_bandwidth): bf16
# TFLOP/s and D2H GB/s by card name; zbpp does not plan from it, it is printed for comparison.
FORK_TABLE = {"A100": (220.0, 15.0), "H100": (440.0, 21.0)}


def fork_k(h, s, tflops, gbps):
    """The fork's k (get_offload_time returns k / 2): 10 / (3 (6h + s)) * B_c / B_o."""
    return 10.0 / (3.0 * (6 * h + s)) * (tflops * 1e3) / gbps


def bench_offload(dev):
    from zbpp.costs import measure_copy_time

    peak = bf16_peak(dev)["tflops"]  # TFLOP/s of one large bf16 matmul
    name = torch.cuda.get_device_name(dev)
    table = next((v for key, v in FORK_TABLE.items() if key in name), None)
    rows = []
    cases = [(4096, 2048)] if ARGS.quick else [(4096, 2048), (4096, 8192), (8192, 4096)]  # up to 1.1 GB a layer
    for h, seq in cases:
        nbytes = 34 * seq * h  # bf16 activations of one layer, one sequence (flash attention)
        t_off, t_rel = measure_copy_time(nbytes, dev)
        a = torch.randn(seq, h, device=dev, dtype=torch.bfloat16)
        w = torch.randn(h, 12 * h, device=dev, dtype=torch.bfloat16)
        t_gemm = gpu_time(lambda: torch.matmul(a, w)) * 1e3  # ms; 24 s h^2 FLOPs: the layer's forward GEMMs
        t_c = 2 * t_gemm  # F + B (B: the input gradient, as many FLOPs)
        k = (t_off + t_rel) / t_c
        gbps = nbytes / (t_off * 1e-3) / 1e9
        rows.append(dict(hidden=h, seq=seq, bytes=nbytes, offload_ms=t_off, reload_ms=t_rel, compute_ms=t_c,
                         k=k, d2h_gbps=gbps, k_fork_table=fork_k(h, seq, *table) if table else None,
                         k_fork_measured=fork_k(h, seq, peak, gbps)))
    return {"bf16_tflops": peak, "card": name, "rows": rows}


def print_offload(result):
    log(f"\n(d) PipeOffload copies: one layer's activations to pinned host memory and back vs its F + B "
        f"({result['card']}, bf16 peak {result['bf16_tflops']:.0f} TFLOP/s)")
    log(f"{'h':>6} {'s':>6} {'MiB':>7} {'D2H ms':>8} {'H2D ms':>8} {'F+B ms':>8} {'GB/s':>6} {'k':>6} "
        f"{'k fork table':>12} {'k fork meas.':>12}")
    for r in result["rows"]:
        table = f"{r['k_fork_table']:.2f}" if r["k_fork_table"] is not None else "n/a"
        log(f"{r['hidden']:>6} {r['seq']:>6} {r['bytes'] / 2**20:>7.1f} {r['offload_ms']:>8.3f} {r['reload_ms']:>8.3f} "
            f"{r['compute_ms']:>8.3f} {r['d2h_gbps']:>6.1f} {r['k']:>6.2f} {table:>12} {r['k_fork_measured']:>12.2f}")


# ---- main ------------------------------------------------------------------------------------------

def header(dev):
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "zbpp": zbpp.version(),
        "library": zbpp.library_path(),
    }
    if dev is not None:
        props = torch.cuda.get_device_properties(dev)
        info.update(device=torch.cuda.get_device_name(dev), memory_gib=round(props.total_memory / 2**30, 1),
                    sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    return info


def main():
    only = {s.strip() for s in ARGS.only.split(",") if s.strip()}
    if ARGS.host_only:
        info = header(None)
        log(f"bench_gpu (host only) | {info['date']} | torch {info['torch']} | zbpp {info['zbpp']} ({info['library']})")
        results = {"info": info, "runner": bench_runner(None, ["host"])}
        print_runner(results["runner"])
        return _finish(results)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device: torch.cuda.is_available() is false (torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}); this benchmark needs a GPU. "
              "(--host-only runs the host half of (c) to check the script.)", file=sys.stderr)
        return 1
    if not runtime.cuda_built():
        print(f"bench_gpu: {zbpp.library_path()} was built without CUDA; rebuild where nvcc is found", file=sys.stderr)
        return 1
    dev = torch.device("cuda", torch.cuda.current_device())
    info = header(dev)
    log(f"bench_gpu | {info['device']} ({info['memory_gib']} GiB, sm_{info['capability'].replace('.', '')}, "
        f"{info['sm_count']} SMs) | {info['date']}")
    log(f"torch {info['torch']} (CUDA {info['torch_cuda']}) | zbpp {info['zbpp']} ({info['library']}) | "
        f"median of {REPEATS} after {WARMUP} warm-up")
    results = {"info": info}
    steps = [
        ("a", "wgemm", lambda: bench_wgemm(dev), print_wgemm),
        ("b", "optim", None, None),
        ("c", "runner", lambda: bench_runner(dev, ["cuda", "host"]), print_runner),
        ("d", "offload", lambda: bench_offload(dev), print_offload),
    ]
    for key, name, fn, show in steps:
        if key not in only:
            continue
        try:
            if key == "b":
                copy_gbps = measure_copy_bandwidth(dev)
                results["copy_gbps"] = copy_gbps
                results[name] = bench_optim(dev, copy_gbps)
                print_optim(results[name], copy_gbps)
            else:
                results[name] = fn()
                show(results[name])
        except Exception as exc:  # noqa: BLE001 - one benchmark's failure must not hide the others
            text = f"{type(exc).__name__}: {exc}"
            results[name] = {"error": text, "traceback": traceback.format_exc()}
            log(f"\n({key}) {name} failed: {text}")
            FAILED.append(f"({key}) {name}: {text}")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return _finish(results)


def _finish(results):
    results["failed"] = FAILED
    if ARGS.json:
        text = json.dumps(results, indent=2, default=str)
        if ARGS.json == "-":
            print(text)
        else:
            with open(ARGS.json, "w") as f:
                f.write(text + "\n")
            log(f"\nwrote {ARGS.json}")
    if FAILED:
        log("\nFAILED: " + "; ".join(FAILED))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
