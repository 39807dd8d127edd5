"""Probe (not part of the package; Hopper GPU; Triton 3.6 and 3.9): the first Gluon W4A16 kernel,
one 128-channel chunk per wgmma wait, measured against the shipped Triton kernel in one process
(docs/perf_log.md v17). The package's kernel (kernels/w4a16_gluon.py, v18) issues two chunks per
wait instead; this probe keeps the variant that ptxas serializes, and shares the package's
layouts and dequantization.

    PYTHONPATH=src python benchmarks/probes/gluon_w4a16_probe.py compile   # no GPU needed: PTX / ptxas
    PYTHONPATH=src python benchmarks/probes/gluon_w4a16_probe.py ab 16,64 128,-1 400   # GPU: M, group sizes, s

What it is: the same packed words in fragment order (formats.int4.PackedW4) and the same
unscaled asm dequantization (kernels/w4a16._ASM_F16_Q), but every layout explicit: the words
are copied into a cp.async ring with x and read back in a DistributedLinearLayout whose
join / reshape / permute is wgmma's register-A layout (one register-only convert_layout, no
shared-memory trip of the fp16 tile). Each 128-channel chunk's product is a fresh async wgmma;
the previous chunk's product is scaled into the accumulator after warpgroup_mma_wait(1), so no
tile waits for its own product (the g128 cost of the Triton kernel on Triton 3.6).

What it showed (H200, same process): g128 costs the same as per channel here (8192x57344 M = 16:
107 vs 101 us), i.e. the explicit wait removes the g128 penalty, but the kernel is slower than
the Triton one overall (g128 at M = 16: 0.88-1.13x the table before v17's re-tune, 0.85-1.00x
after it; per channel 0.72-1.05x):
ptxas serializes every wgmma (C7514: a non-wgmma instruction reads accumulator registers of a
wgmma in the pipeline stage, here the FADD / FFMA of the retired product). `compile` prints
ptxas' message. Correct per element (max relative error 3.5e-4 against the exact reference).
"""
import functools
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                             warpgroup_mma_init, warpgroup_mma_wait)

from sailfish.kernels.w4a16_gluon import _async_load, _barrier, _chunk_weights
from sailfish.kernels.w4a16_gluon import layouts as _package_layouts


def layouts(BLOCK_M, BLOCK_N):
    """The package kernel's layouts (kernels/w4a16_gluon.layouts), as a tuple."""
    d = _package_layouts(BLOCK_M, BLOCK_N)
    return tuple(d[k] for k in ("MMA", "WORDS", "DOT_A", "X_BLK", "X_SMEM", "W_BLK", "W_SMEM"))

