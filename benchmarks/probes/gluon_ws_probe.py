"""Probe (not part of the package; Hopper GPU; Triton 3.6 and 3.9): the one-step Gluon W4A16 kernel
warp-specialized (docs/perf_log.md v29). A producer (1 or 4 warps) streams each K step's packed words
and x tile into a ring with cp.async and signals a per-slot 'ready' mbarrier (cp.async.mbarrier.arrive
.noinc, one arrival per producer thread); the consumer warpgroup waits on 'ready', dequantizes (q - z
exactly, the package's asm), issues both chunks' wgmmas, waits for them, arrives on 'empty' and
scales the two products into the accumulator. Nothing is in flight across an mbarrier wait (ptxas
serialized v26's overlap consumer there: C7513), and there is no CTA barrier in the K loop.

    PYTHONPATH=src python benchmarks/probes/gluon_ws_probe.py compile   # no GPU: registers, spills, setmaxnreg
    PYTHONPATH=src python benchmarks/probes/gluon_ws_probe.py ab        # GPU: against the table and the overlap
                                                                        # tile, M = 16 / 32, 5 shapes, splits 1-4
    PYTHONPATH=src python benchmarks/probes/gluon_ws_probe.py bound     # GPU: without x's or the words' copies

What it showed (H100, fp16 g128, M = 16, split 1, same process): 8192x57344 table 103.4 us, the
overlap tile 108.2, this kernel 104.7 (4 stages) / 107.2 (6); 4096x28672 29.2 / 31.5 / 30.8 / 34.1;
outputs within the one-step kernel's error (3e-4 relative); that run used maxnreg 128 and a 1-warp
producer (2 CTAs per SM). Triton rounds a 1-warp worker up to a warpgroup and redistributes the
registers with setmaxnreg (`compile` prints it): with maxnreg 80 (3 CTAs of 256 threads per SM)
the consumer gets 136 and the producer 24, which a 1-warp producer cannot live with (240 bytes of
spill: its per-vector cp.async pointers) but a 4-warp one can (no spill, fp16 and bf16 with zero
points, BM 16; sm_90a, Triton 3.6). Measured in v30 (`ab`, `bound`): no form beats the table by
more than 2% (the 3-CTA one is no faster than the 2-CTA one), x's copies cost 0-4% at M = 16 and
the words' 25-35%; not integrated.
"""
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                             warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents

from sailfish.kernels.gluon_common import CHUNK_C as _CHUNK, STEP_C as _STEP, program as _program, rows as _rows
from sailfish.kernels.w4a16_gluon import (_async_load, _chunk_weights, _scale_values, _step_scales, _store, layouts, CHUNK)


