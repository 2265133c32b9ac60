"""The PyTorch layer on the CUDA backend: W GEMMs on torch's current stream, the caching
allocator's stream rule, pipelines on one and two GPUs, the fused optimizer kernels.

Host-runnable tests (no GPU) check what can be checked without one: the library's CUDA queries,
the errors for bad arguments and for a machine without a GPU, the stream-handle mapping, and the
optimizer kernels' host reference against torch (the same entry points the GPU runs). Tests marked
`gpu` skip without CUDA (conftest.py). Bounds are stated where the kernels differ from torch's:

  - fp32 W GEMM vs nn.Linear: relative 1e-5 (fp32 accumulation in another order, no TF32);
  - bf16 inputs into fp32 main_grad vs the fp32 product of the same bf16 values: relative 1e-5
    (bf16 x bf16 products are exact in fp32; only the summation order differs);
  - bf16 gradients in bf16: relative 1e-2 against the fp32 product (one rounding to 8 bits);
  - zb_optim_step vs torch.optim.AdamW: rtol 1e-6, atol 1e-7 after three steps (the same formula
    with a different rounding order: torch's addcdiv multiplies after dividing);
  - pipelines vs the sequential loop on the same GPU: bit for bit (the same kernels, the same
    inputs, in the same order per stage).
"""

import copy
import datetime
import os
import socket

import pytest

torch = pytest.importorskip("torch")

import pipeline_worker  # noqa: E402
import zbpp  # noqa: E402
from zbpp import cuda, runtime  # noqa: E402
from zbpp.examples import gpt  # noqa: E402
from zbpp.split import capture, default_store  # noqa: E402

REL_FP32 = 1e-5
SEED, M, BATCH, STEPS, LR = 3, 4, 8, 2, 1e-2


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _no_gpu_reason():
    if torch.cuda.is_available() or runtime.cuda_device_count() > 0:
        return "this machine has a CUDA device"
    return None


# ---- host-runnable -----------------------------------------------------------------------------------

def test_cuda_queries_are_sane():
    built, count = runtime.cuda_built(), runtime.cuda_device_count()
    assert isinstance(built, bool) and isinstance(count, int)
    assert count >= 0
    if not built:
        assert count == 0, f"a build without CUDA reports {count} devices"
    if torch.cuda.is_available():
        assert count == torch.cuda.device_count(), f"zbpp sees {count} devices, torch {torch.cuda.device_count()}"
    assert zbpp.cuda_built() == built and zbpp.cuda_device_count() == count


def test_backend_memory_calls_round_trip_on_the_host():
    """alloc/copy/free, the calls the CUDA backend uses for device memory, on the host backend."""
    import ctypes

    be = runtime.Backend("host")
    a, b = be.alloc(16), be.alloc(16)
    assert a and b and a != b
    ctypes.memmove(a, b"sixteen bytes!!\0", 16)
    be.copy(b, a, 16)
    be.synchronize()
    assert ctypes.string_at(b, 16) == b"sixteen bytes!!\0"
    be.free(a)
    be.free(b)
    be.free(0)  # like free(NULL)


def test_cuda_backend_without_a_gpu_says_so():
    reason = _no_gpu_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(zbpp.ZbError) as err:
        runtime.Backend("cuda")
    if runtime.cuda_built():
        assert err.value.code == runtime.ZB_ERR_CUDA, str(err.value)
        assert "no CUDA device" in err.value.message, err.value.message
    else:
        assert err.value.code == runtime.ZB_ERR_UNSUPPORTED, str(err.value)


@pytest.mark.parametrize("kwargs,exc,text", [
    (dict(kind="tpu"), ValueError, "allowed: 'host', 'cuda'"),
    (dict(kind="host", device=0), ValueError, "host backend takes no device"),
    (dict(kind="cuda", device="cpu"), ValueError, "needs a CUDA device"),
    (dict(kind="cuda", device=-1), ValueError, "negative"),
    (dict(kind="cuda", device=0, stream="fast"), TypeError, "stream is None"),
    (dict(kind="cuda", device=0, stream=-5), TypeError, "stream is None"),
    (dict(kind="cuda", device=0, workspace_bytes=-1), ValueError, "workspace_bytes must be an int >= 0"),
])
def test_backend_arguments_are_checked_before_any_device_work(kwargs, exc, text):
    with pytest.raises(exc, match=text):
        runtime.Backend(**kwargs)


