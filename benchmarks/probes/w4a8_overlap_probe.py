"""Probe (not part of the package; Hopper GPU for `ab`, none for `compile`; Triton 3.6 and 3.9): a
one-warpgroup W4A8 kernel for decode sizes (M <= 32), the int8 form of kernels/w4a16_gluon's
w4a16_gluon_overlap_kernel, against the shipped W4A8 path and W4A16 at the Llama-3-8B projections.

Why (issue 39's bar "W4A8 at least as fast as W4A16 compiled at batch 16"; docs/perf_log.md v47 /
v49): at M = 16 the W4A8 GEMMs take 4.2 us a layer more than W4A16's (H100: o 10.0 vs 8.0 us,
down 20.5 vs 17.4), and W4A16 runs o and down on its one-warpgroup overlap kernel, which W4A8 has
no twin of (its Gluon kernel is the warp-specialized pipe for M >= 65, which v47 measured slower at
M = 16: 128 rows a program and a producer warp are too much machinery for 16 tokens).

The kernel: a program owns 64 weight rows (one warpgroup) and BLOCK_M tokens; x_q's two 128-channel
chunks of a K step come through a cp.async ring of STAGES steps; the packed words (PackedQQQ) go
from global memory straight into registers two steps ahead, as do the group scales; each step's
two chunks are unpacked to int8 (kernels/w4a8_gluon._chunk_int8: QQQ's round(s_g * (q - 8)), the
A operand's registers by renaming) while the previous step's two int8 wgmmas run (wait(2): two
steps in flight, the loop unrolled twice so that their A operands are different registers). int32
accumulation is exact, so the output must equal the shipped kernel's bit for bit (same epilogue,
(acc * s_ch) * s_tok (+ bias); split-K: int32 partial sums and the package's reduce kernel).

    PYTHONPATH=src python benchmarks/probes/w4a8_overlap_probe.py compile        # no GPU: ptxas, SASS checks
    PYTHONPATH=src python benchmarks/probes/w4a8_overlap_probe.py ab [--m 16] [--rounds 5]   # GPU

`ab` checks every tile's output against the shipped path first (never times a wrong kernel), then
times, per projection, the shipped W4A8 call (activation quantization excluded: x_q given), every
tile of this kernel and W4A16 g128 on the same fp16 weights, interleaved, each in CUDA graphs over
enough weight copies to overflow L2.
"""
import argparse
import functools
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                             warpgroup_mma_init, warpgroup_mma_wait)

from sailfish.kernels.gluon_common import CHUNK, CHUNK_C, STEP_C, WG_ROWS, program, rows
from sailfish.kernels.w4a16_gluon import _barrier, _load_step
from sailfish.kernels.w4a8_gluon import _chunk_int8, _group_pairs, _words
from sailfish.kernels.w4a8_gluon import layouts as _pipe_layouts

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N
TILES = [dict(BLOCK_M=16, STAGES=s, SPLIT_K=k) for s in (3, 4) for k in (1, 2, 4)]


def layouts(BLOCK_M: int) -> dict:
    """The pipe kernel's layouts of one warpgroup (MMA, WORDS, WJ, DOT_A, X_SMEM) and the x_q
    chunk's cp.async layout: 16 bytes per thread, 8 threads per 128-channel row."""
    d = dict(_pipe_layouts(BLOCK_M))
    d["X_BLK"] = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                  order=[1, 0])
    return d