@gluon.jit
def _producer(x_ptr, qw_ptr, M, N, K, stride_xm, stride_qn, x_buf, w_buf, ready, empty, SPLIT_K: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, X_BLK1: gl.constexpr,
              W_BLK1: gl.constexpr, SKIP: gl.constexpr):
    pid_n, pid_m, pid_k, first, n = _program(M, K, SPLIT_K, BLOCK_M)
    wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_BLK1))
    wn = (wn % N).to(gl.int64)
    ww = gl.arange(0, 16, layout=gl.SliceLayout(0, W_BLK1))
    w_ptrs = qw_ptr + wn[:, None] * stride_qn + (first * 32 + ww)[None, :]
    xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_BLK1))
    xm = (xm % M).to(gl.int64)
    xk = gl.arange(0, _CHUNK, layout=gl.SliceLayout(0, X_BLK1))
    x_ptrs = x_ptr + xm[:, None] * stride_xm + (first * _STEP + xk)[None, :]
    for j in range(n):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        if SKIP != 2:  # SKIP (timing bounds only, wrong outputs): 1 leaves out the x copies, 2 the words'
            _async_load(w_buf.index(2 * s), w_ptrs + j * 32, eviction_policy="evict_first")
            _async_load(w_buf.index(2 * s + 1), w_ptrs + (j * 32 + 16), eviction_policy="evict_first")
        if SKIP != 1:
            _async_load(x_buf.index(2 * s), x_ptrs + j * _STEP)
            _async_load(x_buf.index(2 * s + 1), x_ptrs + (j * _STEP + _CHUNK))
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _consumer(s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_ym, stride_sn, x_buf, w_buf, ready, empty,
              GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr,
              WORDS: gl.constexpr, DOT_A: gl.constexpr, DT: gl.constexpr):
    pid_n, pid_m, pid_k, first, n = _program(M, K, SPLIT_K, BLOCK_M)
    s_base = _rows(s_ptr, pid_n, N, stride_sn, BLOCK_N, MMA)
    z_base = _rows(z_ptr, pid_n, N, stride_sn, BLOCK_N, WORDS)
    zn0, zn1 = _step_scales(s_base, first, GROUP_CHUNKS)  # (symmetric: unused)
    if HAS_ZEROS:
        zn0, zn1 = _step_scales(z_base, first, GROUP_CHUNKS)
    sn0, sn1 = _step_scales(s_base, first, GROUP_CHUNKS)
    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
    zero = warpgroup_mma_init(gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA))
    for i in range(n):
        slot = i % STAGES
        z0 = None
        z1 = None
        if HAS_ZEROS:
            z0, z1 = _scale_values(zn0, zn1, DT)
            zn0, zn1 = _step_scales(z_base, first + gl.minimum(i + 1, n - 1), GROUP_CHUNKS)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        w0 = _chunk_weights(w_buf.index(2 * slot).load(WORDS), DT, BLOCK_N, DOT_A, z0)
        w1 = _chunk_weights(w_buf.index(2 * slot + 1).load(WORDS), DT, BLOCK_N, DOT_A, z1)
        fence_async_shared()
        x0 = x_buf.index(2 * slot).permute((1, 0))
        x1 = x_buf.index(2 * slot + 1).permute((1, 0))
        if GROUP_CHUNKS > 0:
            s0, s1 = _scale_values(sn0, sn1, DT)
            sn0, sn1 = _step_scales(s_base, first + gl.minimum(i + 1, n - 1), GROUP_CHUNKS)
            p0 = warpgroup_mma(w0, x0, zero, use_acc=False, is_async=True)
            p1 = warpgroup_mma(w1, x1, zero, use_acc=False, is_async=True)
            p0, p1, w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1, w0, w1))
            mbarrier.arrive(empty.index(slot), count=1)
            acc += p0 * s0[:, None] + p1 * s1[:, None]
        else:
            acc = warpgroup_mma(w0, x0, acc, is_async=True)
            acc = warpgroup_mma(w1, x1, acc, is_async=True)
            acc, w0, w1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w0, w1))
            mbarrier.arrive(empty.index(slot), count=1)
    if GROUP_CHUNKS == 0:
        acc = acc * gl.load(s_base).to(gl.float32)[:, None]
    _store(acc, y_ptr, ws_ptr, bias_ptr, pid_m, pid_n, pid_k, M, N, stride_ym, HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N,
           MMA)


@gluon.jit
def ws_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_ym,
               stride_qn, stride_sn, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr,
               HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PDL_EARLY: gl.constexpr,
               MMA: gl.constexpr, WORDS: gl.constexpr, DOT_A: gl.constexpr, X_BLK: gl.constexpr,
               X_SMEM: gl.constexpr, W_BLK: gl.constexpr, W_SMEM: gl.constexpr,
               X_BLK1: gl.constexpr, W_BLK1: gl.constexpr, PROD_REGS: gl.constexpr, PROD_WARPS: gl.constexpr,
               SKIP: gl.constexpr = 0):
    if PDL_EARLY:  # split-K: the reduce may launch now, it waits for the partial sums (kernels/common.py)
        gdc_launch_dependents()
    DT: gl.constexpr = x_ptr.dtype.element_ty
    x_buf = gl.allocate_shared_memory(DT, [2 * STAGES, BLOCK_M, _CHUNK], X_SMEM)
    w_buf = gl.allocate_shared_memory(gl.int32, [2 * STAGES, BLOCK_N, 16], W_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=32 * PROD_WARPS)  # every producer thread
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_ym, stride_sn, x_buf, w_buf, ready, empty,
                     GROUP_CHUNKS, HAS_ZEROS, HAS_BIAS, SPLIT_K, BLOCK_M, BLOCK_N, STAGES, MMA, WORDS, DOT_A, DT)),
        (_producer, (x_ptr, qw_ptr, M, N, K, stride_xm, stride_qn, x_buf, w_buf, ready, empty, SPLIT_K, BLOCK_M,
                     BLOCK_N, STAGES, X_BLK1, W_BLK1, SKIP)),
    ], [PROD_WARPS], [PROD_REGS])