class _FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


def test_stream_handles_map_torchs_default_stream_to_cuda_stream_legacy():
    # zbpp reads NULL as "the backend's own stream"; torch's default stream has handle 0, so it
    # must reach the library as cudaStreamLegacy (0x1), the same stream under a non-NULL name.
    assert cuda.stream_handle(None) is None
    assert cuda.stream_handle(0) == runtime.CUDA_STREAM_LEGACY == 1
    assert cuda.stream_handle(_FakeStream(0)) == 1
    assert cuda.stream_handle(_FakeStream(0x7F00AB)) == 0x7F00AB
    for bad in (-1, True, 1.5, _FakeStream(None)):
        with pytest.raises(TypeError):
            cuda.stream_handle(bad)
    host = runtime.Backend("host")
    try:
        host.set_stream(None)
        host.synchronize()
        with pytest.raises(zbpp.ZbError, match="accepts only NULL"):
            host.set_stream(0)
    finally:
        host.close()


def _nccl_args(**change):
    args = dict(rank=0, ranks=2, unique_id=bytes(runtime.NCCL_UNIQUE_ID_BYTES), timeout=10.0)
    args.update(change)
    return args


@pytest.mark.parametrize("change,exc,text", [
    (dict(ranks=0), ValueError, "ranks must be an int >= 1"),
    (dict(rank=2), ValueError, r"rank must be an int in \[0, 1\]"),
    (dict(rank=-1), ValueError, r"rank must be an int in \[0, 1\]"),
    (dict(unique_id=bytes(64)), ValueError, "exactly 128 bytes"),
    (dict(unique_id="0" * 128), TypeError, "128 bytes of nccl_unique_id"),
    (dict(timeout=0), ValueError, "timeout must be a number of seconds > 0"),
    (dict(ranks=3, rank=1), ValueError, "the schedule has 2 ranks but ranks=3"),
    (dict(), ValueError, "needs a CUDA backend"),  # everything right but the host backend
])
def test_nccl_transport_arguments(change, exc, text):
    schedule = zbpp.Schedule.generate("1f1b", p=2, m=2)
    backend = runtime.Backend("host")
    try:
        with pytest.raises(exc, match=text):
            runtime.Transport.nccl(backend=backend, schedule=schedule, **_nccl_args(**change))
        with pytest.raises(TypeError, match="must be a zbpp.Schedule"):
            runtime.Transport.nccl(backend=backend, schedule=object(), **_nccl_args())
    finally:
        backend.close()
        schedule.close()


@pytest.mark.parametrize("change,exc,text", [
    (dict(ranks=0), ValueError, "ranks must be an int >= 1"),
    (dict(rank=2), ValueError, r"rank must be an int in \[0, 1\]"),
    (dict(unique_id=bytes(64)), ValueError, "exactly 128 bytes"),
    (dict(timeout=-1), ValueError, "timeout must be a number of seconds > 0"),
    (dict(), ValueError, "Transport.nccl_group moves device buffers, so it needs a CUDA backend"),
])
def test_nccl_group_transport_arguments(change, exc, text):
    backend = runtime.Backend("host")
    try:
        with pytest.raises(exc, match=text):
            runtime.Transport.nccl_group(backend=backend, **_nccl_args(**change))
    finally:
        backend.close()


