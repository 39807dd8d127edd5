"""The M <= 8 tensor-core GEMV (kernels/w4a16._w4a16_gemv_mma_kernel, issue 9).

Every output element is checked against helpers.elementwise_bound (the kernel's products are
exact and its sums fp32, so the existing bound applies unchanged). On CPU the kernel runs its
pure-Triton twin in the interpreter; on a GPU the mma.sync asm, whose lane order the one-hot
test pins down (a wrong lane order gives wrong channels, not rounding noise).
"""
import re

import numpy as np
import pytest
import torch

from helpers import DTYPE_NAMES, assert_close_per_element, make_g_idx, random_quantized
from helpers import run_compile_child
from sailfish.runtime.flags import FLAGS
from sailfish import Config, QuantLinear
from sailfish.ops import w4a16 as ops16
from sailfish.ops.w4a16 import gemv_on_tensor_cores, w4a16_launch

F16, BF16 = torch.float16, torch.bfloat16


def make_layer(k, n, gs, sym, dtype, bias, device, gidx="none"):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return QuantLinear.from_quantized(qw, b)


def launch(layer, x, cfg, use_asm=True):
    p = layer.packed()
    return w4a16_launch(x, p.qweight, p.scales, p.zeros, p.perm, p.sorted_g_idx, layer.bias,
                        p.in_features, p.group_size, config=cfg, use_asm=use_asm)


def gemv(bm, bn, bk, split=1, warps=4, scale_acc=False, stages=1):
    return Config(bm, bn, bk, split, 8, warps, stages, kernel="gemv", scale_acc=scale_acc)


# BLOCK_N 16 runs one row pair per asm element, >= 32 two; K = 784 (Kp 1024) leaves a K tail
# (K % BLOCK_K != 0) and, with split-K 3 over 4 tiles, an uneven split; N not a multiple of
# BLOCK_N wraps rows; M = 2..8 fills B columns.
#   M    K     N    gs   sym    dtype bias  config
CASES = [
    (1, 784, 40, 128, True, F16, True, gemv(1, 16, 256)),
    (1, 784, 40, -1, False, BF16, False, gemv(1, 32, 128, 3)),
    (1, 1024, 72, 256, False, F16, False, gemv(1, 64, 512, 1, 2)),
    (1, 512, 40, 128, False, BF16, True, gemv(1, 16, 256, 2, 8)),
    (2, 784, 40, 128, False, BF16, True, gemv(2, 32, 256, 2)),
    (3, 512, 24, 128, True, F16, False, gemv(4, 16, 128)),
    (8, 400, 48, -1, True, BF16, True, gemv(8, 32, 128)),
    # scale_acc (each chunk's fp32 product scaled once per row)
    (1, 784, 40, 128, False, BF16, True, gemv(1, 32, 128, 3, scale_acc=True)),
    (1, 1024, 72, 256, True, F16, False, gemv(1, 16, 512, 1, 8, scale_acc=True)),
    (3, 784, 40, -1, False, F16, True, gemv(4, 32, 256, 2, scale_acc=True)),
    # the words one tile ahead in registers (2 stages) and through a cp.async ring (3, 4)
    (1, 1536, 40, 128, True, F16, False, gemv(1, 16, 256, 2, 8, stages=2)),
    (1, 1536, 72, 128, False, BF16, True, gemv(1, 32, 256, 1, 4, scale_acc=True, stages=3)),
    (5, 784, 40, -1, True, F16, True, gemv(8, 16, 128, 3, 4, stages=4)),
]


def case_id(m, k, n, gs, sym, dtype, bias, cfg):
    return (f"M{m}-K{k}-N{n}-g{gs}-{'sym' if sym else 'asym'}-{DTYPE_NAMES[dtype]}{'-bias' if bias else ''}"
            f"-BM{cfg.BLOCK_M}-BN{cfg.BLOCK_N}-BK{cfg.BLOCK_K}-SK{cfg.SPLIT_K}-w{cfg.num_warps}"
            f"{'-sa' if cfg.scale_acc else ''}{f'-st{cfg.num_stages}' if cfg.num_stages > 1 else ''}")