@gluon.jit
def _step8(i, n, acc, q0, q1, g0, g1, s_rows, w_rows, x_buf, x_ptrs, GROUPED: gl.constexpr, CLAMP: gl.constexpr,
           STAGES: gl.constexpr, RETIRE: gl.constexpr, WORDS: gl.constexpr, WJ: gl.constexpr, DOT_A: gl.constexpr):
    """K step i: retire step i - 2's wgmmas (RETIRE), refill its ring slot, unpack step i (q0, q1
    its words, g0, g1 its group scales, loaded two steps earlier) while step i - 1's run, issue
    step i's two wgmmas. Returns the accumulator and step i + 2's words and scales. (The wait
    names the accumulator only: Triton rejects an 8-bit A operand among a wait's deps; the
    compile check looks for writes to an in-flight wgmma's A registers in the SASS.)"""
    if RETIRE:
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
    async_copy.wait_group(STAGES - 3)  # step i's group has landed
    _barrier()  # ... for every thread, and every warp is past step i - 2's wgmmas
    nxt = i + STAGES - 2  # into step i - 2's slot
    _load_step(None, x_buf, nxt % STAGES, None, x_ptrs, nxt, nxt < n, False)  # (x_q's chunks only)
    slot = i % STAGES
    v0 = _chunk_int8(q0, g0, GROUPED, CLAMP, WJ, DOT_A)
    v1 = _chunk_int8(q1, g1, GROUPED, CLAMP, WJ, DOT_A)
    ahead = gl.minimum(i + 2, n - 1)  # (past the end: the last step again, an L2 hit)
    q0, q1 = _words(w_rows, ahead)
    if GROUPED:
        g0, g1 = _group_pairs(s_rows, ahead, WORDS)
    fence_async_shared()
    acc = warpgroup_mma(v0, x_buf.index(2 * slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(v1, x_buf.index(2 * slot + 1).permute((1, 0)), acc, is_async=True)
    return acc, q0, q1, g0, g1


@gluon.jit
def w4a8_overlap_kernel(x_ptr, xs_ptr, qb_ptr, sch_ptr, sg_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                        stride_qn, stride_gn, GROUPED: gl.constexpr, CLAMP: gl.constexpr, HAS_BIAS: gl.constexpr,
                        SPLIT_K: gl.constexpr, RAW: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                        MMA: gl.constexpr, WORDS: gl.constexpr, WJ: gl.constexpr, DOT_A: gl.constexpr,
                        X_SMEM: gl.constexpr, X_BLK: gl.constexpr):
    """y (M, N) = W4A8 product of x_q (x_ptr int8 (M, K), rows stride_xm), s_tok (xs_ptr float32
    (M,)) and a PackedQQQ weight (qb_ptr int32 words (N, Kp / 8), stride_qn in words; sch_ptr
    float32 (N,); sg_ptr float16 (N, Kp / 128), GROUPED) (+ bias), in y's dtype; RAW: the int32
    accumulator; SPLIT_K > 1: y_ptr is the int32 workspace (SPLIT_K, M, N). Grid
    (cdiv(N, 64) * cdiv(M, BLOCK_M), SPLIT_K); K a multiple of 256, every split an even number of
    K steps >= 2, STAGES >= 3."""
    pid_n, pid_m, pid_k, first, n = program(M, K, SPLIT_K, BLOCK_M)
    w_rows = (rows(qb_ptr, pid_n, N, stride_qn, WG_ROWS, WORDS)[:, None]
              + (first * 32 + gl.arange(0, 16, layout=gl.SliceLayout(0, WORDS)))[None, :])
    xm = (pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_BLK))) % M
    xk = gl.arange(0, CHUNK_C, layout=gl.SliceLayout(0, X_BLK))
    x_ptrs = x_ptr + xm.to(gl.int64)[:, None] * stride_xm + (first * STEP_C + xk)[None, :]
    # the words and group scales of the even (a) and odd (b) steps, two steps ahead
    qa0, qa1 = _words(w_rows, 0)
    qb0, qb1 = _words(w_rows, 1)
    if GROUPED:
        s_rows = rows(sg_ptr, pid_n, N, stride_gn, WG_ROWS, WORDS) + 2 * first
        ga0, ga1 = _group_pairs(s_rows, 0, WORDS)
        gb0, gb1 = _group_pairs(s_rows, 1, WORDS)
    else:  # (unused; sg_ptr may be None)
        s_rows = w_rows
        ga0 = qa0
        ga1 = qa1
        gb0 = qb0
        gb1 = qb1
    x_buf = gl.allocate_shared_memory(gl.int8, [2 * STAGES, BLOCK_M, CHUNK_C], X_SMEM)
    for s in gl.static_range(STAGES - 2):
        _load_step(None, x_buf, s, None, x_ptrs, s, s < n, False)
    acc = warpgroup_mma_init(gl.zeros((WG_ROWS, BLOCK_M), gl.int32, layout=MMA))
    acc, qa0, qa1, ga0, ga1 = _step8(0, n, acc, qa0, qa1, ga0, ga1, s_rows, w_rows, x_buf, x_ptrs, GROUPED, CLAMP,
                                     STAGES, False, WORDS, WJ, DOT_A)
    acc, qb0, qb1, gb0, gb1 = _step8(1, n, acc, qb0, qb1, gb0, gb1, s_rows, w_rows, x_buf, x_ptrs, GROUPED, CLAMP,
                                     STAGES, False, WORDS, WJ, DOT_A)
    for j in range(1, n // 2):
        acc, qa0, qa1, ga0, ga1 = _step8(2 * j, n, acc, qa0, qa1, ga0, ga1, s_rows, w_rows, x_buf, x_ptrs, GROUPED,
                                         CLAMP, STAGES, True, WORDS, WJ, DOT_A)
        acc, qb0, qb1, gb0, gb1 = _step8(2 * j + 1, n, acc, qb0, qb1, gb0, gb1, s_rows, w_rows, x_buf, x_ptrs,
                                         GROUPED, CLAMP, STAGES, True, WORDS, WJ, DOT_A)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)
    an = pid_n * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, MMA))
    om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    mask = (om < M)[None, :] & (an < N)[:, None]
    on = an.to(gl.int64)
    if SPLIT_K > 1:  # int32 partial sums, slice pid_k of the (SPLIT_K, M, N) workspace
        gl.store(y_ptr + (pid_k * M + om.to(gl.int64)[None, :]) * N + on[:, None], acc, mask=mask)
    elif RAW:
        gl.store(y_ptr + om.to(gl.int64)[None, :] * stride_ym + on[:, None], acc, mask=mask)
    else:  # kernels/w4a8._epilogue, in its order
        s_ch = gl.load(sch_ptr + an % N)
        s_tok = gl.load(xs_ptr + om % M)
        y = (acc.to(gl.float32) * s_ch[:, None]) * s_tok[None, :]
        if HAS_BIAS:
            y = y + gl.load(bias_ptr + an % N).to(gl.float32)[:, None]
        gl.store(y_ptr + om.to(gl.int64)[None, :] * stride_ym + on[:, None], y.to(y_ptr.dtype.element_ty), mask=mask)