def _shared_id_worker(rank, world, key, out_dir):
    import types

    import torch.distributed as dist

    from zbpp.pipelining import PipelineSchedule

    pipeline_worker._init(rank, world, key)
    me = types.SimpleNamespace(rank=rank, group=None)
    try:
        got = {"id": PipelineSchedule._shared_nccl_id(me, None, "cpu", " for lane S")}
    except zbpp.ZbError as err:
        got = {"code": err.code, "text": str(err)}
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_every_rank_gets_rank_0s_nccl_id_or_its_failure_at_once(tmp_path):
    """The unique id of an NCCL communicator (the pipeline's, each vocabulary lane's) goes from
    pipeline rank 0 to every rank with a flag: where rank 0 cannot make one (no NCCL here, or a
    failure there), the others fail at once naming it, instead of waiting out their timeout in
    the communicator's creation."""
    import torch.multiprocessing as mp

    mp.spawn(_shared_id_worker, args=(2, pipeline_worker.fresh_key("uid"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    if "id" in r0:  # NCCL is there: both have the same 128 bytes
        assert r0["id"] == r1["id"] and len(r0["id"]) == runtime.NCCL_UNIQUE_ID_BYTES
        return
    assert r0["code"] != runtime.ZB_ERR_REMOTE, "rank 0 raises its own error"
    assert r1["code"] == runtime.ZB_ERR_REMOTE
    assert "rank 1: pipeline rank 0 could not make an NCCL unique id for lane S" in r1["text"]


def test_nccl_unique_id_is_128_bytes_or_a_zb_error():
    try:
        a, b = runtime.nccl_unique_id(), runtime.nccl_unique_id()
    except zbpp.ZbError as err:
        # No NCCL on this machine (or a build without CUDA): a status, not a crash.
        assert err.code in (runtime.ZB_ERR_UNSUPPORTED, runtime.ZB_ERR_NCCL, runtime.ZB_ERR_CUDA), str(err)
        return
    assert isinstance(a, bytes) and len(a) == runtime.NCCL_UNIQUE_ID_BYTES
    assert a != b, "two unique ids must differ"


def test_pipeline_stage_rejects_devices_it_cannot_use():
    with pytest.raises(ValueError, match="allowed: cpu, cuda"):
        zbpp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, torch.device("meta"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is false"):
            zbpp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, "cuda")
    else:
        with pytest.raises(ValueError, match="does not exist"):
            zbpp.PipelineStage(torch.nn.Linear(2, 2), 0, 1, f"cuda:{torch.cuda.device_count()}")


def test_cpu_store_is_the_host_store_under_every_name():
    st = default_store()
    assert st is default_store("cpu") is default_store(torch.device("cpu"))
    assert st.backend.kind == "host" and not st.is_cuda


def test_device_norm_formula_equals_the_cpu_path():
    # optim.py computes CUDA gradients' norms with _device_sq and CPU ones the original way; on the
    # same tensor both must give the same float64 sum (small tensors: one piece, the same bits).
    from zbpp import optim

    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    sq, bad = optim._device_sq(g)
    assert sq.item() == float(g.double().pow(2).sum()) and not bool(bad)
    g[17] = float("inf")
    assert bool(optim._device_sq(g)[1])


def test_device_norm_in_pieces(monkeypatch):
    from zbpp import optim

    monkeypatch.setattr(optim, "_PIECE", 7)  # 1000 elements: 143 pieces
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    sq, bad = optim._device_sq(g)
    want = float(g.double().pow(2).sum())
    assert abs(sq.item() - want) <= 1e-12 * want and not bool(bad)
    g[999] = float("nan")
    assert bool(optim._device_sq(g)[1]), "a NaN in the last piece is found"


def _kernel_or_skip(fn):
    try:
        return fn()
    except zbpp.ZbError as err:
        if err.code == runtime.ZB_ERR_UNSUPPORTED:
            pytest.skip(f"the library's optimizer kernels are not there yet: {err}")
        raise


def _adamw_case(device, dtype=torch.float32, n=3):
    g = torch.Generator().manual_seed(7)
    shapes = [(33, 17), (128,), (5, 5, 5)]
    params = [torch.randn(*s, generator=g).to(device) for s in shapes]
    grads = [[(torch.randn(*s, generator=g) * 0.1).to(device, dtype) for s in shapes] for _ in range(n)]
    return params, grads


def _torch_adamw(params, grads, **hyper):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps, foreach=False, **hyper)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.float()
        opt.step()
    return [p.detach() for p in ps], opt


def _run_kernel(params, grads, undo_check=False, **hyper):
    ps = [p.clone() for p in params]
    gbuf = [torch.zeros_like(g) for g in grads[0]]
    kern = cuda.OptimKernel(ps, gbuf, kind="adamw", lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"])
    for step in grads:
        for b, g in zip(gbuf, step):
            b.copy_(g)
        if undo_check:
            before = [p.clone() for p in ps] + [s.clone() for s in kern.state1 + kern.state2]
            buf = kern.undo_buffer()
            kern.step(undo=buf)
            kern.undo(buf)
            after = ps + kern.state1 + kern.state2
            assert all(torch.equal(a, b) for a, b in zip(before, after)), "undo restores bit for bit"
        kern.step()
    return ps, kern


HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def test_optim_kernel_host_reference_matches_torch_adamw():
    params, grads = _adamw_case("cpu")
    want, opt = _torch_adamw(params, grads, **HYPER)
    got, kern = _kernel_or_skip(lambda: _run_kernel(params, grads, undo_check=True, **HYPER))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"differs by {(a - b).abs().max().item():.3g}"
    for k, p in enumerate(opt.param_groups[0]["params"]):
        st = opt.state[p]
        # torch 2.x updates exp_avg with lerp_ and 1.13 with mul_/add_: they round differently, by up
        # to an ulp of the larger operand (grad / 10 here, ~1e-9), which the absolute tolerances allow.
        assert torch.allclose(kern.state1[k], st["exp_avg"], rtol=1e-6, atol=2e-8)
        assert torch.allclose(kern.state2[k], st["exp_avg_sq"], rtol=1e-6, atol=1e-10)


def test_sq_norm_host_reference():
    g = torch.Generator().manual_seed(9)
    ts = [torch.randn(100, generator=g), torch.randn(7, 3, generator=g)]
    sq, bad = _kernel_or_skip(lambda: cuda.sq_norm(ts))
    want = sum(float(t.double().pow(2).sum()) for t in ts)
    assert abs(sq.item() - want) <= 1e-12 * want and bad.item() == 0
    ts[1][2, 1] = float("inf")
    assert cuda.sq_norm(ts)[1].item() == 1


# ---- GPU: split Linear -------------------------------------------------------------------------------

def _sleep_stream(cycles=50_000_000):
    # Keeps the current stream busy for a while (tens of ms), so work issued after it on the same
    # stream is late, and work on a wrongly chosen stream would overtake it and read stale data.
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(cycles)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("side_stream", [False, True])
def test_split_linear_cuda_matches_nn_linear(dtype, main_grad, side_stream):
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(11)
    lin = torch.nn.Linear(96, 40).to(dev, dtype)
    ref32 = copy.deepcopy(lin).float()
    zbpp.split_linear(lin)
    if main_grad:
        for p in lin.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
    x = torch.randn(3, 24, 96, device=dev).to(dtype)
    g = torch.randn(3, 24, 40, device=dev).to(dtype)
    stream = torch.cuda.Stream(dev) if side_stream else torch.cuda.current_stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        _sleep_stream()
        for _ in range(2):  # twice: the second W accumulates
            lin(x).backward(g)
    if side_stream:
        st = default_store(dev)
        assert st.backend.stream == stream.cuda_stream, "W ran on the stream that was current"
    torch.cuda.current_stream(dev).wait_stream(stream)
    for _ in range(2):
        ref32(x.float()).backward(g.float())
    for name in ("weight", "bias"):
        p, r = getattr(lin, name), getattr(ref32, name).grad
        if main_grad:
            assert p.grad is None, f"{name}: gradients go to main_grad"
            got, bound = p.main_grad, REL_FP32
        else:
            assert p.grad.dtype == dtype
            got, bound = p.grad, (REL_FP32 if dtype == torch.float32 else 1e-2)
        assert _rel(got, r) < bound, f"{name} ({dtype}, main_grad={main_grad}): {_rel(got, r):.3g} >= {bound}"
    assert default_store(dev).live_entries() == 0


@pytest.mark.gpu
def test_w_run_on_another_stream_records_it_and_keeps_memory_safe(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(12)
    lin = torch.nn.Linear(256, 128).to(dev)
    ref = copy.deepcopy(lin)
    zbpp.split_linear(lin)
    lin.weight.main_grad = torch.zeros(128, 256, device=dev)
    lin.bias.main_grad = torch.zeros(128, device=dev)
    x = torch.randn(512, 256, device=dev)
    g = torch.randn(512, 128, device=dev)
    ref(x).backward(g)
    recorded = []
    original = torch.Tensor.record_stream

    def spy(self, stream):
        recorded.append((self.data_ptr(), stream.cuda_stream))
        return original(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    push, run = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    push.wait_stream(torch.cuda.current_stream(dev))
    st = default_store(dev)
    with torch.cuda.stream(push):
        xs = x.clone()
        dy = g.clone()
        with capture(stage=0, mb=0, device=dev):
            lin(xs).backward(dy)
    assert st.store.pending(0) == 1 and not recorded
    with torch.cuda.stream(run):
        _sleep_stream()  # the GEMM waits behind this; the push stream goes on meanwhile
        st.store.pop_run(0)
    on_run = {ptr for ptr, s in recorded if s == run.cuda_stream}
    # x (saved by forward: xs itself) and the incoming gradient, plus the main_grads (harmless).
    assert xs.data_ptr() in on_run and len(on_run) >= 2, f"record_stream(run) calls: {recorded}"
    del xs, dy
    with torch.cuda.stream(push):
        # Without record_stream these would reuse x's and dy's blocks before the GEMM read them.
        junk = [torch.full((512, 256), float("nan"), device=dev) for _ in range(4)]
    torch.cuda.synchronize(dev)
    del junk
    assert _rel(lin.weight.main_grad, ref.weight.grad) < REL_FP32
    assert _rel(lin.bias.main_grad, ref.bias.grad) < REL_FP32
    assert st.live_entries() == 0


# ---- GPU: pipelines ----------------------------------------------------------------------------------

def _config():
    return pipeline_worker.model_config()


def _reference(device):
    """The whole model trained sequentially on one GPU, W run at once: (losses, parameters)."""
    from test_pipeline import reference

    return reference(steps=STEPS, m=M, batch=BATCH, seed=SEED, lr=LR, device=device)


def _pipeline_worker(rank, world, init, out_dir, one_gpu=False):
    """One rank of a ZB-V pipeline on GPU `rank` modulo the GPUs there are (on GPU 0 with
    one_gpu), 2 stages per rank, trained STEPS steps."""
    index = 0 if one_gpu else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    result = {}
    try:
        dev = torch.device("cuda", index)
        S = 2 * world
        modules = gpt.build_stages(_config(), S, seed=SEED)
        mine = [rank, S - 1 - rank]
        stages = [zbpp.PipelineStage(zbpp.split_linear(modules[s]).to(dev), s, S, dev) for s in mine]
        sched = zbpp.ScheduleZBVZeroBubble(stages, M, loss_fn=gpt.loss_fn, timeout=60.0)
        params = [p for st in stages for p in st.submod.parameters()]
        opt = torch.optim.AdamW(params, lr=LR, foreach=False)
        data = gpt.Batches(8, BATCH, seed=SEED)
        losses = []
        for _ in range(STEPS):
            x, y = (t.to(dev) for t in data.next())
            got = []
            if sched.holds_first:
                sched.step(x, target=y, losses=got)
            else:
                sched.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if got:
                losses.append([float(v) for v in got])
        result = {"params": {s: [p.detach().cpu() for p in modules[s].parameters()] for s in mine},
                  "losses": losses, "live": default_store(dev).live_entries(),
                  "device": torch.cuda.get_device_name(dev),
                  # the pipeline's device transport: staged through host memory, or NCCL
                  "staged": getattr(getattr(sched, "_nccl", None), "_inner", None) is not None}
        sched.close()
    except BaseException:  # noqa: BLE001 - the test prints it
        import traceback

        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawn_pipeline(world, tmp_path, one_gpu=False):
    import torch.multiprocessing as mp

    if world == 1:
        init = f"file://{tmp_path / 'store'}"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(_pipeline_worker, args=(world, init, str(tmp_path), one_gpu), nprocs=world, join=True)
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return out


def _compare_with_reference(results, world):
    want_losses, want = _reference(torch.device("cuda", 0))
    S = 2 * world
    counts = [len(list(m.parameters())) for m in gpt.build_stages(_config(), S, seed=SEED)]
    offsets = [sum(counts[:s]) for s in range(S)]
    for r, res in enumerate(results):
        assert res["live"] == 0, f"rank {r}: the W store still holds {res['live']} entries"
        for s, got in res["params"].items():
            for k, p in enumerate(got):
                q = want[offsets[s] + k]
                assert torch.equal(p, q), (f"rank {r}, stage {s}, parameter {k}: differs by "
                                           f"{(p - q).abs().max().item():.3g} from the sequential loop")
    assert results[0]["losses"] == want_losses


@pytest.mark.gpu
def test_one_gpu_holds_both_stages_of_zbv_and_trains_like_a_loop(tmp_path):
    _compare_with_reference(_spawn_pipeline(1, tmp_path), 1)


def test_ranks_sharing_a_gpu_are_found_alike_on_every_rank():
    # NCCL refuses two ranks of a communicator on one GPU; every rank finds the ranks that share
    # one from the same gathered list, so every rank picks the same transport.
    a, b = ("host1", "GPU-aaaa"), ("host1", "GPU-bbbb")
    assert cuda.shared_gpus([a, b]) is None
    assert cuda.shared_gpus([a, ("host2", "GPU-aaaa")]) is None  # equal UUIDs on two hosts: two GPUs
    text = cuda.shared_gpus([a, b, a, b])
    assert text.startswith("pipeline ranks 0, 2 share one GPU (GPU-aaaa on host1)")
    assert "1 more GPU(s) likewise" in text


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_train_like_a_loop_through_host_memory(tmp_path):
    # Two processes on GPU 0: NCCL cannot join them, so the pipeline stages its messages through
    # host memory (Transport.staged over the host transport), warns once, and trains bit for bit.
    results = _spawn_pipeline(2, tmp_path, one_gpu=True)
    assert all(r["staged"] for r in results), "ranks on one GPU must not be given NCCL"
    _compare_with_reference(results, 2)


@pytest.mark.gpu
def test_two_ranks_over_nccl_train_like_a_loop(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    results = _spawn_pipeline(2, tmp_path)
    assert not any(r["staged"] for r in results), "ranks on two GPUs must use NCCL"
    if len({r["device"] for r in results}) != 1:
        pytest.skip(f"GPUs of different models ({[r['device'] for r in results]}) need not give the same bits")
    _compare_with_reference(results, 2)


# ---- GPU: optimizer kernels and post-validation --------------------------------------------------

@pytest.mark.gpu
def test_optim_kernel_on_cuda_matches_torch_adamw_and_the_host_reference():
    dev = torch.device("cuda", torch.cuda.current_device())
    params, grads = _adamw_case(dev)
    want, _ = _torch_adamw(params, grads, **HYPER)
    got, _ = _kernel_or_skip(lambda: _run_kernel(params, grads, undo_check=True, **HYPER))
    host, _ = _kernel_or_skip(lambda: _run_kernel([p.cpu() for p in params], [[g.cpu() for g in s] for s in grads],
                                                  **HYPER))
    for a, b, h in zip(got, want, host):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"vs torch: {(a - b).abs().max().item():.3g}"
        assert torch.allclose(a.cpu(), h, rtol=1e-6, atol=1e-7), f"vs host: {(a.cpu() - h).abs().max().item():.3g}"
    bf_params, bf_grads = _adamw_case(dev, torch.bfloat16)
    got_bf, _ = _run_kernel(bf_params, bf_grads, **HYPER)
    want_bf, _ = _torch_adamw(bf_params, bf_grads, **HYPER)  # widened to fp32, as the kernel does
    for a, b in zip(got_bf, want_bf):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_sq_norm_on_cuda_matches_float64():
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(4096, 3, generator=g).to(dev), torch.randn(1000, generator=g).to(dev)]
    sq, bad = _kernel_or_skip(lambda: cuda.sq_norm(ts))
    want = sum(float(t.double().pow(2).sum()) for t in ts)
    assert abs(sq.item() - want) <= 1e-12 * want and bad.item() == 0
    again, _ = cuda.sq_norm(ts)
    assert again.item() == sq.item(), "deterministic on the same inputs"
    ts[0][5, 1] = float("nan")
    assert cuda.sq_norm(ts)[1].item() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("undo_memory", ["device", "host"])
def test_post_validation_on_cuda_costs_only_its_undo_record(undo_memory):
    """On CUDA the wrapper takes the library's kernels by default: a step needs no device memory
    beyond its undo record (none with undo_memory='host'), copies nothing, and steps as the same
    kernels' C reference does on the CPU."""
    dev = torch.device("cuda", torch.cuda.current_device())

    def run(device):
        g = torch.Generator().manual_seed(22)
        stages = {s: [torch.nn.Parameter(torch.randn(256, 1024, generator=g).to(device)) for _ in range(2)]
                  for s in range(2)}
        opt = torch.optim.AdamW([p for ps in stages.values() for p in ps], lr=0.05, foreach=False)
        post = zbpp.PostValidatedOptimizer(opt, stages, 2, clip_grad=0.5, fused=True,
                                           undo_memory=undo_memory if device != "cpu" else "device")
        assert post.fused
        extra = []
        for step in range(3):
            for ps in stages.values():
                for p in ps:
                    p.grad = (torch.randn(p.shape, generator=g) * (1 + step)).to(device)
            if device != "cpu":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            post.step()
            if device != "cpu":
                torch.cuda.synchronize()
                extra.append(torch.cuda.max_memory_allocated() - base)
        post.close()
        return [p.detach().cpu() for ps in stages.values() for p in ps], extra

    got, extra = run(dev)
    elems = 4 * 256 * 1024
    record = 12 * elems if undo_memory == "device" else 0
    # The first step makes AdamW's state (8 bytes per element) and the record; later steps nothing.
    assert max(extra[1:]) <= 64 * 1024, f"transient device memory per step: {extra}"
    assert extra[0] <= 8 * elems + record + 64 * 1024, f"first step: {extra[0]} bytes"
    ref, _ = run("cpu")
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"kernel vs its C reference: {(a - b).abs().max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_post_validated_optimizer_on_cuda(clip):
    dev = torch.device("cuda", torch.cuda.current_device())

    def run(device, post_validation):
        g = torch.Generator().manual_seed(21)
        stages = {s: [torch.nn.Parameter(torch.randn(17, 9, generator=g).to(device)) for _ in range(2)]
                  for s in range(2)}
        opt = torch.optim.AdamW([p for ps in stages.values() for p in ps], lr=0.05, foreach=False)
        post = zbpp.PostValidatedOptimizer(opt, stages, 2, clip_grad=clip, post_validation=post_validation)
        norms = []
        for step in range(3):
            for ps in stages.values():
                for p in ps:
                    p.grad = (torch.randn(p.shape, generator=g) * (1 + step)).to(device)
            norms.append(post.step().grad_norm)
        post.close()
        return [p.detach().cpu() for ps in stages.values() for p in ps], norms

    spec, spec_norms = run(dev, True)
    sync, sync_norms = run(dev, False)
    assert all(torch.equal(a, b) for a, b in zip(spec, sync)), "post-validation equals the synchronous path"
    assert spec_norms == sync_norms
    host, host_norms = run("cpu", True)
    for a, b in zip(spec, host):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"CUDA vs CPU AdamW: {(a - b).abs().max().item():.3g}"
    for a, b in zip(spec_norms, host_norms):
        assert abs(a - b) <= 1e-9 * b, f"grad norm {a!r} on CUDA, {b!r} on CPU"


@pytest.mark.gpu
def test_offload_on_cuda_is_bit_for_bit_and_frees_device_memory():
    """offload= on a CUDA stage (one rank, GPipe: every microbatch's activations wait for the
    backwards): the copies go to pinned host memory on a stream of their own and come back before
    their backward reads them; the gradients are the bits of the same schedule without offload, and
    the saved-activation peak is below what GPipe keeps (m microbatches)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(21)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(dev)
    x, y = torch.randn(256, 256, device=dev), torch.randn(256, 256, device=dev)
    grads = []
    for offload in (None, "auto"):
        model = copy.deepcopy(net)
        stage = zbpp.PipelineStage(model, 0, 1, dev)
        times = {"f": 1, "b": 1, "w": 1, "offload": 0.25, "reload": 0.25} if offload else None
        sched = zbpp.ScheduleGPipe(stage, 8, loss_fn=lambda o, t: ((o - t) ** 2).mean(), offload=offload, times=times)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            sched.step(x, target=y)
        torch.cuda.synchronize()
        if offload:
            rep = sched.offload_report()
            assert rep["host_peak_bytes"] > 0
            assert rep["device_peak_bytes"] < 8 * rep["bytes_per_microbatch"]
        grads.append([p.grad.clone() for p in model.parameters()])
        sched.close()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
