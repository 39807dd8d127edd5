"""Probe (not part of the package; GPU; run from the repo root as
`PYTHONPATH=src python benchmarks/probes/split8.py`): 8 dots per K tile, one per nibble position, on a layout
where nibble p of word r (inside a 64-channel chunk) holds channel 8*SIG[p] + r. The
dequant stays elementwise on the packed words, so Triton can load the words from shared
memory straight into the wgmma operand layout (no fp16 tile round trip)."""
import torch
import triton
import triton.language as tl

from sailfish.kernels.w4a16 import _ASM_F16, _pair

SIG = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p -> sub-row; pairs (i, i+4) are adjacent sub-rows


def repack(words, kp):
    from sailfish.formats.int4 import unpack_words  # QuantLinear.qweight is in fragment order (v9)
    n = words.shape[0]
    codes = unpack_words(words)[:, :kp].to(torch.int64).reshape(n, kp // 64, 8, 8)  # [n, c, s, r]
    out = torch.zeros(n, kp // 64, 8, dtype=torch.int64, device=words.device)
    for p in range(8):
        out |= codes[:, :, SIG[p], :] << (4 * p)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.reshape(n, kp // 8).contiguous()


@triton.jit
def _scales2(s_ptr, rn, k0, stride_sn, offs_r, BLOCK_N: tl.constexpr, R: tl.constexpr):
    if R <= 16:
        s = tl.load(s_ptr + rn * stride_sn + k0 // 128)
        return tl.broadcast_to(_pair(s)[:, None], (BLOCK_N, R))
    else:
        # column r belongs to group k0 // 128 + r // 16: a select chain keeps it elementwise
        s2 = tl.broadcast_to(_pair(tl.load(s_ptr + rn * stride_sn + k0 // 128))[:, None], (BLOCK_N, R))
        for g in tl.static_range(1, R // 16):
            sg = _pair(tl.load(s_ptr + rn * stride_sn + k0 // 128 + g))
            s2 = tl.where((offs_r >= 16 * g)[None, :], sg[:, None], s2)
        return s2


@triton.jit
def mma8(x_ptr, qw_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = offs_n % N
    rm = offs_m % M
    R: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, R)
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + offs_r[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (64 * (offs_r // 8) + offs_r % 8)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(K // BLOCK_K):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        s2 = _scales2(s_ptr, rn, k0, stride_sn, offs_r, BLOCK_N, R)
        z2 = tl.full((BLOCK_N, R), 0x64086408, tl.int32)
        n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            _ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s2, z2],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        acc = tl.dot(n0, tl.load(x_ptrs + 0, eviction_policy="evict_last"), acc)
        acc = tl.dot(n4, tl.load(x_ptrs + 8, eviction_policy="evict_last"), acc)
        acc = tl.dot(n1, tl.load(x_ptrs + 16, eviction_policy="evict_last"), acc)
        acc = tl.dot(n5, tl.load(x_ptrs + 24, eviction_policy="evict_last"), acc)
        acc = tl.dot(n2, tl.load(x_ptrs + 32, eviction_policy="evict_last"), acc)
        acc = tl.dot(n6, tl.load(x_ptrs + 40, eviction_policy="evict_last"), acc)
        acc = tl.dot(n3, tl.load(x_ptrs + 48, eviction_policy="evict_last"), acc)
        acc = tl.dot(n7, tl.load(x_ptrs + 56, eviction_policy="evict_last"), acc)
        w_ptrs += R
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(tl.float16), mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


@triton.jit
def gemv8(x_ptr, qw_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    R: tl.constexpr = BLOCK_K // 8
    offs_r = tl.arange(0, R)
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + offs_r[None, :]
    x_ptrs = x_ptr + 64 * (offs_r // 8) + offs_r % 8
    acc = tl.zeros((BLOCK_N, R), dtype=tl.float32)
    for kt in range(K // BLOCK_K):
        k0 = kt * BLOCK_K
        words = tl.load(w_ptrs, eviction_policy="evict_first")
        s2 = _scales2(s_ptr, rn, k0, stride_sn, offs_r, BLOCK_N, R)
        z2 = tl.full((BLOCK_N, R), 0x64086408, tl.int32)
        n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            _ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, s2, z2],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        acc += n0.to(tl.float32) * tl.load(x_ptrs + 0, eviction_policy="evict_last").to(tl.float32)[None, :]
        acc += n4.to(tl.float32) * tl.load(x_ptrs + 8, eviction_policy="evict_last").to(tl.float32)[None, :]
        acc += n1.to(tl.float32) * tl.load(x_ptrs + 16, eviction_policy="evict_last").to(tl.float32)[None, :]
        acc += n5.to(tl.float32) * tl.load(x_ptrs + 24, eviction_policy="evict_last").to(tl.float32)[None, :]
        acc += n2.to(tl.float32) * tl.load(x_ptrs + 32, eviction_policy="evict_last").to(tl.float32)[None, :]
        acc += n6.to(tl.float32) * tl.load(x_ptrs + 40, eviction_policy="evict_last").to(tl.float32)[None, :]
        acc += n3.to(tl.float32) * tl.load(x_ptrs + 48, eviction_policy="evict_last").to(tl.float32)[None, :]
        acc += n7.to(tl.float32) * tl.load(x_ptrs + 56, eviction_policy="evict_last").to(tl.float32)[None, :]
        w_ptrs += R
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, out.to(tl.float16), mask=offs_n < N)


def main():
    import functools

    import torch.nn.functional as F

    import sailfish
    from sailfish.bench.timing import copies_needed, graph_time_us, w4a16_min_bytes
    torch.manual_seed(0)
    shapes = [(8192, 57344), (8192, 8192), (4096, 14336)]
    rows = []
    for (K, N) in shapes:
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device="cuda")
        L = sailfish.QuantLinear.from_linear(lin)
        w_eff = L.dequantize()
        q8 = repack(L.qweight, K)
        R = copies_needed(N * K // 2)
        Ls = [L] + [sailfish.QuantLinear.from_linear(lin) for _ in range(R - 1)]
        qs = [q8] + [q8.clone() for _ in range(R - 1)]
        Wc = [lin.weight.detach()] + [lin.weight.detach().clone() for _ in range(copies_needed(N * K * 2) - 1)]
        for M in (1, 16, 64):
            x = torch.randn(M, K, dtype=torch.float16, device="cuda")
            y = torch.empty(M, N, dtype=torch.float16, device="cuda")
            ref = x.float() @ w_eff.T
            ideal = w4a16_min_bytes(M, K, N, 128) / 4.25e12 * 1e6
            t_cb = graph_time_us([functools.partial(F.linear, x, w) for w in Wc])
            for l in Ls[:1]:
                l(x)
            t_sf = graph_time_us([functools.partial(l, x) for l in Ls])
            print(f"K={K} N={N} M={M}: cuBLAS {t_cb:7.1f} us  sailfish {t_sf:7.1f} us ({t_cb/t_sf:.2f}x, roof {ideal/t_sf:.2f})", flush=True)
            best = None
            cands = []
            if M == 1:
                cands += [("gemv8", BN, BK, w, st) for BN, BK, w, st in [(16, 512, 4, 4)]]
            bms = [16] if M <= 16 else [16, 32, 64]
            cands += [("mma8", (bm, BN), 128, w, st) for bm in bms for BN, w, st in
                      [(128, 4, 4), (16, 1, 4), (16, 1, 6), (32, 1, 4), (32, 1, 6), (64, 1, 4), (32, 2, 4), (32, 2, 6),
                       (64, 2, 4), (32, 4, 4), (64, 4, 4), (64, 4, 6)]
                      if not (bm == 64 and BN < 32)]
            for name, BN, BK, w, st in cands:
                if name == "gemv8":
                    bm, bn = 1, BN
                    def call(q, bn=bn, BK=BK, w=w, st=st):
                        gemv8[(triton.cdiv(N, bn),)](x, q, L.scales, y, M, N, K, x.stride(0), y.stride(0), q.stride(0),
                                                     L.scales.stride(0), BLOCK_M=1, BLOCK_N=bn, BLOCK_K=BK, num_warps=w, num_stages=st)
                else:
                    bm, bn = BN
                    def call(q, bm=bm, bn=bn, BK=BK, w=w, st=st):
                        mma8[(triton.cdiv(N, bn), triton.cdiv(M, bm))](x, q, L.scales, y, M, N, K, x.stride(0), y.stride(0), q.stride(0),
                                                     L.scales.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BK, num_warps=w, num_stages=st)
                try:
                    y.zero_(); call(qs[0]); torch.cuda.synchronize()
                    err = float((y.float() - ref).norm() / ref.norm())
                    t = graph_time_us([functools.partial(call, q) for q in qs])
                except Exception as e:
                    print(f"   {name} bm={bm} bn={bn} bk={BK} w={w} s={st}: FAILED {type(e).__name__} {str(e)[:200]}", flush=True)
                    continue
                print(f"   {name} bm={bm} bn={bn} bk={BK} w={w} s={st}: {t:7.1f} us  {t_cb/t:.2f}x  roof {ideal/t:.2f}  err {err:.1e}", flush=True)
                if best is None or t < best[0]:
                    best = (t, name, bm, bn, BK, w, st, err)
            rows.append((K, N, M, t_cb, t_sf, best))
    print("\nK x N | M | cuBLAS us | sailfish now | best probe")
    for K, N, M, t_cb, t_sf, b in rows:
        print(f"{K}x{N} | {M} | {t_cb:.1f} | {t_sf:.1f} ({t_cb/t_sf:.2f}x) | {b[0]:.1f} ({t_cb/b[0]:.2f}x) {b[1:]}")


if __name__ == "__main__":
    main()
