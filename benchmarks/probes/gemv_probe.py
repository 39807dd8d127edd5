"""Probe (not part of the package; GPU; run from the repo root as
`PYTHONPATH=src python benchmarks/probes/gemv_probe.py`): M = 1 GEMV variants on the natural-order
PackedW4 layout (layout version 1, the layout before perf log v9; `natural_words` converts a
QuantLinear's fragment-order qweight back to it).
A: the shipped path (op, tuned config). B: fp32 magic-number dequant, no join, 8 strided
x gathers. C: asm f16 dequant, no join, f16->f32 cvt. D: fp32 magic, scale applied once
per (row, K tile) (BK <= group size)."""
import functools

import torch
import triton
import triton.language as tl

from sailfish.formats.int4 import _words_from_nibbles, unpack_words
from sailfish.kernels.w4a16 import _ASM_F16, _pair


def natural_words(qweight):
    """Fragment-order words (layout 2) -> natural order (layout 1): channel 8i + j in nibble j."""
    return _words_from_nibbles(unpack_words(qweight).reshape(qweight.shape[0], -1, 8))


@triton.jit
def gemv_probe(x_ptr, qw_ptr, s_ptr, y_ptr, N, K, stride_qn, stride_sn,
               MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    R: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, R)
    kt_per = K // BLOCK_K // SPLIT_K
    kt0 = pid_k * kt_per
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + kt0 * R + offs_r[None, :]
    x_ptrs = x_ptr + kt0 * BLOCK_K + offs_r * 8
    acc = tl.zeros((BLOCK_N, R), dtype=tl.float32)
    for kt in range(kt0, kt0 + kt_per):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        if MODE == 2:  # C
            s = tl.load(s_ptr + rn * stride_sn + k0 // 128)
            s2 = tl.broadcast_to(_pair(s)[:, None], (BLOCK_N, R))
            z2 = tl.full((BLOCK_N, R), 0x64086408, tl.int32)
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                _ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s2, z2],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
            acc += n0.to(tl.float32) * tl.load(x_ptrs + 0).to(tl.float32)[None, :]
            acc += n1.to(tl.float32) * tl.load(x_ptrs + 1).to(tl.float32)[None, :]
            acc += n2.to(tl.float32) * tl.load(x_ptrs + 2).to(tl.float32)[None, :]
            acc += n3.to(tl.float32) * tl.load(x_ptrs + 3).to(tl.float32)[None, :]
            acc += n4.to(tl.float32) * tl.load(x_ptrs + 4).to(tl.float32)[None, :]
            acc += n5.to(tl.float32) * tl.load(x_ptrs + 5).to(tl.float32)[None, :]
            acc += n6.to(tl.float32) * tl.load(x_ptrs + 6).to(tl.float32)[None, :]
            acc += n7.to(tl.float32) * tl.load(x_ptrs + 7).to(tl.float32)[None, :]
        else:
            s = tl.load(s_ptr + rn * stride_sn + k0 // 128).to(tl.float32)[:, None]
            tmp = tl.zeros((BLOCK_N, R), dtype=tl.float32)
            for p in tl.static_range(8):
                qf = (((words >> (4 * p)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                xv = tl.load(x_ptrs + p).to(tl.float32)[None, :]
                if MODE == 1:  # B
                    acc += (qf * s) * xv
                else:  # D
                    tmp += qf * xv
            if MODE == 3:
                acc += tmp * s
        w_ptrs += R
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, out.to(tl.float16), mask=offs_n < N)
    else:
        tl.atomic_add(y_ptr + offs_n, out, mask=offs_n < N)


def main():
    import sailfish
    from sailfish.bench.timing import copies_needed, graph_time_us, w4a16_min_bytes
    torch.manual_seed(0)
    summary = []
    for (K, N) in [(8192, 57344), (8192, 8192), (4096, 14336), (14336, 4096)]:
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device="cuda")
        L = sailfish.QuantLinear.from_linear(lin)
        ref = None
        R = copies_needed(N * K // 2)
        Ls = [L] + [sailfish.QuantLinear.from_linear(lin) for _ in range(R - 1)]
        Wc = [lin.weight.detach()] + [lin.weight.detach().clone() for _ in range(copies_needed(N * K * 2) - 1)]
        x = torch.randn(1, K, dtype=torch.float16, device="cuda")
        ref = x.float() @ L.dequantize().T
        ideal = w4a16_min_bytes(1, K, N, 128) / 4.25e12 * 1e6
        t_cb = graph_time_us([functools.partial(torch.nn.functional.linear, x, w) for w in Wc])
        L(x)
        t_sf = graph_time_us([functools.partial(l, x) for l in Ls])
        print(f"K={K} N={N}: cuBLAS {t_cb:.1f} us, sailfish {t_sf:.1f} us ({t_cb / t_sf:.2f}x, roof {ideal / t_sf:.2f})", flush=True)
        best = {}
        for mode, name in ((1, "B fp32-magic"), (2, "C f16-nojoin"), (3, "D fp32-magic scale/tile")):
            for bn, bk, w, st in [(16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 4, 4), (32, 512, 4, 4), (64, 256, 4, 4),
                                  (32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 4), (64, 128, 8, 4), (128, 128, 8, 4)]:
                if mode == 3 and bk > 128:
                    continue
                ntiles = triton.cdiv(N, bn)
                split = 1
                while ntiles * split < 264 and K // bk // (split * 2) >= 2:
                    split *= 2
                y = torch.zeros(N, dtype=torch.float32 if split > 1 else torch.float16, device="cuda")

                def call(L=L, bn=bn, bk=bk, w=w, st=st, split=split, y=y, mode=mode, qn=natural_words(L.qweight)):
                    if split > 1:
                        y.zero_()
                    gemv_probe[(ntiles, split)](x, qn, L.scales, y, N, K, qn.stride(0), L.scales.stride(0),
                                                MODE=mode, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=w, num_stages=st)
                try:
                    call()
                    torch.cuda.synchronize()
                    err = float((y.float() - ref[0]).norm() / ref.norm())
                    t = graph_time_us([functools.partial(call, L=l) for l in Ls])
                except Exception as e:
                    print(f"  {name} bn={bn} bk={bk} w={w}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                print(f"  {name:24s} bn={bn:3d} bk={bk:3d} w={w} split={split}: {t:7.1f} us {t_cb / t:5.2f}x roof {ideal / t:.2f} err {err:.1e}", flush=True)
                if name not in best or t < best[name][0]:
                    best[name] = (t, bn, bk, w, split)
        summary.append((K, N, t_cb, t_sf, best))
    print("\nM=1 summary (us; speedup vs cuBLAS fp16)")
    for K, N, t_cb, t_sf, best in summary:
        line = f"{K}x{N}: cuBLAS {t_cb:.1f} | shipped {t_sf:.1f} ({t_cb / t_sf:.2f}x)"
        for name, b in best.items():
            line += f" | {name.split()[0]} {b[0]:.1f} ({t_cb / b[0]:.2f}x) {b[1:]}"
        print(line)


if __name__ == "__main__":
    main()