def compile_sm90(BLOCK_M: int = 16, STAGES: int = 3, SPLIT_K: int = 1, grouped: bool = True, clamp: bool = False,
                 raw: bool = False):
    """triton.compile of w4a8_overlap_kernel for sm_90a without a GPU (fp16 output, no bias)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    meta = layouts(BLOCK_M)
    sig = {"x_ptr": "*i8", "xs_ptr": "*fp32", "qb_ptr": "*i32", "sch_ptr": "*fp32",
           "sg_ptr": "*fp16" if grouped else "constexpr", "bias_ptr": "constexpr",
           "y_ptr": "*i32" if raw or SPLIT_K > 1 else "*fp16", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_ym": "i32", "stride_qn": "i32", "stride_gn": "i32"}
    consts = dict(GROUPED=grouped, CLAMP=clamp, HAS_BIAS=False, SPLIT_K=SPLIT_K, RAW=raw, BLOCK_M=BLOCK_M,
                  STAGES=STAGES, bias_ptr=None, **meta)
    if not grouped:
        consts["sg_ptr"] = None
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = ("x_ptr", "qb_ptr", "sch_ptr", "sg_ptr", "y_ptr", "N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if sig[a] != "constexpr"}
    src = GluonASTSource(fn=w4a8_overlap_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_check() -> None:
    """Every tile of TILES, g128 and per channel: int8 wgmma with A in registers, no shared-memory
    trip of the weights, waits 2 and 0, and ptxas' verdict (serialization, spills), the SASS's
    wgmma register hazards, registers per thread."""
    import re

    from sailfish.tools.ptx import k_loop_stats, ptxas_report, sass, wgmma_register_hazard

    for tile in TILES:
        for grouped in (True, False):
            k = compile_sm90(**tile, grouped=grouped)
            ptx = k.asm["ptx"]
            st = k_loop_stats(ptx)
            report = ptxas_report(ptx)
            waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)))
            problems = [ln.strip() for ln in report.splitlines() if "C75" in ln or " spill" in ln.lower()]
            regs = re.findall(r"Used (\d+) registers", report)
            print(f"{tile} grouped={grouped}: int8 wgmma {'.s32.s8.s8' in ptx}, waits {waits}, loop {st}, "
                  f"registers {regs}, shared {k.metadata.shared}, hazard {wgmma_register_hazard(sass(k.asm['cubin']))}, "
                  f"ptxas {problems or 'clean'}", flush=True)


def ab(m: int, rounds: int) -> None:
    import torch

    from sailfish.bench.timing import copies_needed, graph_time_us
    from sailfish.nn import QuantLinear, QuantLinearW4A8
    from sailfish.ops import w4a8 as ops8

    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "triton", triton.__version__, f"M = {m}", flush=True)
    for name, (K, N) in SHAPES.items():
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device=dev)
        l8 = QuantLinearW4A8.from_linear(lin, group_size=128)
        l16 = QuantLinear.from_linear(lin, group_size=128)
        x = torch.randn(m, K, dtype=torch.float16, device=dev)
        x_q, x_s = l8.quantize_input(x)
        want = l8.forward_quantized(x_q, x_s)
        clamp = not ops8.group_scales_in_range(l8.s_g)
        reps = copies_needed(N * K // 2, dev)
        w8 = [(l8.qweight.clone(), l8.s_ch.clone(), l8.s_g.clone()) for _ in range(reps)]
        l16s = [QuantLinear.from_linear(lin, group_size=128) for _ in range(min(reps, 8))]

        def ours(tile, w, out):
            qw, s_ch, s_g = w
            split = tile["SPLIT_K"]
            target = out if split == 1 else torch.empty((split, m, N), dtype=torch.int32, device=dev)
            grid = (triton.cdiv(N, 64) * triton.cdiv(m, tile["BLOCK_M"]), split)
            w4a8_overlap_kernel[grid](x_q, x_s, qw, s_ch, s_g, None, target, m, N, K, x_q.stride(0), out.stride(0),
                                      qw.stride(0), s_g.stride(0), GROUPED=True, CLAMP=clamp, HAS_BIAS=False,
                                      SPLIT_K=split, RAW=False, num_warps=4, **tile, **layouts(tile["BLOCK_M"]))
            if split > 1:
                ops8._reduce_launch(split, False, False, False, dev.index or 0)(
                    (triton.cdiv(m, 16), triton.cdiv(N, 128)), target, x_s, s_ch, None, out, m, N, out.stride(0))
            return out

        out = torch.empty_like(want)
        ok_tiles = []
        for tile in TILES:
            steps = K // CHUNK // 2
            if steps % tile["SPLIT_K"] or (steps // tile["SPLIT_K"]) % 2:
                continue
            got = ours(tile, w8[0], out).clone()
            same = torch.equal(got, want)
            print(f"  {name} {tile}: equal to the shipped W4A8 {same}"
                  + ("" if same else f" (max abs diff {(got.float() - want.float()).abs().max().item():.3g})"), flush=True)
            if same:
                ok_tiles.append(tile)
        calls = {"shipped w4a8": [functools.partial(ops8.w4a8_launch, x_q, x_s, qw, s_ch, s_g, None, K, 128,
                                                    torch.float16) for qw, s_ch, s_g in w8],
                 "w4a16": [functools.partial(layer, x) for layer in l16s]}
        for tile in ok_tiles:
            outs = [torch.empty_like(want) for _ in w8]
            calls[str(tile)] = [functools.partial(ours, tile, w, o) for w, o in zip(w8, outs)]
        for cs in calls.values():
            for c in cs:
                c()
        times = {k: [] for k in calls}
        for _ in range(rounds):
            for k, cs in calls.items():
                times[k].append(graph_time_us(cs))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        best = min((k for k in med if k.startswith("{")), key=med.get, default=None)
        print(f"{name} K={K} N={N} M={m}: shipped W4A8 {med['shipped w4a8']:.1f} us, W4A16 {med['w4a16']:.1f} us, "
              f"this kernel best {best} {med.get(best, float('nan')):.1f} us; all {{{', '.join(f'{k}: {v:.1f}' for k, v in med.items())}}}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("compile", "ab"))
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if a.what == "compile":
        compile_check()
    else:
        ab(a.m, a.rounds)


if __name__ == "__main__":
    sys.exit(main())
