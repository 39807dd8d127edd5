"""The Hopper Gluon W4A16 kernel (kernels/w4a16_gluon.py) and its Triton twin.

A 'gluon' config runs the Gluon kernel on an sm_90 GPU and the twin (ops/w4a16.gluon_twin:
the mma kernel with the same tile, K step and split, scales on the fp32 products) anywhere
else, including the CPU interpreter, which cannot run Gluon. On the CPU these tests run the
twin and compile the Gluon kernel for sm_90a (PTX / SASS checks); on an H100 / H200 they
run the Gluon kernel itself against the reference, per element.
"""
import dataclasses
import warnings

import pytest
import torch

from helpers import (DTYPE_NAMES, LOOP_PROBLEMS, PIPE_PROBLEMS, StandInKernel, assert_close_per_element, incompatible_gluon,
                     make_g_idx, random_quantized, run_compile_child)
from sailfish.runtime.flags import FLAGS
from sailfish import Config, QuantLinear
from sailfish.ops import w4a16 as ops16
from sailfish.ops.common import gluon_overlap_split_ok, gluon_split_ok
from sailfish.ops.w4a16 import gluon_twin, w4a16_launch

F16, BF16 = torch.float16, torch.bfloat16


def _on_hopper() -> bool:
    return torch.cuda.is_available() and ops16.gluon_device(torch.cuda.current_device())


def _layer(k, n, gs, dtype, bias, device, sym=True, gidx="none"):
    qw = random_quantized(k, n, gs, sym, dtype, make_g_idx(gidx, k, gs, device), device)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return QuantLinear.from_quantized(qw, b)


def _launch(layer, x, cfg, use_asm=True):
    return w4a16_launch(x, layer.qweight, layer.scales, layer.zeros, layer.perm, layer.sorted_g_idx, layer.bias,
                        layer.in_features, layer.group_size, config=cfg, use_asm=use_asm)


# M, K, N, group size, symmetric, dtype, bias, config: M not a multiple of BLOCK_M, N not of
# BLOCK_N, per channel and groups of 128 / 256, zero points (0..16), split-K with even, uneven
# and power-of-two splits, one and two warpgroups
CASES = [
    (16, 1024, 192, 128, True, F16, False, Config(16, 64, 256, 1, 8, 4, 3, kernel="gluon")),
    (5, 1024, 200, 128, True, F16, True, Config(16, 64, 256, 2, 8, 4, 2, kernel="gluon")),
    (3, 1024, 136, 128, False, BF16, False, Config(16, 64, 256, 2, 8, 4, 3, kernel="gluon")),
    (16, 1536, 128, -1, True, F16, True, Config(16, 128, 256, 3, 8, 4, 3, kernel="gluon")),
    (30, 2048, 136, 256, True, BF16, False, Config(32, 64, 256, 4, 8, 4, 4, kernel="gluon")),
    (48, 1280, 64, 128, True, BF16, True, Config(32, 64, 256, 5, 8, 4, 2, kernel="gluon")),
    (64, 768, 320, -1, True, BF16, False, Config(64, 64, 256, 1, 8, 4, 3, kernel="gluon")),
    (40, 1024, 384, 128, True, F16, True, Config(64, 128, 256, 2, 8, 8, 3, kernel="gluon")),
    (16, 2048, 200, -1, True, BF16, False, Config(16, 128, 256, 1, 8, 8, 2, kernel="gluon")),
    (17, 1792, 256, 128, True, F16, True, Config(16, 128, 256, 4, 8, 4, 2, kernel="gluon")),
    (16, 2048, 192, 128, False, BF16, True, Config(16, 64, 256, 3, 8, 4, 3, kernel="gluon")),
    (9, 1024, 200, 256, False, F16, False, Config(16, 64, 256, 1, 8, 4, 2, kernel="gluon")),
    (32, 1536, 136, -1, False, BF16, True, Config(32, 64, 256, 2, 8, 4, 3, kernel="gluon")),
    (64, 1024, 256, 128, False, F16, False, Config(64, 128, 256, 1, 8, 8, 3, kernel="gluon")),
    # BLOCK_M 8 (wgmma N = 8; its twin runs BLOCK_M 16): M below, at and above it
    (2, 1024, 200, 128, True, F16, True, Config(8, 64, 256, 2, 8, 4, 3, kernel="gluon")),
    (8, 1536, 136, -1, False, BF16, False, Config(8, 64, 256, 3, 8, 4, 4, kernel="gluon")),
    (11, 1024, 128, 128, False, F16, False, Config(8, 64, 256, 1, 8, 4, 2, kernel="gluon")),
]


def _case_id(c):
    m, k, n, gs, sym, dt, bias, cfg = c
    return (f"M{m}-K{k}-N{n}-g{gs}-{'sym' if sym else 'asym'}-{DTYPE_NAMES[dt]}{'-bias' if bias else ''}"
            f"-bm{cfg.BLOCK_M}bn{cfg.BLOCK_N}w{cfg.num_warps}sk{cfg.SPLIT_K}")