def producer_layouts(warps=1):
    """The producer's cp.async layouts over `warps` warps (Triton gives a 1-warp worker a whole
    warpgroup's registers anyway; 4 warps hold a quarter of the pointers each)."""
    return dict(X_BLK1=gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[warps, 1],
                                        order=[1, 0]),
                W_BLK1=gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[warps, 1],
                                        order=[1, 0]))


def consts(BLOCK_M, BLOCK_N, STAGES, group_size, SPLIT_K, has_zeros, num_warps, prod_regs=40, prod_warps=1):
    return dict(GROUP_CHUNKS=0 if group_size == -1 else group_size // CHUNK, HAS_ZEROS=has_zeros,
                HAS_BIAS=False, SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
                PDL_EARLY=False, PROD_REGS=prod_regs, PROD_WARPS=prod_warps, **layouts(BLOCK_M, BLOCK_N, num_warps),
                **producer_layouts(prod_warps))


def compile_sm90(BLOCK_M=16, BLOCK_N=64, STAGES=4, group_size=128, SPLIT_K=1, dtype="fp16", num_warps=4,
                 has_zeros=False, maxnreg=None, prod_regs=40, prod_warps=1):
    """triton.compile of ws_kernel for sm_90a without a GPU (Triton 3.6 / 3.9)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    ty = "*fp16" if dtype == "fp16" else "*bf16"
    sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "bias_ptr": "constexpr",
           "y_ptr": ty, "ws_ptr": "*fp32" if SPLIT_K > 1 else "constexpr", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32", "stride_sn": "i32"}
    c = consts(BLOCK_M, BLOCK_N, STAGES, group_size, SPLIT_K, has_zeros, num_warps, prod_regs, prod_warps)
    c["bias_ptr"] = None
    if SPLIT_K == 1:
        c["ws_ptr"] = None
    sig.update({k: "constexpr" for k in c})
    names = list(sig)
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "ws_ptr", "N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if sig[a] != "constexpr"}
    src = GluonASTSource(fn=ws_kernel, signature=sig, constexprs=c, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})})


def main_compile():
    import re

    from sailfish.tools.ptx import ptxas_report, sass
    # (BLOCK_M, BLOCK_N, stages, consumer warps, dtype, zeros, maxnreg, producer registers, producer warps)
    cases = [(16, 64, 4, 4, "fp16", False, 128, 64, 1), (16, 64, 6, 4, "bf16", True, 168, 88, 1),
             (16, 64, 4, 4, "fp16", False, 80, 24, 1), (16, 128, 4, 8, "fp16", False, 168, 40, 1),
             (16, 64, 4, 4, "fp16", False, 80, 24, 4), (16, 64, 4, 4, "fp16", False, 80, 32, 4),
             (16, 64, 4, 4, "bf16", True, 80, 24, 4), (32, 64, 4, 4, "fp16", False, 80, 24, 4)]
    for bm, bn, st, w, dt, z, mr, pr, pw in cases:
        k = compile_sm90(bm, bn, st, 128, 1, dt, w, z, mr, pr, pw)
        ptx = k.asm["ptx"]
        rep = ptxas_report(ptx)
        what = f"BM {bm} / BN {bn} / {w} + {pw} warps / {st} stages {dt}{' zeros' if z else ''}"
        print(f"{what}, maxnreg {mr}, producer {pr}:",
              re.findall(r"\.reqntid \d+", ptx), re.findall(r"Used \d+ registers", rep),
              re.findall(r"\d+ bytes spill stores", rep),
              re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx)[:2],
              "STL", sass(k.asm["cubin"]).count("STL"), [ln for ln in rep.splitlines() if "C75" in ln][:2], flush=True)


def _layers(K, N):
    """A g128 symmetric fp16 QuantLinear of a random nn.Linear and enough deep copies to defeat L2."""
    import copy

    from sailfish import QuantLinear
    from sailfish.bench.timing import copies_needed
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device="cuda")
    base = QuantLinear.from_linear(lin, group_size=128, sym=True)
    R = copies_needed(sum(b.numel() * b.element_size() for b in base.buffers()))
    return [base] + [copy.deepcopy(base) for _ in range(R - 1)]


def _table(K, N, M):
    """The config the launcher takes for fp16 g128 (the package's table or heuristic)."""
    from sailfish.ops.w4a16 import W4A16_TUNER, w4a16_key
    from sailfish.tuning import m_bucket, problem_key
    return W4A16_TUNER.get(w4a16_key(K, N, M, 128, False, False, torch.float16), torch.device("cuda"), None,
                           fallback_key=problem_key("w4a16", K, N, M, "any"), M=m_bucket(M), N=N, Kp=K,
                           group_size=128, general_gidx=False, has_zeros=False)


def _ws_run(x, lay, N, K, bm, bn, warps, maxnreg, split, c, skip=0):
    """One call of ws_kernel (consts c) and, for split-K, the package's reduce (PDL where the GPU has it)."""
    from sailfish.kernels.w4a16 import _splitk_reduce_kernel
    from sailfish.ops.launch import pdl
    from sailfish.ops.w4a16 import _REDUCE_BLOCK
    M = x.shape[0]
    chained = pdl(torch.cuda.current_device())
    y = torch.empty(M, N, dtype=torch.float16, device="cuda")
    ws = torch.empty(split, M, N, dtype=torch.float32, device="cuda") if split > 1 else None
    ws_kernel[(-(-M // bm) * (N // bn), split)](
        x, lay.qweight, lay.scales, lay.scales, None, y, ws, M, N, K, x.stride(0), y.stride(0),
        lay.qweight.stride(0), lay.scales.stride(0), **dict(c, PDL_EARLY=split > 1 and chained, SKIP=skip),
        num_warps=warps, maxnreg=maxnreg)
    if split > 1:
        _splitk_reduce_kernel[(-(-(M * N) // _REDUCE_BLOCK), 1)](
            ws, None, y, M, N, y.stride(0), SPLIT_K=split, HAS_BIAS=False, EMU_BF16=False, BLOCK=_REDUCE_BLOCK,
            PDL=chained, num_warps=4, **({"launch_pdl": True} if chained else {}))
    return y


def _time_all(fns, layers, exact):
    """Relative errors of the `exact` entries against the fp32 product, and best-of-3 times (us),
    alternating the entries."""
    from sailfish.bench.timing import graph_time_us
    base = layers[0]
    ref = fns.x.float() @ base.dequantize().float().T
    err = {k: ((f(base).float() - ref).norm() / ref.norm()).item() for k, f in fns.items() if exact(k)}
    ts = {}
    for _ in range(3):
        for k, f in fns.items():
            ts[k] = min(ts.get(k, 1e9), graph_time_us([lambda lay=lay, f=f: f(lay) for lay in layers]))
    return err, ts


class _Fns(dict):
    def __init__(self, x):
        super().__init__()
        self.x = x


def main_ab(Ms=(16, 32), shapes=((8192, 57344), (28672, 8192), (8192, 10240), (8192, 8192), (4096, 28672))):
    """fp16 g128: the table's config, the overlap tile and this kernel's forms and splits, alternating, best of 3."""
    from sailfish import Config
    from sailfish.ops.w4a16 import gluon_split_ok, w4a16_launch
    print(torch.cuda.get_device_name())
    for K, N in shapes:
        layers = _layers(K, N)
        for M in Ms:
            bm = 16 if M <= 16 else 32
            x = torch.randn(M, K, dtype=torch.float16, device="cuda")
            cfg = _table(K, N, M)

            def launch(c, x=x):
                return lambda lay: w4a16_launch(x, lay.qweight, lay.scales, None, None, None, None, K, 128, config=c)

            fns = _Fns(x)
            fns.update({"table": launch(cfg),
                        "overlap s2": launch(Config(bm, 64, 256, 2, 8, 4, 4, kernel="gluon_overlap"))})
            # (stages, maxnreg, producer registers, producer warps): 2 CTAs per SM with a 1-warp producer
            # (measured, module docstring); 3 per SM: maxnreg 80 x 256 threads, setmaxnreg 136 / 24
            for st, mr, pr, pw in ((4, 128, 64, 1), (4, 80, 24, 4), (3, 80, 24, 4)):
                for split in (1, 2, 4):
                    if gluon_split_ok(split, K // 256):
                        c = consts(bm, 64, st, 128, split, False, 4, pr, pw)
                        fns[f"ws st{st} mr{mr} p{pw} s{split}"] = (
                            lambda lay, x=x, c=c, mr=mr, split=split: _ws_run(x, lay, N, K, bm, 64, 4, mr, split, c))
            err, ts = _time_all(fns, layers, lambda k: True)
            best = min((t, k) for k, t in ts.items() if k.startswith("ws"))
            print(f"{K}x{N} M = {M} (table: {cfg.kernel} BM {cfg.BLOCK_M} / BN {cfg.BLOCK_N} / split {cfg.SPLIT_K}): "
                  f"table {ts['table']:.1f} us, overlap s2 {ts['overlap s2']:.1f}, best ws {best[0]:.1f} ({best[1]}); "
                  f"worst rel. err {max(err.values()):.1e}\n    "
                  + " | ".join(f"{k} {t:.1f}" for k, t in ts.items()), flush=True)
        del layers
        torch.cuda.empty_cache()


def main_bound(Ms=(16, 32), shapes=((8192, 57344, 1), (28672, 8192, 2), (8192, 8192, 2))):
    """Timing bounds (wrong outputs on purpose): each form with the producer's x copies left out
    (SKIP 1) or its word copies left out (SKIP 2), against the full kernel and the table; fp16 g128,
    split per shape, alternating, best of 3. Forms: BN 64 at 2 and 3 CTAs per SM, BN 128 (two
    consumer warpgroups, half the x bytes per weight byte) at 1. H100 results: docs/perf_log.md v30."""
    from sailfish.ops.w4a16 import w4a16_launch
    print(torch.cuda.get_device_name())
    # (name, BLOCK_N, consumer warps, stages, maxnreg, producer registers, producer warps)
    forms = (("bn64 2cta", 64, 4, 4, 128, 64, 1), ("bn64 3cta", 64, 4, 4, 80, 24, 4),
             ("bn128 1cta", 128, 8, 4, 128, 40, 4))
    for K, N, split in shapes:
        layers = _layers(K, N)
        for M in Ms:
            bm = 16 if M <= 16 else 32
            x = torch.randn(M, K, dtype=torch.float16, device="cuda")
            cfg = _table(K, N, M)
            fns = _Fns(x)
            fns["table"] = lambda lay, x=x: w4a16_launch(x, lay.qweight, lay.scales, None, None, None, None, K, 128,
                                                         config=cfg)
            for name, bn, w, st, mr, pr, pw in forms:
                c = consts(bm, bn, st, 128, split, False, w, pr, pw)
                for skip in (0, 1, 2):
                    fns[f"{name} {('full', 'no x', 'no w')[skip]}"] = (
                        lambda lay, x=x, bn=bn, w=w, mr=mr, c=c, skip=skip: _ws_run(x, lay, N, K, bm, bn, w, mr, split,
                                                                                     c, skip))
            err, ts = _time_all(fns, layers, lambda k: not k.endswith(("no x", "no w")))
            print(f"{K}x{N} M = {M} split {split} (table {cfg.kernel} BM {cfg.BLOCK_M} / BN {cfg.BLOCK_N} / split "
                  f"{cfg.SPLIT_K}): worst rel. err of the full forms {max(err.values()):.1e}\n    "
                  + " | ".join(f"{k} {t:.1f}" for k, t in ts.items()), flush=True)
        del layers
        torch.cuda.empty_cache()

if __name__ == "__main__":
    if sys.argv[1:2] == ["compile"]:
        main_compile()
    elif sys.argv[1:2] == ["ab"]:
        main_ab()
    elif sys.argv[1:2] == ["bound"]:
        main_bound()
    else:
        sys.exit(__doc__)