@pytest.mark.parametrize("m,k,n,gs,sym,dtype,bias,cfg", CASES, ids=[case_id(*c) for c in CASES])
def test_gemv_mma_per_element(m, k, n, gs, sym, dtype, bias, cfg, device):
    layer = make_layer(k, n, gs, sym, dtype, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    assert gemv_on_tensor_cores(cfg, x, 0 if gs == -1 else gs, False)
    y = launch(layer, x, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    # (scale_acc multiplies by the exact s * (q - z), not by its rounding to the dtype)
    assert_close_per_element(y, x, layer.quantized_weight().dequantize(rounded=not cfg.scale_acc), layer.bias)
    if cfg.SPLIT_K > 1:  # split-K stays deterministic
        assert torch.equal(y, launch(layer, x, cfg))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("cfg", [gemv(8, 16, 128), gemv(8, 32, 256, 1, 2), gemv(1, 32, 256),
                                 gemv(1, 32, 256, scale_acc=True)],
                         ids=["pairs1", "pairs2", "M1", "M1-scale_acc"])
def test_gemv_mma_one_hot_is_exact(cfg, dtype, device):
    """x rows = unit vectors: y[m, n] must be W_eff[n, k_m] bit for bit (one exact product;
    with scale_acc s * (q - z) in fp32, rounded once at the store: the same number).
    Covers every channel position of a 128-channel chunk (all nibbles, words and lanes) in
    both B modes (M = 1 broadcasts x to every column, M > 1 puts row m in column m), so a
    wrong lane order, nibble or x pair fails here on the GPU."""
    k, n = 256, 64
    layer = make_layer(k, n, 128, False, dtype, False, device)
    w = layer.dequantize().to(dtype)
    rows = cfg.BLOCK_M
    ks = torch.arange(k, device=device)
    if device == "cpu":  # the interpreter is slow: one channel of every (a, r0, h, t, e) class
        ks = torch.randperm(k, device=device)[:16] if rows == 1 else torch.arange(128, 128 + 16, device=device)
    for i in range(0, len(ks), rows):
        kk = ks[i:i + rows]
        x = torch.zeros(len(kk), k, device=device, dtype=dtype)
        x[torch.arange(len(kk)), kk] = 1
        assert torch.equal(launch(layer, x, cfg), w[:, kk].T), f"channels {kk.tolist()}"


@pytest.mark.parametrize("gs,gidx,offset,why", [(32, "none", 0, "group 32"), (64, "none", 0, "group 64"),
                                                 (128, "gidx", 0, "general g_idx"), (128, "none", 1, "x at 2 mod 4")])
def test_gemv_falls_back_to_cuda_cores(gs, gidx, offset, why, device):
    """Where the tensor-core GEMV does not apply the CUDA-core GEMV runs, still correct
    (offset 1: x starts at an odd fp16 element, so its channel pairs are not 4-byte words)."""
    k = 512
    layer = make_layer(k, 40, gs, False, F16, True, device, gidx)
    x = torch.randn(k + offset, device=device).to(F16)[offset:].view(1, k)
    p = layer.packed()
    cfg = gemv(1, 16, 256)
    assert not gemv_on_tensor_cores(cfg, x, gs, p.sorted_g_idx is not None), why
    assert_close_per_element(launch(layer, x, cfg), x, layer.dequantize(), layer.bias)


def test_gemv_mma_switch(monkeypatch, device):
    """SAILFISH_GEMV_MMA=0 (runtime.flags.FLAGS.gemv_mma) keeps the CUDA-core GEMV and the heuristic's
    earlier choices (CUDA-core GEMV at M = 1, the mma kernel at M = 2..8)."""
    x = torch.randn(1, 256, device=device).to(F16)
    cpu = torch.device("cpu")
    problem = dict(device=cpu, N=4096, Kp=4096, group_size=128, general_gidx=False)
    assert gemv_on_tensor_cores(gemv(1, 16, 256), x, 128, False)
    assert ops16.w4a16_heuristic(M=2, **problem).kernel == "gemv"
    monkeypatch.setattr(FLAGS, "gemv_mma", False)
    assert not gemv_on_tensor_cores(gemv(1, 16, 256), x, 128, False)
    cfg = ops16.w4a16_heuristic(M=1, **problem)
    assert (cfg.kernel, cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_stages) == ("gemv", 16, 512, 4)
    assert ops16.w4a16_heuristic(M=2, **problem).kernel == "mma"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the mma.sync asm runs on CUDA only")
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
@pytest.mark.parametrize("cfg", [gemv(1, 16, 1024, 1, 8), gemv(2, 64, 512, 4), gemv(1, 32, 512, 2, scale_acc=True),
                                 gemv(1, 16, 1024, 1, 8, stages=3)],
                         ids=["BN16", "M2-BN64-split", "BN32-split-scale_acc", "BN16-ring3"])
def test_gemv_mma_asm_and_twin_at_k28672(cfg, dtype):
    """The asm and the pure-Triton twin (use_asm=False) on the GPU, at the largest Llama K:
    both within the per-element bound (their fp32 sums differ in order, so not bit-equal)."""
    k, n = 28672, 256
    layer = make_layer(k, n, 128, dtype == BF16, dtype, True, "cuda")
    x = torch.randn(min(cfg.BLOCK_M, 3), k, device="cuda").to(dtype)
    w = layer.quantized_weight().dequantize(rounded=not cfg.scale_acc)
    for use_asm in (True, False):
        assert_close_per_element(launch(layer, x, cfg, use_asm), x, w, layer.bias)


_PTX_CHILD = r"""
import sys
from sailfish.tools.ptx import gemv_loop, shipped_mma_configs
cfgs = [(c.BLOCK_M, c.BLOCK_N, c.BLOCK_K, c.SPLIT_K, c.num_warps, c.num_stages)
        for _, c in shipped_mma_configs("gemv")]
cfgs += [(1, 64, 512, 1, 4, 1), (1, 128, 256, 1, 4, 2), (4, 32, 256, 2, 4, 2)]
rings = [(1, 16, 1024, 1, 8, 3), (1, 32, 512, 1, 4, 3), (2, 64, 512, 4, 4, 4)]  # cp.async rings
bad = []
for c in cfgs + rings:
    for kw in (dict(), dict(dtype="bf16", has_zeros=True), dict(group_size=-1), dict(scale_acc=True),
               dict(dtype="bf16", has_zeros=True, scale_acc=True)):
        loop = gemv_loop(*c, **kw)
        limit = 2.5 if c[1] >= 32 else 2.75  # fp16 / bf16 asym alike; see the test's docstring
        if kw.get("scale_acc"):  # 4 instructions per word fewer
            limit -= 0.5
        if c[5] >= 3:  # the ring's barriers, wait and shared loads per K tile
            limit += 0.35
        if not loop.lane_order or loop.per_weight > (limit + (0.5 if kw.get("dtype") == "bf16" else 0)):
            bad.append((c, kw, loop.per_weight, loop.lane_order))
# a ring streams the words with cp.async and reads them back from shared memory; 2 stages load
# them into registers
import re
from sailfish.tools.ptx import compile_gemv, ptxas_report
for c in rings + [(1, 32, 512, 1, 4, 2)]:
    ptx = compile_gemv(*c).asm["ptx"]
    ring = "cp.async.cg.shared.global" in ptx and "ld.global.L1::evict_first" not in ptx
    if ring != (c[5] >= 3) or re.search(r"\b[1-9][0-9]* bytes spill", ptxas_report(ptx)):
        bad.append((c, "ring" if c[5] >= 3 else "registers", ring))
print("checked", len(cfgs) + len(rings))
sys.exit(f"GEMV configs off target: {bad}" if bad else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_gemv_mma_compiles_to_the_lane_order_it_needs(tmp_path):
    """Compiled for sm_90a (tools/ptx.py): for every shipped 'gemv' config and a few more, the
    mma asm runs in the lane order it assumes (else its results are wrong on the GPU), and
    the K loop's SASS stays within its instruction budget per weight (fp16: 13 dequantization
    instructions + 1 mma per word of 8 weights = 1.75, plus loads and addressing; bf16 has no
    high-nibble trick: 15 + 1; scale_acc 4 fewer per word: 1.72-2.08 measured for fp16 on
    Triton 3.6 and 3.9; a cp.async ring, num_stages >= 3, adds its per-tile barriers, wait and
    shared loads: +0.15-0.3). A compiler or layout change that breaks either fails here; ring
    configs must stream the words with cp.async, 2-stage ones into registers, none spilling."""
    run_compile_child(_PTX_CHILD, tmp_path)


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("gs,general", [(128, False), (-1, False), (64, False), (128, True)],
                         ids=["g128", "g-1", "g64", "gidx"])
def test_gemv_candidates_are_valid(m, gs, general, monkeypatch):
    """Every 'gemv' candidate the autotuner may try is a valid config for the problem."""
    monkeypatch.setattr(ops16, "sm_count", lambda index: 132)  # H200's, without a GPU
    kp = 4096
    cands = [c for c in ops16.w4a16_candidates(device=torch.device("cpu"), M=m, N=4096, Kp=kp, group_size=gs,
                                                general_gidx=general) if c.kernel == "gemv"]
    assert cands
    for c in cands:
        ops16.check_w4a16_config(c, kp, m, gs, general)
    # the tensor-core GEMV's tiles come with and without scale_acc; the CUDA-core GEMV has none
    assert any(c.scale_acc for c in cands) == (gs in (128, -1) and not general)


def test_lane_order_check_can_fail():
    """tools/ptx.gemv_lane_order accepts exactly the lane = 4 g + t order: the blocked layout
    Triton 3.9 gives, its linear form, and not the layout Triton 3.6 gave a (C, RR, 8, 16)
    tile (lanes along the chunk slots), which produced wrong results on an H200."""
    from sailfish.tools.ptx import gemv_lane_order

    def ir(layout):
        return (f"#l = {layout}\n%1:4 = tt.elementwise_inline_asm \"mma.sync ...\" -> "
                "(tensor<64x4xf32, #l>, tensor<64x4xf32, #l>)")

    good_blocked = "#ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [8, 4], warpsPerCTA = [4, 1], order = [1, 0]}>"
    good_linear = ("#ttg.linear<{register = [[8, 0]], lane = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], "
                   "warp = [[16, 0], [32, 0]], block = []}>")
    bad_linear = ("#ttg.linear<{register = [], lane = [[0, 1], [0, 2], [8, 0], [1, 0], [2, 0]], "
                  "warp = [[4, 0]], block = []}>")
    bad_blocked = "#ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [2, 16], warpsPerCTA = [4, 1], order = [1, 0]}>"
    assert gemv_lane_order(ir(good_blocked)) and gemv_lane_order(ir(good_linear))
    assert not gemv_lane_order(ir(bad_linear)) and not gemv_lane_order(ir(bad_blocked))
    assert not gemv_lane_order("no asm here")


# ----------------------------------------------------------------------------------
# The asm itself, on the CPU: a lock-step emulation of one warp
# ----------------------------------------------------------------------------------
class _Warp:
    """Runs the GEMV's PTX (the handful of instructions it uses) for 32 lanes in lock step,
    with mma.sync m16n8k16 assembled from the lanes' fragments as the PTX ISA defines them
    (A: a0 row g cols 2t, 2t+1; a1 row g + 8; a2, a3 cols + 8; B: b0 rows 2t, 2t+1 col g,
    b1 rows + 8; C: c0, c1 row g cols 2t, 2t+1, c2, c3 row g + 8). Half-precision ops round
    to nearest even once, fp32 is what numpy's float32 gives; registers hold int64 bits."""

    def __init__(self, operands, mem: bytearray, bf16: bool):
        self.ops, self.mem, self.bf16, self.regs = dict(operands), mem, bf16, {}

    def half(self, bits):  # 16-bit patterns -> float64 values
        bits = np.asarray(bits, np.int64) & 0xFFFF
        if self.bf16:
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)

    def bits(self, v):  # float64 values -> 16-bit patterns, rounded once
        if self.bf16:
            return _bf16_bits(v)
        return np.asarray(v, np.float16).view(np.uint16).astype(np.int64)

    @staticmethod
    def f32(bits):  # 32-bit patterns -> float64 values
        return np.asarray(np.asarray(bits, np.int64) & 0xFFFFFFFF, np.uint32).view(np.float32).astype(np.float64)

    @staticmethod
    def f32_bits(v):  # float64 values -> fp32 bit patterns, rounded once
        return np.asarray(v, np.float32).view(np.uint32).astype(np.int64)

    def val(self, tok):
        if tok.startswith("$"):
            return np.asarray(self.ops[int(tok[1:])], np.int64)
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return np.full(32, int(tok, 0), np.int64)
        if re.fullmatch(r"0f[0-9a-fA-F]{8}", tok):  # a PTX fp32 literal (its bits)
            return np.full(32, int(tok[2:], 16), np.int64)
        return self.regs[tok]

    def pair_op(self, fn, *srcs):
        out = 0
        for sh in (0, 16):
            out = out | (self.bits(fn(*(self.half(s >> sh) for s in srcs))) << sh)
        return out

    def mma(self, rest):
        d, a, b, c = (part.split(", ") for part in re.findall(r"\{([^}]*)\}", rest))
        a, b, c = [self.val(x) for x in a], [self.val(x) for x in b], [self.val(x) for x in c]
        g, t = np.arange(32) // 4, np.arange(32) % 4
        A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        for e in range(2):
            for reg, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                A[g + dr, 2 * t + dc + e] = self.half(a[reg] >> (16 * e))
            B[2 * t + e, g] = self.half(b[0] >> (16 * e))
            B[2 * t + 8 + e, g] = self.half(b[1] >> (16 * e))
        f32 = [np.asarray(x & 0xFFFFFFFF, np.uint32).view(np.float32) for x in c]
        for i, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
            C[g + dr, 2 * t + dc] = f32[i]
        D = (A @ B + C).astype(np.float32)  # fp32 sums of exact products
        for i, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
            self.regs[d[i]] = D[g + dr, 2 * t + dc].view(np.uint32).astype(np.int64)

    def run(self, ptx: str):
        for line in ptx.splitlines():
            line = line.strip().rstrip(";")
            if line in ("{", "}") or line.startswith(".reg"):
                continue
            pred = None
            if line.startswith("@"):
                p, line = line.split(None, 1)
                pred = self.regs[p[1:]]
            op, rest = line.split(None, 1)
            if op.startswith("mma.sync"):
                self.mma(rest)
                continue
            args = [x.strip() for x in re.split(r",(?![^{]*\})", rest)]
            dst, src = args[0], args[1:]
            if op.startswith("mov") and src[0].startswith("{"):
                lo, hi = (self.val(x.strip()) for x in src[0].strip("{}").split(","))
                r = (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)
            elif op.startswith("mov"):
                r = self.val(src[0])
            elif op == "setp.gt.s32":
                r = self.val(src[0]) > self.val(src[1])
            elif op.startswith("ld.global"):
                base, off = re.fullmatch(r"\[(\S+?)(?: \+ (\d+))?\]", src[0]).groups()
                n = 4 if op.endswith("b32") else 2
                addr = self.val(base) + int(off or 0)
                r = np.array([int.from_bytes(self.mem[int(x):int(x) + n], "little") for x in addr], np.int64)
                if pred is not None:
                    r = np.where(pred, r, self.regs[dst])
            elif op == "add.s64":
                r = self.val(src[0]) + self.val(src[1])
            elif op == "shr.u32":
                r = (self.val(src[0]) & 0xFFFFFFFF) >> int(src[1])
            elif op == "lop3.b32" and src[3] == "0xea":  # (a & b) | c
                r = (self.val(src[0]) & self.val(src[1])) | self.val(src[2])
            elif op in ("add.rn.f16", "add.rn.bf16", "sub.rn.f16"):
                a, b = self.half(self.val(src[0])), self.half(self.val(src[1]))
                r = self.bits(a + b if op.startswith("add") else a - b)
            elif op in ("cvt.f32.f16", "cvt.f32.bf16"):
                r = self.f32_bits(self.half(self.val(src[0])))
            elif op == "fma.rn.f32":  # (float64 holds the exact a * b + c; one rounding)
                a, b, c = (self.f32(self.val(x)) for x in src)
                r = self.f32_bits(a * b + c)
            elif op.startswith(("sub.rn.", "mul.rn.", "fma.rn.")):
                fn = {"sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                      "fma": lambda a, b, c: a * b + c}[op[:3]]  # float64 is exact here
                r = self.pair_op(fn, *(self.val(x) for x in src))
            else:
                raise NotImplementedError(op)
            if dst.startswith("$"):
                self.ops[int(dst[1:])] = r
            else:
                self.regs[dst] = np.asarray(r, np.int64)


def _bf16_bits(v):
    b = np.asarray(v, np.float32).view(np.uint32).astype(np.int64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _emulate_gemv_asm(dtype, sym, even_k, pairs, edit=lambda ptx: ptx, scale_acc=False, acc0=0.0):
    """Worst relative error of the asm's outputs (see test_gemv_asm_emulated) against
    acc0 + x . W_eff (W_eff unrounded with scale_acc), with `edit` applied to the PTX first."""
    from sailfish.formats.int4 import pack_words
    from sailfish.kernels.w4a16 import _gemv_mma_asm

    bf16, k, rows = dtype == BF16, 128, 16 * pairs
    qw = random_quantized(k, rows, 128, sym, dtype)
    w_eff = qw.dequantize(rounded=not scale_acc).double().numpy()
    x = torch.randn(k).to(dtype)
    q = qw.qweight.to(torch.int64)
    words = (pack_words(q).to(torch.int64) & 0xFFFFFFFF).numpy()  # (rows, 16)
    scales, zeros = qw.scales[0], (torch.full((rows,), 8.0) if sym else qw.zeros[0].float()).to(dtype)
    mem = bytearray(0x3000)
    for base, v in ((0x1000, x), (0x2000, scales), (0x2800, zeros)):
        raw = v.view(torch.int16).numpy().tobytes()
        mem[base:base + len(raw)] = raw
    g, t = np.arange(32) // 4, np.arange(32) % 4
    ops = {}
    for p in range(pairs):
        for a in range(4):
            ops[4 * pairs + 8 * p + a] = words[16 * p + g, 4 * t + a]
            ops[4 * pairs + 8 * p + 4 + a] = words[16 * p + 8 + g, 4 * t + a]
    ix = 12 * pairs
    ops[ix] = 0x1000 + 4 * t
    for r in range(2 * pairs):
        ops[ix + 1 + r] = 0x2000 + 2 * (8 * r + g)
    ops[ix + 1 + 2 * pairs] = np.full(32, 0x800)  # zero points past the scales
    ops[ix + 2 + 2 * pairs] = np.full(32, 64) if even_k else k // 2 - t
    for i in range(4 * pairs):  # the accumulators coming in
        ops[ix + 3 + 2 * pairs + i] = _Warp.f32_bits(np.full(32, acc0))
    warp = _Warp(ops, mem, bf16)
    warp.run(edit(_gemv_mma_asm(bf16, not sym, even_k, pairs, scale_acc)))
    ref = w_eff @ x.double().numpy() + acc0
    worst = 0.0
    for p in range(pairs):
        for i in range(4):
            got = np.asarray(warp.ops[4 * p + i] & 0xFFFFFFFF, np.uint32).view(np.float32)
            want = ref[16 * p + 8 * (i // 2) + g]
            worst = max(worst, float(np.max(np.abs(got - want) / (np.abs(want) + 1e-3))))
    return worst


@pytest.mark.parametrize("scale_acc", [False, True], ids=["scaled", "scale_acc"])
@pytest.mark.parametrize("pairs", [1, 2])
@pytest.mark.parametrize("even_k", [True, False], ids=["evenK", "Ktail"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_NAMES.get)
def test_gemv_asm_emulated(dtype, sym, even_k, pairs, scale_acc):
    """The GPU-only asm (kernels/w4a16._gemv_mma_asm), run by a warp emulator on one
    128-channel chunk with each lane holding the operands the kernel gives it (lane 4g + t:
    words 4t + a of rows g and g + 8 of each 16-row block, x pair t, its rows' scale
    addresses) and an incoming accumulator: every output must be that plus the row's
    x . W_eff (fp32 sums of exact products, so within a few fp32 ulps; scale_acc: the
    unrounded weights, the chunk sum scaled in fp32). The lane order itself is the
    compiler's: tools/ptx checks it."""
    assert _emulate_gemv_asm(dtype, sym, even_k, pairs, scale_acc=scale_acc, acc0=0.75) < 1e-5


@pytest.mark.parametrize("scale_acc", [False, True], ids=["scaled", "scale_acc"])
@pytest.mark.parametrize("edit", [lambda p: p.replace("{x0, x1}", "{x1, x0}"),
                                  lambda p: p.replace("0x00f000f0", "0x000f000f", 1),
                                  lambda p: p.replace("{p0, p1, p2, p3}", "{p0, p2, p1, p3}", 1),
                                  lambda p: p.replace("[$14]", "[$13]", 1)],
                         ids=["x-pair", "nibble", "fragment", "scale-row"])
def test_gemv_asm_emulation_can_fail(edit, scale_acc):
    """The emulation notices a swapped x pair, a wrong nibble mask or fragment registers, and
    row g's scale applied to row g + 8 (operand $14 is row g + 8's scale address at 1 pair)."""
    assert _emulate_gemv_asm(F16, False, True, 1, edit, scale_acc=scale_acc, acc0=0.75) > 1e-2


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("kp", [256, 768, 1536, 4096])
def test_gemv_heuristic_is_valid(m, kp):
    """The heuristic's tensor-core GEMV config divides every padded K (a multiple of 256)."""
    cfg = ops16.w4a16_heuristic(device=torch.device("cpu"), M=m, N=4096, Kp=kp, group_size=-1, general_gidx=False)
    assert cfg.kernel == "gemv" and gemv_on_tensor_cores(cfg, torch.empty(m, 64), 0, False)
    ops16.check_w4a16_config(cfg, kp, m)


# split-K slices added inside the GEMV (ops/w4a16.gemv_fixup): 784 channels in 4 K tiles of 256 split 3
# (2 + 2 + an empty slice) or 7 of 128 split 2 (4 + 3, a K tail), N = 40 not a multiple of BLOCK_N;
# the CUDA-core GEMV where the tensor-core one does not apply (group 64)
#   M   gs    sym    dtype bias  config
FIXUP_CASES = [
    (1, 128, True, F16, True, gemv(1, 16, 256, 3)),
    (3, -1, False, BF16, True, gemv(4, 32, 128, 2, scale_acc=True)),
    (1, 64, False, BF16, True, gemv(1, 16, 256, 3)),
    (2, 64, True, F16, False, gemv(2, 16, 128, 2)),
]


@pytest.mark.parametrize("m,gs,sym,dtype,bias,cfg", FIXUP_CASES,
                         ids=["mma-M1", "mma-M3-scale_acc", "cuda-cores-M1", "cuda-cores-M2"])
def test_gemv_split_k_in_one_launch(m, gs, sym, dtype, bias, cfg, device, monkeypatch):
    """A split-K GEMV call is one launch: each tile's last slice adds the slices (kernels/w4a16.py
    _gemv_fixup) in the reduce kernel's order, so the output equals the two-launch path's bit for
    bit (same shape, computed twice) and the reference per element; every tile counter is back at
    zero afterwards (the next launch on the stream relies on it)."""
    from sailfish.ops.common import sync_buffer
    from sailfish.runtime import launch as launch_mod

    k, n = 784, 40
    layer = make_layer(k, n, gs, sym, dtype, bias, device)
    x = torch.randn(m, k, device=device).to(dtype)
    assert gemv_on_tensor_cores(cfg, x, 0 if gs == -1 else gs, False) == (gs != 64)
    launches = []
    call = launch_mod.Launch.__call__
    monkeypatch.setattr(launch_mod.Launch, "__call__", lambda self, *a: (launches.append(self.fn), call(self, *a)))
    out = {}
    for fixup in (False, True):
        monkeypatch.setattr(FLAGS, "split_fixup", fixup)
        launches.clear()
        out[fixup] = launch(layer, x, cfg)
        assert len(launches) == (1 if fixup else 2), [f.__name__ for f in launches]
    assert torch.equal(out[True], out[False])
    w = layer.quantized_weight().dequantize(rounded=not cfg.scale_acc)
    assert_close_per_element(out[True], x, w, layer.bias)
    assert not sync_buffer(x.device, x.get_device()).any(), "tile counters left non-zero"


def test_eager_scratch_is_kept_per_stream_and_grows():
    """The split-K workspace of calls outside a capture (ops/common.eager_scratch): one per stream,
    reused while it is large enough, grown to a power of two when it is not, its counters the
    stream's sync_buffer."""
    from sailfish.ops.common import eager_scratch, sync_buffer

    dev, index = (torch.device("cuda", 0), 0) if torch.cuda.is_available() else (torch.device("cpu"), -1)
    first = eager_scratch(dev, index, 1000)
    size = first.ws.numel()
    assert size >= 1000 and size & (size - 1) == 0 and first.ws.dtype == torch.float32
    assert first.ws_ptr == first.ws.data_ptr() and first.sync is sync_buffer(dev, index)
    assert first.sync_ptr == first.sync.data_ptr()
    again = eager_scratch(dev, index, size)
    assert again is first and again.ws.numel() == size
    grown = eager_scratch(dev, index, size + 1)
    assert grown is first and grown.ws.numel() == 2 * size and grown.ws_ptr == grown.ws.data_ptr()


def test_gemv_fixup_rule(monkeypatch):
    """The fixup takes the split-K GEMVs only, while the tile counters serve the launch
    (ops/common.py fixup_fits), and SAILFISH_SPLIT_FIXUP=0 turns it off."""
    assert ops16.gemv_fixup(gemv(1, 16, 256, 2), 1, 4096)
    assert not ops16.gemv_fixup(gemv(1, 16, 256, 1), 1, 4096)  # no split
    assert not ops16.gemv_fixup(Config(16, 64, 256, 2), 16, 4096)  # the mma kernel: the reduce kernel
    assert not ops16.gemv_fixup(gemv(1, 16, 256, 2), 1, 16 * (1 << 14) + 1)  # more tiles than counters
    monkeypatch.setattr(FLAGS, "split_fixup", False)
    assert not ops16.gemv_fixup(gemv(1, 16, 256, 2), 1, 4096)


@pytest.mark.parametrize("m,gs,cfg", [(1, -1, gemv(1, 16, 128, 3)), (3, -1, gemv(4, 32, 128, 3)),
                                      (1, 64, gemv(1, 16, 128, 3))], ids=["mma-M1", "mma-M3", "cuda-cores-M1"])
def test_gemv_split_k_sums_in_slice_order(m, gs, cfg, device):
    """The in-kernel slice sum keeps the reduce kernel's order 0, 1, 2 whichever slice finishes
    last, where the order decides the bits: x is 2**30 at a channel of slice 0, -2**30 at one of
    slice 1 with the same weights (same codes, scales and zero points), 2**-10 at one of slice 2,
    so (A + B) + C = C exactly per output, while C + B loses C (rows of |w| > 0). Compared to
    that exact value (no bias: bf16 would round C away beside it)."""
    k, n, c0, c1, c2 = 784, 40, 5, 400, 770  # 7 K tiles of 128 split 3: channels [0, 384), [384, 768), [768, 784)
    qw = random_quantized(k, n, gs, False, BF16, None, device)
    qw.qweight[:, c1] = qw.qweight[:, c0]
    if gs != -1:  # the two channels' groups alike
        qw.scales[c1 // gs] = qw.scales[c0 // gs]
        qw.zeros[c1 // gs] = qw.zeros[c0 // gs]
    layer = QuantLinear.from_quantized(qw, None)
    x = torch.zeros(m, k, device=device, dtype=BF16)
    x[:, c0], x[:, c1], x[:, c2] = 2.0 ** 30, -2.0 ** 30, 2.0 ** -10
    assert gemv_on_tensor_cores(cfg, x, max(gs, 0), False) == (gs == -1) and ops16.gemv_fixup(cfg, m, n)
    w = layer.quantized_weight().dequantize().float()
    assert torch.equal(w[:, c0], w[:, c1]) and (w[:, c0] != 0).any()
    y = launch(layer, x, cfg)
    assert torch.equal(y, (w[:, c2] * 2.0 ** -10).to(BF16).expand(m, n))


_FIXUP_PTX_CHILD = r"""
import re
import sys
from sailfish.kernels.w4a16 import _w4a16_gemv_kernel
from sailfish.tools.ptx import ast_source, compile_gemv, gemv_loop, ptxas_report
import triton
from triton.backends.compiler import GPUTarget


def registers(ptx):
    rep = ptxas_report(ptx)
    return int(re.search(r"Used (\d+) registers", rep).group(1)), " 0 bytes spill stores" in rep


def protocol(ptx):  # the count-in (acq_rel), the slices read past L1, the counter reset
    return ("atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx and "atom.global.gpu.relaxed.exch" in ptx)


bad = []
for c in [(1, 16, 1024, 2, 8, 1), (2, 32, 512, 4, 4, 2)]:
    base, fx = (compile_gemv(*c, fixup=f).asm["ptx"] for f in (False, True))
    loops = [gemv_loop(*c, fixup=f).per_weight for f in (False, True)]
    if not protocol(fx) or protocol(base) or loops[0] != loops[1] or registers(fx)[0] > registers(base)[0] + 8 \
            or not registers(fx)[1]:
        bad.append((c, loops, registers(base), registers(fx)))
sig = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "gidx_ptr": "*i32", "bias_ptr": "*fp16",
       "y_ptr": "*fp16", "ws_ptr": "*fp32", **{k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_ym", "stride_qn",
                                                                "stride_sn")}, "sync_ptr": "*i32"}
ptx = triton.compile(ast_source(_w4a16_gemv_kernel, sig, dict(
    GROUP_SIZE=64, HAS_ZEROS=True, HAS_GIDX=False, HAS_BIAS=True, EVEN_K=True, SPLIT_K=4, EMU_BF16=False, USE_ASM=True,
    BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, FIXUP=True)), target=GPUTarget("cuda", 90, 32),
    options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
if not protocol(ptx) or not registers(ptx)[1]:
    bad.append(("cuda-cores", registers(ptx)))
print("checked")
sys.exit(f"GEMV fixup off target: {bad}" if bad else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_gemv_fixup_compiles_to_its_protocol(tmp_path):
    """Compiled for sm_90a: a split-K GEMV with FIXUP counts its slice in with an acq_rel atomic
    at GPU scope (after a CTA barrier), the last slice reads the workspace with ld.global.cg
    (past the L1, which another SM's stores do not update) and resets the counter; the K loop
    of the tensor-core GEMV keeps its instructions per weight and the registers stay within 8 of
    the two-launch kernel's, with no spill."""
    run_compile_child(_FIXUP_PTX_CHILD, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_gemv_fixup_in_a_cuda_graph():
    """A captured split-K GEMV with the in-kernel sum replays correctly again and again: each
    launch leaves its stream's tile counters at zero (no memset, no host sync, nothing allocated
    outside the graph's pool), and the replays equal eager calls on fresh inputs bit for bit."""
    from sailfish.ops import common

    layer = make_layer(2048, 256, 128, True, F16, True, "cuda")
    cfg = gemv(1, 16, 512, 4)
    x = torch.randn(1, 2048, device="cuda").half()
    assert ops16.gemv_fixup(cfg, 1, 256)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile) off the capture
            launch(layer, x, cfg)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = launch(layer, x, cfg)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert torch.equal(out, launch(layer, x, cfg))
    torch.cuda.synchronize()
    assert not any(buf.any() for buf in common._SYNC.values()), "tile counters left non-zero"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_gemv_fixup_graphs_replay_in_any_order():
    """Warm-up on one stream, two graphs captured on a stream never used before: the capture
    stream's tile counters must be zero before either graph runs, so the graph captured second
    replays correctly before the first one ever has (its counters are not zeroed by a kernel of
    the first graph)."""
    from sailfish.ops import common

    torch.cuda.set_device(0)
    layer = make_layer(2048, 256, 128, True, F16, True, "cuda")
    cfg = gemv(1, 16, 512, 4)
    xs = [torch.randn(1, 2048, device="cuda").half() for _ in range(2)]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            launch(layer, xs[0], cfg)
        torch.cuda.current_stream().wait_stream(side)
        capture = torch.cuda.Stream()  # a stream no launch has used: its buffer is first needed in the capture
        spares = {buf.data_ptr() for buf in common._SPARE[0]}
        graphs, outs = [torch.cuda.CUDAGraph() for _ in xs], []
        for g, x in zip(graphs, xs):
            with torch.cuda.graph(g, stream=capture):
                outs.append(launch(layer, x, cfg))
        # the capture took a spare zeroed outside it (fresh memory may read zero anyway, so
        # the replay order below alone could pass by luck)
        assert common._SYNC[(0, capture.cuda_stream)].data_ptr() in spares
        graphs[1].replay()
        graphs[0].replay()
        torch.cuda.synchronize()
        for x, out in zip(xs, outs):
            assert torch.equal(out, launch(layer, x, cfg))
    assert not any(buf.any() for buf in common._SYNC.values()), "tile counters left non-zero"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_k_layer_under_compile_reduce_overhead():
    """torch.compile(mode="reduce-overhead") (what transformers' generate() uses with a static
    cache) runs its warm-up inside the CUDA graph memory pool and refuses live allocations there
    that are not outputs: the split-K tile counters, kept for the life of the process, must be
    made outside it. The down projection of Llama-3-8B at M = 1 (split-K on Hopper)."""
    from sailfish.ops import common

    torch._dynamo.reset()
    layer = make_layer(14336, 4096, 128, True, F16, False, "cuda")
    try:
        with torch.no_grad():
            f = torch.compile(lambda x: layer(x), mode="reduce-overhead", fullgraph=True)
            for _ in range(4):
                x = torch.randn(1, 14336, device="cuda").half()
                assert torch.equal(f(x).clone(), layer(x))
    finally:
        torch._dynamo.reset()
    assert not any(buf.any() for buf in common._SYNC.values()), "tile counters left non-zero"