@gluon.jit
def w4a16_gluon_kernel(x_ptr, qw_ptr, s_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
                       GROUPED: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, MMA: gl.constexpr, WORDS: gl.constexpr, DOT_A: gl.constexpr,
                       X_BLK: gl.constexpr, X_SMEM: gl.constexpr, W_BLK: gl.constexpr, W_SMEM: gl.constexpr):
    DT: gl.constexpr = x_ptr.dtype.element_ty
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    tiles_n = gl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    chunks = K // 128
    per = gl.cdiv(chunks, SPLIT_K)
    c0 = pid_k * per
    c1 = gl.minimum(c0 + per, chunks)

    # weight words, A-fragment order (row n, words 16c + 4t + a), copied 16 bytes per thread
    # into a STAGES-deep shared ring with x, then read in the WORDS layout (LDS.128)
    wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, W_BLK))
    wn = (wn % N).to(gl.int64)
    ww = gl.arange(0, 16, layout=gl.SliceLayout(0, W_BLK))
    w_ptrs = qw_ptr + wn[:, None] * stride_qn + (c0 * 16 + ww)[None, :]
    # scales, rows of the accumulator
    an = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    s_base = s_ptr + (an % N).to(gl.int64) * stride_sn
    # x tile pointers (BLOCK_M, 128)
    xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_BLK))
    xm = (xm % M).to(gl.int64)
    xk = gl.arange(0, 128, layout=gl.SliceLayout(0, X_BLK))
    x_ptrs = x_ptr + xm[:, None] * stride_xm + (c0 * 128 + xk)[None, :]

    x_buf = gl.allocate_shared_memory(DT, [STAGES, BLOCK_M, 128], X_SMEM)
    w_buf = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16], W_SMEM)
    for s in gl.static_range(STAGES - 1):
        ok = c0 + s < c1
        _async_load(w_buf.index(s), w_ptrs + s * 16, mask=ok, eviction_policy="evict_first")
        _async_load(x_buf.index(s), x_ptrs + s * 128, mask=ok)
        async_copy.commit_group()

    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
    zero = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=MMA)
    p_prev = warpgroup_mma_init(zero)
    s_prev = gl.zeros((BLOCK_N,), gl.float32, layout=gl.SliceLayout(1, MMA))
    w_prev = gl.zeros((BLOCK_N, 128), DT, layout=DOT_A)
    s_nxt = gl.load(s_base + c0 * GROUPED).to(gl.float32)
    for c in range(c0, c1):
        i = c - c0
        s_cur = s_nxt
        s_nxt = gl.load(s_base + gl.minimum(c + 1, c1 - 1) * GROUPED).to(gl.float32)
        async_copy.wait_group(STAGES - 2)
        _barrier()
        words = w_buf.index(i % STAGES).load(WORDS)
        w = _chunk_weights(words, DT, BLOCK_N, DOT_A)
        fence_async_shared()
        xs = x_buf.index(i % STAGES).permute((1, 0))
        p = warpgroup_mma(w, xs, zero, use_acc=False, is_async=True)
        done, w_prev = warpgroup_mma_wait(num_outstanding=1, deps=(p_prev, w_prev))
        if GROUPED:
            acc += done * s_prev[:, None]
        else:
            acc += done
        p_prev = p
        s_prev = s_cur
        w_prev = w
        # refill the slots chunk i - 1 used (its wgmma has retired; every thread is past its LDS)
        nxt = i + STAGES - 1
        ok = c0 + nxt < c1
        _async_load(w_buf.index(nxt % STAGES), w_ptrs + nxt * 16, mask=ok, eviction_policy="evict_first")
        _async_load(x_buf.index(nxt % STAGES), x_ptrs + nxt * 128, mask=ok)
        async_copy.commit_group()
    done, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(p_prev, w_prev))
    if GROUPED:
        acc += done * s_prev[:, None]
    else:
        acc = (acc + done) * s_prev[:, None]
    async_copy.wait_group(0)

    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    mask = (om < M)[None, :] & (an < N)[:, None]
    om = om.to(gl.int64)
    on = an.to(gl.int64)
    if SPLIT_K == 1:
        gl.store(y_ptr + om[None, :] * stride_ym + on[:, None], acc.to(DT), mask=mask)
    else:
        gl.store(ws_ptr + (pid_k * M + om[None, :]) * N + on[:, None], acc, mask=mask)