@pytest.mark.parametrize("m,k,n,gs,sym,dtype,bias,cfg", CASES, ids=[_case_id(c) for c in CASES])
def test_gluon_config_matches_reference(m, k, n, gs, sym, dtype, bias, cfg, device):
    """Every element within the fp32-accumulation bound of the exact product (helpers):
    the Gluon kernel on Hopper, its twin elsewhere."""
    layer = _layer(k, n, gs, dtype, bias, device, sym=sym)
    x = torch.randn(m, k, device=device).to(dtype)
    y = _launch(layer, x, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    # the exact s * (q - 8): both kernels scale the fp32 products, no weight is rounded
    assert_close_per_element(y, x, layer.quantized_weight().dequantize(rounded=False), layer.bias)


def _overlap(bm, bn, split, warps, stages, kernel="gluon_overlap"):
    return Config(bm, bn, 256, split, 8, warps, stages, kernel=kernel)


def _regs(bm, bn, split, warps, stages):
    return _overlap(bm, bn, split, warps, stages, "gluon_overlap_regs")


# 'gluon_overlap' (the kernel that dequantizes a K step while the previous one's wgmmas run):
# every split an even number of K steps (2 at least), rings of 3 and 4 steps, the formats above;
# 'gluon_overlap_regs' (its words straight into registers) on a few (the CPU runs the same twin)
OVERLAP_CASES = [
    (16, 1024, 192, 128, True, F16, False, _overlap(16, 64, 1, 4, 3)),
    (5, 2048, 200, 128, False, BF16, True, _overlap(16, 64, 2, 4, 3)),
    (3, 1536, 136, -1, True, F16, True, _overlap(8, 64, 3, 4, 3)),
    (30, 2048, 136, 256, False, F16, False, _overlap(32, 64, 1, 4, 4)),
    (64, 1024, 320, -1, False, BF16, False, _overlap(64, 128, 1, 8, 3)),
    (40, 3072, 256, 128, True, BF16, True, _overlap(64, 128, 3, 8, 4)),
    (11, 1024, 128, 128, True, F16, False, _overlap(8, 64, 2, 4, 3)),
    (1, 2048, 72, 128, False, F16, True, _overlap(8, 64, 2, 4, 4)),
    (100, 1024, 128, 128, True, F16, False, _overlap(64, 128, 2, 8, 3)),
    (16, 1024, 192, 128, False, BF16, True, _regs(16, 64, 2, 4, 3)),
    (2, 1536, 136, -1, True, F16, False, _regs(8, 64, 1, 4, 4)),
    (40, 3072, 256, 128, False, BF16, False, _regs(64, 128, 3, 8, 4)),
    (30, 2048, 200, 256, True, F16, True, _regs(32, 64, 4, 4, 3)),
]


def _pipe(bm, bn, split, warps, stages):
    return Config(bm, bn, 256, split, 8, warps, stages, kernel="gluon_pipe")


# 'gluon_pipe' (large M: a chunk's wgmmas in flight while the next chunk is dequantized; x by TMA,
# rows past M zero-filled): one and two M tiles, N not a multiple of the tile, both formats, per channel / 128 / 256, splits that leave 1 (only the peeled step),
# 2 and several K steps per program, x rings of 3 / 4 and 4 / 5 chunks
PIPE_CASES = [
    (130, 1024, 256, 128, True, F16, True, _pipe(128, 128, 1, 8, 3)),
    (96, 1536, 136, 128, False, BF16, False, _pipe(128, 128, 2, 8, 3)),
    (200, 1024, 192, -1, True, F16, False, _pipe(128, 128, 1, 8, 3)),
    (70, 768, 128, 256, False, F16, True, _pipe(64, 128, 3, 8, 4)),
    (64, 512, 128, 128, True, BF16, True, _pipe(64, 128, 1, 8, 3)),
]


@pytest.mark.parametrize("m,k,n,gs,sym,dtype,bias,cfg", OVERLAP_CASES + PIPE_CASES,
                         ids=[_case_id(c) + "-" + c[-1].kernel for c in OVERLAP_CASES + PIPE_CASES])
def test_gluon_overlap_config_matches_reference(m, k, n, gs, sym, dtype, bias, cfg, device):
    """As above for the overlap and pipe kernels: their groups scale the weights (rounded once to
    x's dtype, as their twin, the mma tile without SCALE_ACC), per channel the fp32 product."""
    layer = _layer(k, n, gs, dtype, bias, device, sym=sym)
    x = torch.randn(m, k, device=device).to(dtype)
    y = _launch(layer, x, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_close_per_element(y, x, layer.quantized_weight().dequantize(rounded=gs != -1), layer.bias)
    twin = gluon_twin(cfg, gs)
    assert twin.kernel == "mma" and twin.scale_acc == (gs == -1) and twin.SPLIT_K == cfg.SPLIT_K


@pytest.mark.parametrize("gidx,k", [("gidx", 1024), ("none", 1152)], ids=["general-g_idx", "K%256"])
def test_gluon_config_falls_back_to_its_twin(gidx, k, device):
    """Where the Gluon kernel does not apply (a general g_idx, K not a multiple of its
    256-channel step; on the CPU: always) a 'gluon' config gives exactly what its twin gives."""
    layer = _layer(k, 192, 128, F16, True, device, sym=False, gidx=gidx)
    x = torch.randn(16, k, device=device).to(F16)
    cfg = Config(16, 64, 256, 2, 8, 4, 3, kernel="gluon")
    assert not ops16.gluon_applies(x, layer.qweight, 128, layer.sorted_g_idx is not None, True)
    twin = gluon_twin(cfg)
    assert twin.kernel == "mma" and twin.scale_acc and twin.BLOCK_K == 256
    # (a general g_idx takes no SCALE_ACC: the twin tile runs without it, as table configs do)
    expect = _launch(layer, x, twin if gidx == "none" else dataclasses.replace(twin, scale_acc=False))
    assert torch.equal(_launch(layer, x, cfg), expect)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon kernel's dispatch, on a GPU")
@pytest.mark.parametrize("kernel", ["gluon", "gluon_overlap", "gluon_overlap_regs", "gluon_pipe"])
def test_gluon_kernel_is_used_on_hopper(kernel):
    """On an sm_90 GPU the plan of a Gluon config launches that Gluon kernel (the overlap kernel
    with WORDS_IN_REGS for 'gluon_overlap_regs'); elsewhere its twin (kind 'mma')."""
    from sailfish.kernels.w4a16_gluon import (w4a16_gluon_kernel, w4a16_gluon_overlap_kernel,
                                              w4a16_gluon_pipe_kernel)

    layer = _layer(1024, 256, 128, F16, False, "cuda")
    x = torch.randn(16, 1024, device="cuda", dtype=F16)
    cfg = (Config(64, 128, 256, 2, 8, 8, 3, kernel=kernel) if kernel == "gluon_pipe" else
           Config(16, 64, 256, 2, 8, 4, 3, kernel=kernel))
    plan = ops16._GemmPlan(cfg, 0, gs=128, has_zeros=False, has_gidx=False, has_bias=False, emu=False, asm=True,
                           mma_asm=True, tensor_core_gemv=False, paired=True, bf16=False, K=1024, group_size=128,
                           gluon=ops16.gluon_applies(x, layer.qweight, 128, False, True))
    assert plan.kind == ((kernel if kernel == "gluon_pipe" else "gluon") if _on_hopper() else "mma")
    if _on_hopper():
        assert plan.gemm.fn is {"gluon": w4a16_gluon_kernel, "gluon_pipe": w4a16_gluon_pipe_kernel}.get(
            kernel, w4a16_gluon_overlap_kernel)
        assert plan.gemm.meta.get("WORDS_IN_REGS", False) == (kernel == "gluon_overlap_regs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="determinism of the compiled kernel, on the GPU")
@pytest.mark.parametrize("cfg", [Config(16, 64, 256, 6, 8, 4, 3, kernel="gluon"), _overlap(16, 64, 4, 4, 3),
                                 _regs(16, 64, 4, 4, 3), _pipe(128, 128, 4, 8, 3)],
                         ids=["gluon", "gluon_overlap", "gluon_overlap_regs", "gluon_pipe"])
def test_gluon_split_k_is_deterministic(cfg):
    """Split-K partial sums reduced in a fixed order: the same bits on every call."""
    layer = _layer(8192, 1024, 128, F16, True, "cuda")
    x = torch.randn(16, 8192, device="cuda", dtype=F16)
    first = _launch(layer, x, cfg)
    for _ in range(5):
        assert torch.equal(_launch(layer, x, cfg), first)


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon overlap kernel's two split-K forms, on an sm_90 GPU")
@pytest.mark.parametrize("m,k,dtype,bias,cfg", [
    (16, 2048, F16, True, _overlap(16, 64, 4, 4, 4)),
    (5, 3072, BF16, False, _overlap(8, 64, 3, 4, 3)),
    (9, 2048, F16, False, _regs(16, 64, 2, 4, 3)),
    (32, 4096, BF16, True, _regs(32, 64, 4, 4, 4)),
], ids=["overlap-split4", "overlap-split3", "regs-split2", "regs-split4-m32"])
def test_overlap_split_k_eager_and_captured_agree(m, k, dtype, bias, cfg):
    """A split-K overlap config has two forms (ops/w4a16.overlap_fixup): outside a CUDA graph
    capture the tile's last slice adds the slices in the GEMM (one launch: eager host time, issue
    39 item 5), a capture records the GEMM and its PDL-chained reduce. The plan's first call binds
    both; the two give the same bits (zero plus slices in slice order, plus the bias, one cast),
    and the reference's numbers."""
    layer = _layer(k, 200, 128, dtype, bias, "cuda")
    x = torch.randn(m, k, device="cuda").to(dtype)
    assert ops16.overlap_fixup(cfg, m, 200)
    plan = ops16._GemmPlan(cfg, 0, gs=128, has_zeros=False, has_gidx=False, has_bias=bias, emu=False, asm=True,
                           mma_asm=True, tensor_core_gemv=False, paired=True, bf16=dtype == BF16, K=k,
                           group_size=128, gluon=True, eager_fixup=True)
    assert plan.eager is not None and plan.eager.meta["FIXUP"] and plan.reduce is not None
    y = torch.full((m, 200), float("nan"), device="cuda", dtype=dtype)
    args = (x, layer.qweight, layer.scales, layer.scales, None, layer.bias, m, 200, k, layer.qweight.stride(0),
            layer.scales.stride(0))
    plan(y, y, *args)  # eager: the in-kernel sum, and the other two kernels bound without a launch
    assert plan.bound()
    assert_close_per_element(y, x, layer.quantized_weight().dequantize(rounded=True), layer.bias)
    graph_y = torch.full_like(y, float("nan"))
    ptrs = tuple(None if t is None else t.data_ptr() for t in args[:6])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan(graph_y, graph_y.data_ptr(), *ptrs, *args[6:])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_y, y)
    again = torch.full_like(y, float("nan"))
    plan(again, again.data_ptr(), *ptrs, *args[6:])  # eager steady state: the counters were left at zero
    assert torch.equal(again, y)


@pytest.mark.skipif(not _on_hopper(), reason="the Gluon overlap kernel's two split-K forms, on an sm_90 GPU")
def test_overlap_split_k_first_call_captured():
    """A plan whose first call is inside a CUDA graph capture (no eager warm-up) binds the
    captured path and, without a launch, the eager one, using the capture's own workspace (the
    stream's eager_scratch would synchronize inside the capture): the replay and a later eager
    call give the same bits as a plan warmed up eagerly."""
    m, k, dtype, cfg = 16, 2048, F16, _overlap(16, 64, 4, 4, 4)
    layer = _layer(k, 200, 128, dtype, True, "cuda")
    x = torch.randn(m, k, device="cuda").to(dtype)
    args = (x, layer.qweight, layer.scales, layer.scales, None, layer.bias, m, 200, k, layer.qweight.stride(0),
            layer.scales.stride(0))
    ptrs = tuple(None if t is None else t.data_ptr() for t in args[:6])

    def plan():
        return ops16._GemmPlan(cfg, 0, gs=128, has_zeros=False, has_gidx=False, has_bias=True, emu=False, asm=True,
                               mma_asm=True, tensor_core_gemv=False, paired=True, bf16=False, K=k, group_size=128,
                               gluon=True, eager_fixup=True)

    want = torch.full((m, 200), float("nan"), device="cuda", dtype=dtype)
    plan()(want, want, *args)
    fresh = plan()
    got = torch.full_like(want, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fresh(got, got, *args)  # (a first call passes tensors: Triton specializes on them)
    assert fresh.bound()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    again = torch.full_like(want, float("nan"))
    fresh(again, again.data_ptr(), *ptrs, *args[6:])
    assert torch.equal(again, want)


@pytest.mark.parametrize("cfg,match", [
    (Config(16, 64, 128, 1, 8, 4, 3, kernel="gluon"), "BLOCK_K=256"),
    (Config(128, 64, 256, 1, 8, 4, 3, kernel="gluon"), "BLOCK_M in"),
    (Config(64, 128, 256, 1, 8, 8, 6, kernel="gluon"), "needs 294912 bytes of shared memory"),
    (_overlap(64, 128, 2, 8, 6), "needs 294912 bytes of shared memory"),
    (_regs(64, 128, 2, 8, 8), "needs 262144 bytes of shared memory"),
    (_pipe(32, 64, 1, 4, 3), "needs BLOCK_M 64 or 128"),
    (_pipe(128, 128, 1, 4, 3), "needs BLOCK_N 128 and num_warps 8"),
    (_pipe(128, 64, 1, 4, 3), "needs BLOCK_N 128 and num_warps 8"),
    (_pipe(128, 128, 1, 8, 2), "num_stages >= 3"),
    (_pipe(128, 128, 1, 8, 4), "needs 295056 bytes of shared memory"),
    (_overlap(128, 128, 1, 8, 3), "BLOCK_M in"),
    (Config(16, 256, 256, 1, 8, 4, 3, kernel="gluon"), "BLOCK_N in"),
    (Config(16, 64, 256, 1, 8, 8, 3, kernel="gluon"), "num_warps 4"),
    (Config(16, 128, 256, 1, 8, 2, 3, kernel="gluon"), "num_warps 4"),
    (Config(16, 64, 256, 1, 8, 4, 1, kernel="gluon"), "num_stages >= 2"),
    (Config(16, 64, 256, 1, 8, 4, 3, kernel="gluon", scale_acc=True), "scale_acc"),
    (Config(16, 64, 256, 3, 8, 4, 3, kernel="gluon"), "SPLIT_K=3 leaves a split"),
    (_overlap(16, 64, 1, 4, 2), "num_stages >= 3"),
    (_overlap(16, 64, 3, 4, 3), "SPLIT_K=3 does not give every split an even number"),
    (Config(16, 64, 256, 1, 8, 4, 3, kernel="gluon_overlap", scale_acc=True), "scale_acc"),
    (Config(16, 64, 256, 1, 8, 4, 3, kernel="gluon_ws"), "is not one of"),
    (_overlap(64, 64, 1, 4, 3), "for BLOCK_M 64, num_warps 8"),
    (_overlap(16, 128, 1, 4, 3), "BLOCK_N = 16 \\* num_warps"),
    (_regs(16, 64, 3, 4, 3), "SPLIT_K=3 does not give every split an even number"),
    (_regs(64, 64, 1, 4, 3), "kernel='gluon_overlap_regs' needs BLOCK_N = 16 \\* num_warps"),
])
def test_bad_gluon_config(cfg, match, device):
    layer = _layer(1024, 128, 128, F16, False, device)  # 4 K steps: 3 splits of 2 leave one empty
    x = torch.randn(16, 1024, device=device).to(F16)
    with pytest.raises(ValueError, match=match):
        _launch(layer, x, cfg)


def test_gluon_ring_fits_shared_memory():
    """The shared-memory check counts the words' ring only where the kernel has one: the regs
    kernel's 6- and 7-step x rings fit (192 / 224 KiB), the same rings with the words do not."""
    ops16._check_gluon_config(_regs(64, 128, 2, 8, 7), 1024)
    with pytest.raises(ValueError, match="needs 294912 bytes"):
        ops16._check_gluon_config(_overlap(64, 128, 2, 8, 6), 1024)


def test_gluon_split_ok():
    """gluon_split_ok against counting the steps of every split as the kernel does."""
    for steps in range(1, 40):
        for split in range(1, 12):
            per = -(-steps // split)
            sizes = [min(per, steps - k * per) for k in range(split)]
            assert gluon_split_ok(split, steps) == (split <= steps and min(sizes) >= 1), (steps, split)


def test_gluon_overlap_split_ok():
    """gluon_overlap_split_ok against counting the steps of every split: all even, >= 2."""
    for steps in range(1, 40):
        for split in range(1, 12):
            per = -(-steps // split)
            sizes = [min(per, steps - k * per) for k in range(split)]
            expect = split <= steps and min(sizes) >= 2 and all(v % 2 == 0 for v in sizes)
            assert gluon_overlap_split_ok(split, steps) == expect, (steps, split)


def test_experimental_candidates_are_valid(monkeypatch):
    """The offline tuner's --experimental tiles (the GEMV's cp.async ring, the overlap kernels
    outside M = 9-128) pass the launcher's checks for every M bucket and format they are offered
    for; the runtime candidate list (the autotuner, which does not check outputs) holds none of
    them, and holds both overlap kernels' tiles at M = 9-128 only (measured there, perf_log v26)."""
    monkeypatch.setattr(ops16, "gluon_device", lambda index: True)
    monkeypatch.setattr(ops16, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    kinds, overlap_ms, overlap_kernels = set(), set(), set()
    for kp, n in [(4096, 6144), (14336, 4096), (28672, 8192), (8192, 57344), (1536, 128)]:
        for m in (1, 2, 4, 8, 9, 16, 32, 64, 128):
            for gs, zeros in ((128, False), (-1, True), (256, True)):
                problem = dict(device=dev, M=m, N=n, Kp=kp, group_size=gs, general_gidx=False, has_zeros=zeros)
                extra = list(ops16.experimental_candidates(**problem))
                for cfg in extra:
                    ops16.check_w4a16_config(cfg, kp, m, gs)
                    kinds.add((cfg.kernel, cfg.num_stages >= 3))
                regular = set(ops16.w4a16_candidates(**problem))
                assert not regular & set(extra), (m, kp, n)
                assert not any(c.kernel == "gemv" and c.num_stages >= 3 for c in regular)
                for c in regular:
                    ops16.check_w4a16_config(c, kp, m, gs)
                    if c.kernel in ops16.OVERLAP_KERNELS:
                        overlap_ms.add(m)
                        overlap_kernels.add(c.kernel)
                assert all(c.kernel not in ops16.OVERLAP_KERNELS or m <= 8 for c in extra)
    assert kinds == {("gemv", True), ("gluon_overlap", True), ("gluon_overlap_regs", True)}
    assert overlap_ms == {9, 16, 32, 64, 128} and overlap_kernels == set(ops16.OVERLAP_KERNELS)
    from sailfish.bench.tune import main
    if not torch.cuda.is_available():
        assert main(["--experimental", "--m", "1"]) == 2  # (parses; tuning needs a GPU)
        assert main(["--kernels", "gluon_overlap,mma", "--show", "3"]) == 2
    for bad in (["--experimental", "--family", "w4a8"],  # no W4A8 tiles of that kind
                ["--kernels", "gluon_overlapp"], ["--show", "-1"]):
        with pytest.raises(SystemExit):
            main(bad)


def test_wgmma_register_hazard_counts_groups():
    """tools.ptx.wgmma_register_hazard on hand-written SASS: a wait 'DEPBAR.LE gsb0, N' leaves
    the last N wgmma groups (each closed by the gsb0 of its last HGMMA) in flight, so writing
    their A registers is a hazard and writing a retired group's is not; the back edge counts."""
    from sailfish.tools.ptx import wgmma_register_hazard

    def sass(*lines):
        body = ["/*0000*/ NOP ;"] + [f"/*{16 * (i + 1):04x}*/ {t} ;" for i, t in enumerate(lines)]
        return "\n".join(body + [f"/*{16 * (len(lines) + 1):04x}*/ BRA 0x0 ;"])

    grp = lambda a, b: ["WARPGROUP.ARRIVE", f"HGMMA.64x16x16.F32 R100, R{a}, gdesc[UR4], R100",  # noqa: E731
                        f"HGMMA.64x16x16.F32 R100, R{b}, gdesc[UR4], R100, gsb0"]
    # two groups in flight; the wait leaves 1: the first's registers are free, the second's not
    assert not wgmma_register_hazard(sass(*grp(24, 28), *grp(32, 36), "WARPGROUP.DEPBAR.LE gsb0, 0x1",
                                          "LOP3.LUT R24, R1, 0xf, R2, 0xea, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert wgmma_register_hazard(sass(*grp(24, 28), *grp(32, 36), "WARPGROUP.DEPBAR.LE gsb0, 0x1",
                                      "LOP3.LUT R33, R1, 0xf, R2, 0xea, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    # a group left in flight across the back edge: the next iteration's write at the top
    assert wgmma_register_hazard(sass("LOP3.LUT R26, R1, 0xf, R2, 0xea, !PT", *grp(24, 28)))
    assert not wgmma_register_hazard(sass("LOP3.LUT R26, R1, 0xf, R2, 0xea, !PT", *grp(24, 28),
                                          "WARPGROUP.DEPBAR.LE gsb0, 0x0"))


def test_gluon_candidates_are_valid(monkeypatch):
    """The tuner's Gluon tiles pass the launcher's checks, and none is offered where the
    kernel cannot run (a general g_idx, group 64, M = 1); M <= 8 gets BLOCK_M 8, M = 33-64
    'gluon_pipe' BLOCK_M 64 beside the others, M = 65-128 the overlap kernels (two BLOCK_M 64 tiles
    per N tile) and 'gluon_pipe' BLOCK_M 128, M > 128 only 'gluon_pipe' BLOCK_M 128."""
    monkeypatch.setattr(ops16, "gluon_device", lambda index: True)
    monkeypatch.setattr(ops16, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    seen = 0
    kernels_at = {}
    for kp, n in [(4096, 6144), (14336, 4096), (28672, 8192), (8192, 57344), (1024, 128)]:
        for m in (2, 4, 8, 16, 32, 64, 128, 129, 512, 4096):
            for cfg in ops16._gluon_candidates(device=dev, M=m, N=n, Kp=kp, group_size=128, general_gidx=False,
                                               has_zeros=False):
                ops16.check_w4a16_config(cfg, kp, m, 128)
                assert (cfg.BLOCK_M == 8) == (m <= 8), (m, cfg)
                if 64 < m <= 128:
                    assert cfg.kernel in ops16.OVERLAP_KERNELS or (cfg.kernel, cfg.BLOCK_M) == ("gluon_pipe", 128)
                elif cfg.kernel == "gluon_pipe" and m <= 64:
                    assert cfg.BLOCK_M == 64 and 32 < m, (m, cfg)
                else:
                    assert (cfg.BLOCK_M == 128 and cfg.kernel == "gluon_pipe") == (m > 128), (m, cfg)
                kernels_at.setdefault(m, set()).add(cfg.kernel)
                seen += 1
    assert seen > 0
    assert kernels_at[128] == {"gluon_pipe", *ops16.OVERLAP_KERNELS}, kernels_at[128]
    assert kernels_at[64] >= {"gluon_pipe", *ops16.OVERLAP_KERNELS}, kernels_at[64]
    assert "gluon_pipe" not in kernels_at[32], kernels_at[32]
    base = dict(device=dev, N=4096, Kp=4096)
    assert list(ops16._gluon_candidates(**base, M=16, group_size=128, general_gidx=False, has_zeros=True))
    for kw in (dict(M=16, group_size=128, general_gidx=True, has_zeros=False),
               dict(M=16, group_size=64, general_gidx=False, has_zeros=False),
               dict(M=1, group_size=-1, general_gidx=False, has_zeros=False)):
        assert not list(ops16._gluon_candidates(**base, **kw)), kw
    monkeypatch.setattr(ops16, "gluon_device", lambda index: False)
    assert not list(ops16._gluon_candidates(**base, M=16, group_size=128, general_gidx=False, has_zeros=False))


_GLUON_CHILD = r"""
import re
import triton
from sailfish.tools.ptx import (k_loop_stats, ptxas_report, sass, sass_loop, shipped_mma_configs,
                                wgmma_register_hazard)
from sailfish.kernels.w4a16_gluon import compile_sm90, max_registers
cases = [dict(group_size=128), dict(group_size=-1, has_bias=True), dict(group_size=256, dtype="bf16", SPLIT_K=2),
         dict(group_size=128, has_zeros=True, dtype="bf16"), dict(group_size=-1, has_zeros=True),
         dict(BLOCK_M=32, group_size=128, STAGES=4), dict(BLOCK_M=64, group_size=-1),
         dict(BLOCK_N=128, group_size=128, SPLIT_K=3), dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, SPLIT_K=2),
         dict(BLOCK_N=128, num_warps=8, group_size=-1), dict(BLOCK_M=8, group_size=128),
         dict(BLOCK_M=8, group_size=128, has_zeros=True), dict(BLOCK_M=8, group_size=-1, dtype="bf16", STAGES=4)]
# every Gluon tile of the shipped tables, as fp16 g128 and as bf16 g128 with zero points
for _, c in shipped_mma_configs("gluon"):
    tile = dict(BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, STAGES=c.num_stages, SPLIT_K=c.SPLIT_K, num_warps=c.num_warps,
                pdl_early=c.SPLIT_K > 1)
    cases += [dict(tile), dict(tile, dtype="bf16", has_zeros=True), dict(tile, has_zeros=True)]
assert len(cases) > 12, "no Gluon tile in the shipped tables"
bad = []
for kw in cases:
    k = compile_sm90(**kw)
    st = k_loop_stats(k.asm["ptx"])
    rep = ptxas_report(k.asm["ptx"])
    waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", k.asm["ptx"])
    why = []
    if st is None or st.st_shared or st.ldmatrix or not st.wgmma_a_in_registers:
        why.append(f"K loop {st}")
    if set(waits) != {"0"}:
        why.append(f"waits {waits}")
    if "serialized" in rep:
        why.append("ptxas serializes the wgmmas: " + rep[rep.index("serialized") - 80:][:300])
    if wgmma_register_hazard(sass(k.asm["cubin"])):
        why.append("wgmma register hazard")
    # with zero points the launcher caps the registers at what keeps the CTAs shared memory
    # allows (kernels/w4a16_gluon.max_registers): held, and nothing spilled
    cap = max_registers(kw.get("BLOCK_M", 16), kw.get("BLOCK_N", 64), kw.get("STAGES", 3), kw.get("num_warps", 4),
                        kw.get("has_zeros", False))
    used = re.search(r"Used (\d+) registers", rep)
    if cap and (f".maxnreg {cap}" not in k.asm["ptx"] or not used or int(used.group(1)) > cap):
        why.append(f"register cap {cap} not applied: {used and used.group(0)}")
    # no local-memory traffic in the K loop (Triton 3.6 spills one register of the capped split-K
    # tiles, stored and loaded once per program outside the loop)
    loop = sass_loop(sass(k.asm["cubin"]), "HGMMA", 1)
    if loop is None or loop.ops.get("LDL") or loop.ops.get("STL"):
        why.append("local memory in the K loop: " + rep[-300:])
    if why:
        bad.append((kw, why))
assert not bad, bad
# split-K under PDL: the GEMM releases the reduce once, at its start; off: nothing emitted
ptx = compile_sm90(SPLIT_K=2, pdl_early=True).asm["ptx"]
assert ptx.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in ptx
assert "griddepcontrol" not in compile_sm90(SPLIT_K=2).asm["ptx"]
# the CLI's report of the same (python -m sailfish.bench.ptx --gluon)
from sailfish.bench.ptx import main
assert main(["--gluon", "--hazard", "--config", "16,64,256,3,4,3", "--zeros", "--dtype", "bf16"]) == 0
print("checked", triton.__version__, len(cases))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_gluon_kernel_compiles_for_sm90(tmp_path):
    """The kernel's point, checked on the compiler's output for sm_90a, for a format matrix
    and every Gluon tile of the shipped tables: in the K loop no shared-memory store or
    ldmatrix (the dequantized tile goes to wgmma from registers), A in registers, only
    wait(0) (both chunks' wgmmas in flight together), ptxas keeps them asynchronous (no C7514
    serialization), the SASS has no wgmma register hazard (tools/ptx.py) and no local memory
    access in the K loop, and tiles with zero points hold their register cap; with PDL the split-K GEMM releases its
    reduce. In a child process: the interpreter in this one patches the frontend."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    run_compile_child(_GLUON_CHILD, tmp_path)




_GLUON_OVERLAP_CHILD = r"""
import re
import triton
from sailfish.tools.ptx import k_loop_stats, overlap_loop_ok, ptxas_report, sass, wgmma_loop
from sailfish.kernels.w4a16_gluon import compile_sm90
cases = [dict(), dict(BLOCK_M=8), dict(BLOCK_M=32, STAGES=4), dict(BLOCK_M=64, BLOCK_N=128, num_warps=8),
         dict(group_size=-1, has_bias=True),
         dict(dtype="bf16", has_zeros=True), dict(dtype="bf16", has_zeros=True, paired=True),
         dict(has_zeros=True, SPLIT_K=2, pdl_early=True, paired=True),
         dict(BLOCK_M=32, group_size=-1, dtype="bf16", has_zeros=True, SPLIT_K=3),
         dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, group_size=256, dtype="bf16", has_zeros=True, STAGES=4),
         dict(BLOCK_M=16, BLOCK_N=128, num_warps=8),
         # the words straight into registers ('gluon_overlap_regs')
         dict(words_in_regs=True), dict(BLOCK_M=8, group_size=-1, words_in_regs=True),
         dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, dtype="bf16", has_zeros=True, SPLIT_K=2, pdl_early=True,
              STAGES=4, words_in_regs=True), dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, dtype="bf16", has_zeros=True,
                                                  SPLIT_K=2, STAGES=3, words_in_regs=True, paired=True),
         # split-K summed in the kernel by the tile's last slice (FIXUP: eager calls)
         dict(SPLIT_K=4, STAGES=4, has_bias=True, fixup=True),
         dict(BLOCK_M=32, dtype="bf16", has_zeros=True, SPLIT_K=2, words_in_regs=True, paired=True, fixup=True)]
bad = []
for kw in cases:
    k = compile_sm90(overlap=True, **kw)
    if kw.get("fixup"):  # the counter's acq_rel add and the relaxed reset, nothing else atomic
        atoms = re.findall(r"atom\.global\.?(\S*)", k.asm["ptx"])
        if sorted(atoms) != ["gpu.acq_rel.add.u32", "gpu.relaxed.exch.b32"]:
            bad.append((kw, f"atomics {atoms}"))
    if kw.get("words_in_regs"):  # the ring holds x only: 2 chunks of (BLOCK_M, 128) 2-byte values a step
        ring = 2 * kw.get("STAGES", 3) * kw.get("BLOCK_M", 16) * 128 * 2
        if k.metadata.shared != ring:
            bad.append((kw, f"shared memory {k.metadata.shared}, the x ring is {ring}"))
    st = k_loop_stats(k.asm["ptx"])
    rep = ptxas_report(k.asm["ptx"])
    text = sass(k.asm["cubin"])
    body = wgmma_loop(text) or []
    why = []
    if st is None or st.st_shared or st.ldmatrix or not st.wgmma_a_in_registers:
        why.append(f"K loop {st}")
    # two K steps per iteration (2 x 16 wgmmas), each step's A operands in registers of its own,
    # one wait per step that leaves the other step's two wgmma groups in flight
    ok, summary = overlap_loop_ok(text)
    if not ok:
        why.append(summary)
    why += loop_problems(rep, text, body)
    if why:
        bad.append((kw, why))
assert not bad, bad
# the CLI's report of the same (python -m sailfish.bench.ptx --gluon --overlap)
from sailfish.bench.ptx import main
assert main(["--gluon", "--overlap", "--hazard", "--config", "16,64,256,2,4,3", "--zeros"]) == 0
print("checked", triton.__version__, len(cases))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_gluon_overlap_kernel_compiles_for_sm90(tmp_path):
    """What 'gluon_overlap' exists for, on the compiler's output for sm_90a (a format matrix):
    the loop's 32 wgmmas (two K steps) read 32 different A register quads and each step waits
    with the other step's two wgmma groups outstanding (WARPGROUP.DEPBAR.LE gsb0, 0x2), so the
    dequantization of one step runs while the previous step's wgmmas do; ptxas does not
    serialize them, nothing spills, no wgmma register hazard, no shared-memory trip of the
    weights. (Written as one step per iteration, ptxas put both steps' operands in the same
    registers and hoisted each wait above the dequantization: kernels/w4a16_gluon.py.)"""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    run_compile_child(_GLUON_OVERLAP_CHILD.replace("bad = []", LOOP_PROBLEMS + "bad = []", 1), tmp_path)


def test_heuristic_takes_gluon_for_large_weights_at_m16(monkeypatch):
    """Without a table entry, M = 2..16 on an sm_90 GPU with Gluon takes the Gluon tile (BLOCK_M
    8 up to M = 8) for weights of >= 4096 x 8192 (where the tuner chose it on every such Llama
    shape), with a split that fills the SMs about 3 times; smaller weights, other M and a
    general g_idx keep the Triton tiles; every choice passes the launcher's checks."""
    monkeypatch.setattr(ops16, "gluon_device", lambda index: True)
    monkeypatch.setattr(ops16, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)

    def pick(m, n, kp, gs=128, gidx=False):
        cfg = ops16.w4a16_heuristic(device=dev, M=m, N=n, Kp=kp, group_size=gs, general_gidx=gidx)
        ops16.check_w4a16_config(cfg, kp, m, gs, gidx)
        return cfg

    for (kp, n), split in {(8192, 57344): 1, (8192, 8192): 3, (8192, 10240): 3, (14336, 4096): 6}.items():
        cfg = pick(16, n, kp)
        assert (cfg.kernel, cfg.BLOCK_M, cfg.BLOCK_N, cfg.SPLIT_K) == ("gluon", 16, 64, split), (kp, n, cfg)
    assert pick(12, 8192, 8192, gs=-1).kernel == "gluon"
    assert (pick(8, 8192, 57344).kernel, pick(5, 8192, 8192).SPLIT_K) == ("gluon", 3)
    assert (pick(2, 8192, 57344).BLOCK_M, pick(8, 8192, 8192).BLOCK_M, pick(9, 8192, 8192).BLOCK_M) == (8, 8, 16)
    assert pick(1, 8192, 57344).kernel == "gemv"  # M = 1: the tensor-core GEMV
    assert pick(16, 4096, 4096).kernel == "mma"
    assert pick(32, 8192, 8192).kernel == "mma"
    assert pick(16, 8192, 8192, gs=64).kernel == "mma"
    assert pick(16, 8192, 8192, gidx=True).kernel == "mma"
    monkeypatch.setattr(ops16, "gluon_device", lambda index: False)
    assert pick(16, 8192, 8192).kernel == "mma"


def test_heuristic_takes_the_pipe_tile_at_m65_to_1023(monkeypatch):
    """Without a table entry, 64 < M < 1024 on an sm_90 GPU with Gluon takes the 'gluon_pipe'
    BLOCK_M 128 tile, split by the smallest of 1 / 2 / 4 whose programs (one per SM) fill at least
    half of their last wave; M >= 1024 stays dequantize + cuBLAS, M <= 64 and the formats or GPUs
    the Gluon kernel does not take keep the Triton tiles; every choice passes the launcher's checks."""
    monkeypatch.setattr(ops16, "gluon_device", lambda index: True)
    monkeypatch.setattr(ops16, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)

    def pick(m, n, kp, gs=128, gidx=False, zeros=False):
        cfg = ops16.w4a16_heuristic(device=dev, M=m, N=n, Kp=kp, group_size=gs, general_gidx=gidx,
                                     has_zeros=zeros)
        ops16.check_w4a16_config(cfg, kp, m, gs, gidx)
        return cfg

    # (K, N, M) -> split: 56 tiles fill 0.42 of a wave unsplit, 0.85 at split 2; 28 tiles need 4;
    # 148 tiles fill 0.56 of their second wave unsplit; 40 tiles 0.61 of a wave at split 2
    for (kp, n, m), split in {(18944, 3584, 256): 2, (18944, 3584, 128): 4, (3584, 18944, 128): 1,
                              (8192, 57344, 512): 1, (5120, 5120, 65): 2}.items():
        cfg = pick(m, n, kp)
        assert (cfg.kernel, cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages, cfg.SPLIT_K) == (
            "gluon_pipe", 128, 128, 8, 3, split), (kp, n, m, cfg)
    assert pick(512, 8192, 8192, gs=-1, zeros=True).kernel == "gluon_pipe"
    assert pick(1023, 8192, 8192, gs=256).kernel == "gluon_pipe"
    assert pick(1024, 8192, 8192).kernel == "dequant"
    assert pick(64, 8192, 8192).kernel == "mma"
    assert pick(256, 8192, 8192, gs=64).kernel == "mma"
    assert pick(256, 8192, 8192, gidx=True).kernel == "mma"
    assert pick(256, 8192, 4224).kernel == "mma"  # K not a multiple of the 256-channel step
    monkeypatch.setattr(ops16, "gluon_device", lambda index: False)
    assert pick(256, 8192, 8192).kernel == "mma"


def test_gluon_compile_failure_falls_back_to_the_twin(monkeypatch, device):
    """A Triton whose Gluon does not compile the kernel (an API change past the tested 3.6-3.9)
    gives a warning and the twin's result, and the Gluon kernel is not tried again; other
    errors are raised."""
    import sailfish.kernels.w4a16_gluon as gk

    monkeypatch.setattr(gk, "w4a16_gluon_kernel", StandInKernel(incompatible_gluon()))
    monkeypatch.setattr(FLAGS, "gluon", True)
    monkeypatch.setattr(ops16, "gluon_applies", lambda *a: FLAGS.gluon)
    layer = _layer(1024, 192, 128, F16, True, device)
    x = torch.randn(16, 1024, device=device).to(F16)
    cfg = Config(16, 64, 256, 2, 8, 4, 3, kernel="gluon")
    with pytest.warns(RuntimeWarning, match="Gluon W4A16 kernel does not compile"):
        y = _launch(layer, x, cfg)
    assert not FLAGS.gluon
    assert torch.equal(y, _launch(layer, x, gluon_twin(cfg)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        assert torch.equal(_launch(layer, x, cfg), y)

    monkeypatch.setattr(gk, "w4a16_gluon_kernel", StandInKernel(RuntimeError("a launch error")))
    monkeypatch.setattr(FLAGS, "gluon", True)
    with pytest.raises(RuntimeError, match="a launch error"):
        _launch(layer, x, cfg)


_GLUON_PIPE_CHILD = r"""
import re
import triton
from sailfish.tools.ptx import shipped_mma_configs
from sailfish.kernels.gluon_common import pipe_shared_bytes
from sailfish.kernels.w4a16_gluon import compile_sm90
cases = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, dtype="bf16",
                                                           has_zeros=True, SPLIT_K=2, pdl_early=True),
         dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, group_size=-1, has_bias=True),
         dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, group_size=256, STAGES=4)]
for _, c in shipped_mma_configs("gluon_pipe"):
    tile = dict(BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, STAGES=c.num_stages, SPLIT_K=c.SPLIT_K, num_warps=c.num_warps,
                pdl_early=c.SPLIT_K > 1)
    cases += [dict(tile), dict(tile, dtype="bf16", has_zeros=True)]
bad = []
for kw in cases:
    k = compile_sm90(pipe=True, **kw)
    # the rings and their mbarriers as the launcher counts them (plus what Triton adds, < 1 KiB)
    why, _ = pipe_problems(k, pipe_shared_bytes(kw.get("BLOCK_M", 16), kw.get("STAGES", 3)))
    if why:
        bad.append((kw, why))
assert not bad, bad
# the CLI's report of the same (python -m sailfish.bench.ptx --gluon --pipe)
from sailfish.bench.ptx import main
assert main(["--gluon", "--pipe", "--hazard", "--config", "128,128,256,2,8,3", "--zeros", "--dtype", "bf16"]) == 0
print("checked", triton.__version__, len(cases))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for machines without a GPU")
def test_gluon_pipe_kernel_compiles_for_sm90(tmp_path):
    """'gluon_pipe' on the compiler's output for sm_90a (a format matrix and the shipped tiles):
    A in registers, no shared-memory trip of the weights, waits 1 (a chunk left in flight) and
    0, no serialization, no spill, no wgmma register hazard, and the x rings' shared memory as
    the launcher's check counts it."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    run_compile_child(_GLUON_PIPE_CHILD.replace("bad = []", PIPE_PROBLEMS + "bad = []", 1), tmp_path)
