"""Probe (not part of the package; Hopper GPU; Triton 3.6 and 3.9): 'gluon_pipe' warp-specialized
with a 4-warp cp.async producer instead of the package's one-warp TMA producer
(kernels/w4a16_gluon.w4a16_gluon_pipe_kernel, whose two consumer partitions it shares;
docs/perf_log.md v32). The producer copies x's chunks into the two rings in row blocks of 32 and
signals each slot's 'ready' mbarrier with cp.async.mbarrier.arrive.noinc (128 arrivals); rows past
M are zero-filled. Registers: 168 x 384 threads, setmaxnreg 232 / 232 / 40; the consumers do not
spill, the producer reloads its copy addresses from local memory (LLVM hoists the 16 row
offsets of each chunk out of the loop; sm_90a, Triton 3.6 and 3.9; `compile` prints it).

    PYTHONPATH=src python benchmarks/probes/gluon_ws_pipe_probe.py compile   # no GPU: registers, spills, waits
    PYTHONPATH=src python benchmarks/probes/gluon_ws_pipe_probe.py ab 200,256,512,1024   # GPU, against the
        # shipped path (QuantLinear forward), fp16 g128 and bf16 asymmetric g128; env SHAPES=KxN,...,
        # RINGS=3/4,2/5 and SPLITS=1,2 choose the forms

What it showed (NVIDIA H200, torch 2.11, Triton 3.6, same process, best of 3; the shipped path
then the chunk pipeline with one CTA barrier per step): outputs within the shipped kernels' error
everywhere; 0.85-1.05x the shipped path at M = 200-512 (rings 3/4, 2/5, 4/3 alike) and 0.76-0.85x
of dequantize + cuBLAS at M = 1024. ncu (28672x8192, M = 512): tensor pipe 54% of elapsed cycles
against the barrier kernel's 64%, and ~20% of the stall samples in the consumers' wait on a chunk's
'ready' mbarrier: the producer, not the structure, was short. With a TMA producer (one thread
per copy, no spill) the same consumers reached 79% and 1.04-1.24x; that is the shipped kernel.
"""
import copy
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier
from triton.language.extra.cuda import gdc_launch_dependents

from sailfish import QuantLinear
from sailfish.bench.timing import copies_needed, graph_time_us
from sailfish.kernels.w4a16 import _splitk_reduce_kernel
from sailfish.kernels.gluon_common import CHUNK, CHUNK_C as _CHUNK, STEP_C as _STEP, program as _program
from sailfish.kernels.w4a16_gluon import _async_load, _pipe_consumer, layouts
from sailfish.ops.launch import pdl
from sailfish.ops.w4a16 import _REDUCE_BLOCK