def _cdiv(a, b):
    return -(-a // b)


def compile_sm90(BLOCK_M=16, BLOCK_N=64, STAGES=3, GROUPED=True, SPLIT_K=1, dtype="fp16"):
    """triton.compile for sm_90a without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    mma, words, dot_a, x_blk, x_smem, w_blk, w_smem = layouts(BLOCK_M, BLOCK_N)
    ty = "*fp16" if dtype == "fp16" else "*bf16"
    sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "y_ptr": ty, "ws_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32", "stride_sn": "i32"}
    consts = dict(GROUPED=GROUPED, SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, MMA=mma,
                  WORDS=words, DOT_A=dot_a, X_BLK=x_blk, X_SMEM=x_smem, W_BLK=w_blk, W_SMEM=w_smem)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "y_ptr", "ws_ptr", "N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=w4a16_gluon_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def ptxas_report(kernel) -> str:
    """ptxas -v of the kernel's PTX (registers; the wgmma serialization message, if any)."""
    from triton.backends.nvidia.compiler import get_ptxas

    p = get_ptxas(90)
    path = p.path if hasattr(p, "path") else p[0]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        out = subprocess.run([path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    return out.stdout + out.stderr


def main_compile():
    from sailfish.tools.ptx import k_loop_stats, sass, wgmma_register_hazard

    print("triton", triton.__version__)
    for grouped in (True, False):
        k = compile_sm90(16, 64, 3, grouped)
        rep = ptxas_report(k)
        ser = re.findall(r"serialized due to ([^\n]*?) in the function", rep)
        print("g128" if grouped else "per channel", k_loop_stats(k.asm["ptx"]),
              "convert_layout", k.asm["ttgir"].count("convert_layout"),
              "waits", re.findall(r"wgmma.wait_group.sync.aligned (\d+)", k.asm["ptx"]),
              "hazard", wgmma_register_hazard(sass(k.asm["cubin"])),
              "registers", re.findall(r"Used (\d+) registers", rep),
              ("wgmma serialized: " + ser[0]) if ser else "wgmma pipelined")


_LAYOUTS = {}


def gluon_call(x, layer, y, gs, BM, BN, ST, SK):
    """y = x @ W^T with the probe kernel (split-K: the package's fixed-order reduce)."""
    import torch

    from sailfish.kernels.w4a16 import _splitk_reduce_kernel

    M, K = x.shape
    N = layer.qweight.shape[0]
    if (BM, BN) not in _LAYOUTS:
        _LAYOUTS[(BM, BN)] = layouts(BM, BN)
    mma, words, dot_a, x_blk, x_smem, w_blk, w_smem = _LAYOUTS[(BM, BN)]
    ws = y if SK == 1 else torch.empty((SK, M, N), device=x.device, dtype=torch.float32)
    w4a16_gluon_kernel[(_cdiv(M, BM) * _cdiv(N, BN), SK)](
        x, layer.qweight, layer.scales, y, ws, M, N, K, x.stride(0), y.stride(0), layer.qweight.stride(0),
        layer.scales.stride(0), GROUPED=gs != -1, SPLIT_K=SK, BLOCK_M=BM, BLOCK_N=BN, STAGES=ST, MMA=mma,
        WORDS=words, DOT_A=dot_a, X_BLK=x_blk, X_SMEM=x_smem, W_BLK=w_blk, W_SMEM=w_smem, num_warps=4)
    if SK > 1:
        _splitk_reduce_kernel[(_cdiv(M * N, 1024), 1)](ws, None, y, M, N, y.stride(0), SPLIT_K=SK, HAS_BIAS=False,
                                                       EMU_BF16=False, BLOCK=1024, num_warps=4)
    return y


def main_ab(ms, group_sizes, seconds):
    """Same process: the shipped table tile (public QuantLinear) vs the probe's best tile."""
    import copy

    import torch

    from sailfish.bench.timing import copies_needed, graph_time_us
    from sailfish.nn import QuantLinear

    name = torch.cuda.get_device_name()
    print(name, "triton", triton.__version__, flush=True)
    t_end = time.time() + seconds
    for gs in group_sizes:
        for K, N in [(8192, 57344), (28672, 8192), (8192, 10240), (8192, 8192), (4096, 28672), (14336, 4096)]:
            torch.manual_seed(0)
            lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device="cuda")
            base = QuantLinear.from_linear(lin, group_size=gs, sym=True)
            del lin
            nbytes = sum(b.numel() * b.element_size() for b in base.buffers())
            layers = [base] + [copy.deepcopy(base) for _ in range(copies_needed(nbytes) - 1)]
            w_x = base.quantized_weight().dequantize(rounded=False).float()
            for M in ms:
                if time.time() > t_end:
                    print("time budget reached", flush=True)
                    return
                x = torch.randn(M, K, dtype=torch.float16, device="cuda")
                ref = x.float() @ w_x.T
                base(x)
                t_tab = graph_time_us([functools.partial(lay, x) for lay in layers])
                BM = max(16, min(64, _cdiv(M, 16) * 16))
                res = []
                for BN in (64, 128):
                    for SK in (1, 2, 4, 8):
                        if _cdiv(N, BN) * _cdiv(M, BM) * SK > 8 * 132:
                            continue
                        for ST in (3, 4, 6):
                            y = torch.empty(M, N, dtype=torch.float16, device="cuda")
                            gluon_call(x, base, y, gs, BM, BN, ST, SK)
                            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                            ys = [torch.empty_like(y) for _ in layers]
                            t = graph_time_us([functools.partial(gluon_call, x, lay, yy, gs, BM, BN, ST, SK)
                                               for lay, yy in zip(layers, ys)])
                            res.append((t, BN, ST, SK, err))
                t, BN, ST, SK, _ = min(res)
                print(f"g{gs} {K}x{N} M={M}: table {t_tab:7.1f} us | gluon {t:7.1f} us (BM {BM} BN {BN} ring {ST} "
                      f"split {SK}) | table / gluon {t_tab / t:.2f} | worst rel. err {max(r[4] for r in res):.1e}",
                      flush=True)
            del layers, base
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1:2] == ["compile"]:
        main_compile()
    elif sys.argv[1:2] == ["ab"]:
        main_ab([int(v) for v in sys.argv[2].split(",")], [int(v) for v in sys.argv[3].split(",")],
                float(sys.argv[4]))
    else:
        sys.exit(__doc__)
