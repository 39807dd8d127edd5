"""Decode attention: one query token per sequence against a KV cache, grouped-query heads read
together, the cache split across programs and the splits combined in the kernel (launcher,
reference and op: ops/attention.py).

Why: at decode, transformers' sdpa path over a static cache expands K and V to every query
head (repeat_kv: a copy of the whole cache, 4x its bytes for Llama-3's 32 / 8 heads) and then
runs a kernel built for many queries per head on one. The limit is reading K and V once
(Llama-3-8B, batch 16, 1024 cached tokens: 67 MB a layer, ~20 us on an H100).

Design (why):
- One program per (sequence, KV head, split): the G = Hq / Hkv query heads that share the KV
  head are the rows of one tl.dot (padded to BLOCK_G >= 16, the MMA's smallest M), so every K
  and V tile is read once for all of them.
- Flash-decoding: the cache is cut into SPLITS chunks (enough programs to fill the GPU at batch 1,
  ops/attention.py _splits); each program keeps the running max, sum and weighted V of its chunk
  (online softmax in base 2, the scale folded into log2(e) * scale). With SPLITS > 1 each writes
  its partial to a workspace and the last of the (sequence, KV head)'s programs to finish
  (kernels/common.last_slice) combines them: one launch, no atomics on the values, a fixed
  order of the sums, so the same bits run to run. The combine loads every split's max and sum
  at once and the partial outputs in a few wide loads (not one L2 round trip per split, which
  made batch 1 slower than batch 4 in the first H100 run, docs/perf_log.md v44).
- The mask is transformers' (B or 1, 1 or Hq, 1, L): boolean (True: attend) or additive float,
  read through its strides (0 where broadcast). A row with every position masked gives 0.
- Probabilities are rounded to the cache's dtype before the P @ V product (as flash attention
  does); everything else is fp32. bf16 under the interpreter (numpy has no bf16): the products
  in fp32 from exactly widened operands, the probabilities rounded with integer ops (EMU_BF16).
"""
import triton
import triton.language as tl

from .common import cast_out, last_slice, pdl_release, round_bf16_emu
from .w4a8 import to_f32

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _scores(q, k, EMU_BF16: tl.constexpr):
    """q (BLOCK_G, D) @ k (BLOCK_N, D)^T in fp32."""
    if EMU_BF16:
        s = tl.dot(to_f32(q), tl.trans(to_f32(k)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _weighted(p, v, EMU_BF16: tl.constexpr):
    """p (BLOCK_G, BLOCK_N) fp32, rounded to v's dtype, @ v (BLOCK_N, D) in fp32."""
    if EMU_BF16:
        out = tl.dot(round_bf16_emu(p), to_f32(v), input_precision="ieee")
    else:
        out = tl.dot(p.to(v.dtype), v)
    return out


@triton.jit
def decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, ws_ptr, ml_ptr, cnt_ptr,
        HKV, L, CHUNK, scale,
        sqb, sqh, skb, skh, skl, svb, svh, svl, smb, smh, sml, sob, soh,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, MASK: tl.constexpr, EMU_BF16: tl.constexpr,
        SPLITS_P2: tl.constexpr = 1, G_P2: tl.constexpr = 1, CS: tl.constexpr = 1, PDL_EARLY: tl.constexpr = False):
    """q (B, Hq, 1, D), k / v (B, Hkv, L, D) with a unit-stride last dim; out (B, 1, Hq, D);
    MASK 0: none, 1: boolean (stored as int8 / bool), 2: additive (the query dtype or fp32).
    ws: fp32 (SPLITS, B * Hq, D) partial outputs, ml: fp32 (SPLITS, B * Hq, 2) max and sum,
    cnt: int32, one counter per (sequence, KV head) (SPLITS > 1 only). PDL_EARLY: the next grid
    (a row kernel launched as a programmatic dependent, which waits itself) may launch at once."""
    pdl_release(PDL_EARLY)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    hk = pid % HKV
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    hq = hk * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + hq[:, None] * sqh + d[None, :], mask=g_ok[:, None], other=0.0)
    qk_scale = scale * LOG2E
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    m_base = mask_ptr + b.to(tl.int64) * smb + hq[:, None] * smh

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, L)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=3):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        k = tl.load(k_base + n[:, None].to(tl.int64) * skl + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(v_base + n[:, None].to(tl.int64) * svl + d[None, :], mask=n_ok[:, None], other=0.0)
        s = _scores(q, k, EMU_BF16) * qk_scale
        ok = n_ok[None, :] & g_ok[:, None]
        if MASK == 1:
            ok = ok & (tl.load(m_base + n[None, :] * sml, mask=ok, other=0) != 0)
        if MASK == 2:
            s += to_f32(tl.load(m_base + n[None, :] * sml, mask=ok, other=0.0)) * LOG2E
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row masked so far: no NaN)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _weighted(p, v, EMU_BF16)
        m_i = m_new

    row = b * (HKV * G) + hq  # (sequence, query head) index into the workspace
    o_ptrs = out_ptr + b.to(tl.int64) * sob + hq[:, None] * soh + d[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptrs, cast_out(out, out_ptr.dtype.element_ty, EMU_BF16), mask=g_ok[:, None])
    else:
        rows = (tl.num_programs(0) * G).to(tl.int64)  # B * Hq
        here = split * rows + row
        tl.store(ws_ptr + here[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(ml_ptr + here * 2, m_i, mask=g_ok)
        tl.store(ml_ptr + here * 2 + 1, l_i, mask=g_ok)
        if last_slice(cnt_ptr + pid, SPLITS):
            # Every split's max and sum in one load (SPLITS_P2 x G_P2), then the partial outputs
            # in chunks of CS splits, each chunk one load: the loads are few and wide, not one
            # round trip to L2 per split (at batch 1 the combine is most of the kernel's time).
            tl.debug_barrier()
            sp = tl.arange(0, SPLITS_P2)
            gr = tl.arange(0, G_P2)
            g_in = gr < G
            rows_here = b * (HKV * G) + hk * G + gr
            at = sp[:, None] * rows + rows_here[None, :]
            ok = (sp[:, None] < SPLITS) & g_in[None, :]
            m_s = tl.load(ml_ptr + at * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(ml_ptr + at * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            m_all = tl.max(m_s, 0)
            m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
            l_all = tl.sum(tl.exp2(m_s - m_use[None, :]) * l_s, 0)
            inv_l = 1.0 / tl.where(l_all == 0.0, 1.0, l_all)
            total = tl.zeros((G_P2, D), tl.float32)
            cs = tl.arange(0, CS)
            for c0 in tl.static_range(0, SPLITS_P2, CS):
                at_c = (c0 + cs)[:, None] * rows + rows_here[None, :]
                ok_c = ((c0 + cs)[:, None] < SPLITS) & g_in[None, :]
                m_c = tl.load(ml_ptr + at_c * 2, mask=ok_c, other=float("-inf"), cache_modifier=".cg")
                acc_c = tl.load(ws_ptr + at_c[:, :, None] * D + d[None, None, :], mask=ok_c[:, :, None], other=0.0,
                                cache_modifier=".cg")
                w_c = tl.exp2(m_c - m_use[None, :]) * inv_l[None, :]  # (CS, G_P2): each split's share
                total += tl.sum(w_c[:, :, None] * acc_c, 0)
            o_c = out_ptr + b.to(tl.int64) * sob + (hk * G + gr)[:, None] * soh + d[None, :]
            tl.store(o_c, cast_out(total, out_ptr.dtype.element_ty, EMU_BF16), mask=g_in[:, None])
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed")