@gluon.jit
def _loader(x_ptr, M, K, stride_xm, x0_buf, x1_buf, ready0, ready1, empty0, empty1, SPLIT_K: gl.constexpr,
            BLOCK_M: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, X_BLK: gl.constexpr):
    pid_n, pid_m, pid_k, first, n = _program(M, K, SPLIT_K, BLOCK_M)
    # x's tile in row blocks of SUB rows, pointers made per block (a (BLOCK_M, 128) pointer tensor
    # spilled the 40-register producer)
    SUB: gl.constexpr = 32
    r = gl.arange(0, SUB, layout=gl.SliceLayout(1, X_BLK))
    xk = gl.arange(0, _CHUNK, layout=gl.SliceLayout(0, X_BLK))
    last = M - 1 - pid_m * BLOCK_M  # rows past M read row M - 1 (their outputs are masked)
    base = x_ptr + (pid_m * BLOCK_M).to(gl.int64) * stride_xm + first * _STEP
    for j in range(n):
        a = j % S0
        mbarrier.wait(empty0.index(a), ((j // S0) & 1) ^ 1)
        for r0 in gl.static_range(0, BLOCK_M, SUB):
            _async_load(x0_buf.index(a).slice(r0, SUB), _x_rows(base + j * _STEP, r, xk, r0, last, stride_xm),
                        mask=_x_mask(r, xk, r0, last))
        async_copy.mbarrier_arrive(ready0.index(a), increment_count=False)
        b = j % S1
        mbarrier.wait(empty1.index(b), ((j // S1) & 1) ^ 1)
        for r0 in gl.static_range(0, BLOCK_M, SUB):
            _async_load(x1_buf.index(b).slice(r0, SUB),
                        _x_rows(base + (j * _STEP + _CHUNK), r, xk, r0, last, stride_xm),
                        mask=_x_mask(r, xk, r0, last))
        async_copy.mbarrier_arrive(ready1.index(b), increment_count=False)


@gluon.jit
def _x_rows(base, r, xk, r0: gl.constexpr, last, stride_xm):
    """Pointers of rows r0 + r of the tile (rows past M: the last row, whose outputs are masked)."""
    return base + (gl.minimum(r + r0, last)[:, None] * stride_xm + xk[None, :])


@gluon.jit
def _x_mask(r, xk, r0: gl.constexpr, last):
    """Rows past M are zero-filled, not read (a clamped row read by 56 rows' copies at once took
    M = 200 from 64 to 104 us on 8192x8192, H200)."""
    return gl.broadcast((r + r0 <= last)[:, None], xk[None, :])[0]


@gluon.jit
def ws_pipe_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_ym,
                   stride_qn, stride_sn, GROUP_CHUNKS: gl.constexpr, HAS_ZEROS: gl.constexpr,
                   HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr,
                   S0: gl.constexpr, S1: gl.constexpr, PDL_EARLY: gl.constexpr,
                   MMA: gl.constexpr, WORDS: gl.constexpr, DOT_A: gl.constexpr, X_BLK: gl.constexpr,
                   X_SMEM: gl.constexpr, CONS_REGS: gl.constexpr, PROD_REGS: gl.constexpr):
    if PDL_EARLY:
        gdc_launch_dependents()
    DT: gl.constexpr = x_ptr.dtype.element_ty
    x0_buf = gl.allocate_shared_memory(DT, [S0, BLOCK_M, _CHUNK], X_SMEM)
    x1_buf = gl.allocate_shared_memory(DT, [S1, BLOCK_M, _CHUNK], X_SMEM)
    ready0 = gl.allocate_shared_memory(gl.int64, [S0, 1], mbarrier.MBarrierLayout())
    empty0 = gl.allocate_shared_memory(gl.int64, [S0, 1], mbarrier.MBarrierLayout())
    ready1 = gl.allocate_shared_memory(gl.int64, [S1, 1], mbarrier.MBarrierLayout())
    empty1 = gl.allocate_shared_memory(gl.int64, [S1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S0):
        mbarrier.init(ready0.index(s), count=128)  # every producer thread (cp.async.mbarrier.arrive.noinc)
        mbarrier.init(empty0.index(s), count=2)  # both consumer warpgroups
    for s in gl.static_range(S1):
        mbarrier.init(ready1.index(s), count=128)
        mbarrier.init(empty1.index(s), count=2)
    gl.warp_specialize([
        (_pipe_consumer, (qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_ym, stride_qn, stride_sn,
                     x0_buf, x1_buf, ready0, ready1, empty0, empty1, 0, GROUP_CHUNKS, HAS_ZEROS, HAS_BIAS, SPLIT_K,
                     BLOCK_M, S0, S1, MMA, WORDS, DOT_A, DT)),
        (_pipe_consumer, (qw_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, stride_ym, stride_qn, stride_sn,
                     x0_buf, x1_buf, ready0, ready1, empty0, empty1, 1, GROUP_CHUNKS, HAS_ZEROS, HAS_BIAS, SPLIT_K,
                     BLOCK_M, S0, S1, MMA, WORDS, DOT_A, DT)),
        (_loader, (x_ptr, M, K, stride_xm, x0_buf, x1_buf, ready0, ready1, empty0, empty1, SPLIT_K, BLOCK_M,
                   S0, S1, X_BLK)),
    ], [4, 4], [CONS_REGS, PROD_REGS])


def consts(BLOCK_M=128, S0=3, S1=4, group_size=128, SPLIT_K=1, has_zeros=False, has_bias=False,
           cons_regs=232, prod_regs=40):
    lay = layouts(BLOCK_M, 64, 4)
    return dict(GROUP_CHUNKS=0 if group_size == -1 else group_size // CHUNK, HAS_ZEROS=has_zeros,
                HAS_BIAS=has_bias, SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, S0=S0, S1=S1, PDL_EARLY=False,
                MMA=lay["MMA"], WORDS=lay["WORDS"], DOT_A=lay["DOT_A"], X_BLK=lay["X_BLK"], X_SMEM=lay["X_SMEM"],
                CONS_REGS=cons_regs, PROD_REGS=prod_regs)


def maxnreg(cons_regs, prod_regs):
    """The launch's register count per thread for 12 warps such that the default partition gets
    cons_regs too (setmaxnreg redistributes per warpgroup)."""
    return (2 * cons_regs + prod_regs) // 3


def compile_sm90(dtype="fp16", cons_regs=232, prod_regs=40, **kw):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    ty = "*fp16" if dtype == "fp16" else "*bf16"
    c = consts(cons_regs=cons_regs, prod_regs=prod_regs, **kw)
    split = c["SPLIT_K"]
    sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty,
           "bias_ptr": ty if c["HAS_BIAS"] else "constexpr", "y_ptr": ty,
           "ws_ptr": "*fp32" if split > 1 else "constexpr", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32", "stride_sn": "i32"}
    if not c["HAS_BIAS"]:
        c["bias_ptr"] = None
    if split == 1:
        c["ws_ptr"] = None
    sig.update({k: "constexpr" for k in c})
    names = list(sig)
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "y_ptr", "ws_ptr", "N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if sig[a] != "constexpr"}
    src = GluonASTSource(fn=ws_pipe_kernel, signature=sig, constexprs=c, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": maxnreg(cons_regs, prod_regs)})


def main_compile():
    import re

    from sailfish.tools.ptx import ptxas_report, sass, wgmma_register_hazard
    cases = [dict(), dict(dtype="bf16", has_zeros=True), dict(group_size=-1), dict(SPLIT_K=2),
             dict(cons_regs=240, prod_regs=24)]
    for kw in cases:
        k = compile_sm90(**kw)
        ptx = k.asm["ptx"]
        rep = ptxas_report(ptx)
        s = sass(k.asm["cubin"])
        print(kw, triton.__version__, re.findall(r"\.reqntid \d+|\.maxnreg \d+", ptx),
              re.findall(r"Used \d+ registers", rep),
              re.findall(r"\d+ bytes spill stores", rep),
              re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx)[:3],
              "STL", s.count("STL"), "BAR.SYNC", s.count("BAR.SYNC"), "serialized" in rep,
              "hazard", wgmma_register_hazard(s),
              "waits", sorted(set(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx))),
              "smem", k.metadata.shared, flush=True)
        if "serialized" in rep:
            print(rep[rep.index("serialized") - 200:][:500])



def layers(K, N, dtype, sym):
    """A g128 QuantLinear of a random nn.Linear and enough deep copies to defeat L2."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False, dtype=dtype, device="cuda")
    base = QuantLinear.from_linear(lin, group_size=128, sym=sym)
    R = copies_needed(sum(b.numel() * b.element_size() for b in base.buffers()))
    return [base] + [copy.deepcopy(base) for _ in range(R - 1)]


def ws_run(x, lay, split, S0=3, S1=4, cons=232, prod=40):
    """One call of ws_pipe_kernel and, for split-K, the package's reduce (PDL where the GPU has it)."""
    M, K = x.shape
    N = lay.qweight.shape[0]
    chained = pdl(torch.cuda.current_device())
    c = consts(BLOCK_M=128, S0=S0, S1=S1, group_size=128, SPLIT_K=split, has_zeros=lay.zeros is not None,
               cons_regs=cons, prod_regs=prod)
    c["PDL_EARLY"] = split > 1 and chained
    y = torch.empty(M, N, dtype=x.dtype, device="cuda")
    ws = torch.empty(split, M, N, dtype=torch.float32, device="cuda") if split > 1 else None
    z = lay.zeros if lay.zeros is not None else lay.scales
    ws_pipe_kernel[(-(-M // 128) * (-(-N // 128)), split)](
        x, lay.qweight, lay.scales, z, None, y, ws, M, N, K, x.stride(0), y.stride(0), lay.qweight.stride(0),
        lay.scales.stride(0), **c, num_warps=4, maxnreg=maxnreg(cons, prod))
    if split > 1:
        _splitk_reduce_kernel[(-(-(M * N) // _REDUCE_BLOCK), 1)](
            ws, None, y, M, N, y.stride(0), SPLIT_K=split, HAS_BIAS=False, EMU_BF16=x.dtype == torch.bfloat16,
            BLOCK=_REDUCE_BLOCK, PDL=chained, num_warps=4, **({"launch_pdl": True} if chained else {}))
    return y


def main(argv):
    print(torch.cuda.get_device_name(), flush=True)
    shapes = [(8192, 8192), (8192, 28672), (28672, 8192), (8192, 57344), (4096, 14336), (8192, 10240)]
    if os.environ.get("SHAPES"):
        shapes = [tuple(int(v) for v in t.split("x")) for t in os.environ["SHAPES"].split(",")]
    rings = [tuple(int(v) for v in t.split("/")) for t in os.environ.get("RINGS", "3/4").split(",")]
    splits = [int(v) for v in os.environ.get("SPLITS", "1,2").split(",")]
    Ms = [int(a) for a in argv[0].split(",")] if argv else [256, 512, 1024]
    fmts = [(torch.float16, True), (torch.bfloat16, False)]
    for K, N in shapes:
        for dtype, sym in fmts:
            lays = layers(K, N, dtype, sym)
            W = lays[0].dequantize().float()
            for M in Ms:
                x = torch.randn(M, K, dtype=dtype, device="cuda")
                ref = x.float() @ W.T
                fns = {"shipped": lambda lay: lay(x)}
                for split in splits:
                    for S0, S1 in rings:
                        fns[f"ws cp.async s{split} r{S0}/{S1}"] = (
                            lambda lay, split=split, S0=S0, S1=S1: ws_run(x, lay, split, S0, S1))
                errs = {}
                for k, f in fns.items():
                    y = f(lays[0]).float()
                    errs[k] = ((y - ref).abs().max() / ref.abs().max()).item()
                ts = {}
                for _ in range(3):
                    for k, f in fns.items():
                        ts[k] = min(ts.get(k, 1e9), graph_time_us([lambda lay=lay, f=f: f(lay) for lay in lays]))
                best = min((t, k) for k, t in ts.items() if k != "shipped")
                print(f"{K}x{N} {'fp16 sym' if sym else 'bf16 asym'} M={M}: shipped {ts['shipped']:.1f} us | "
                      + " | ".join(f"{k} {t:.1f}" for k, t in ts.items() if k != "shipped")
                      + f" | best/shipped {ts['shipped'] / best[0]:.3f} | max err "
                      + " ".join(f"{k} {e:.1e}" for k, e in errs.items()), flush=True)
            del lays
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile"]:
        main_compile()
    elif sys.argv[1:2] == ["ab"]:
        main(sys.argv[2:3])
    else:
        sys.exit(__doc__)
