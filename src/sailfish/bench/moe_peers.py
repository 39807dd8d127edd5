"""Peer kernels for the MoE benchmark (bench/moe.py), run from an uncommitted folder.

vllm-triton-moe: vLLM's Triton W4A16 MoE GEMM (fused_moe_kernel_gptq_awq, the moe_wna16 Triton
path; Apache-2.0), read from <peers>/vllm_moe_wna16.py (--peers DIR, default .peers at the repo
root). Sailfish ships no vLLM code: without that file the column is skipped with one line.

The file must define `fused_moe_kernel_gptq_awq` with vLLM's signature. This module does what
vLLM's fused_experts_impl does around it, in its own code:
- weights: the same 4-bit codes and scales as the Sailfish experts (PackedExperts.unstack), re-
  packed as the kernel reads them: uint8 (E, N, K / 2), two codes a byte along K (low nibble the
  even k), scales (E, N, K / group_size); symmetric (the kernel's zero point 8). Both sides then
  multiply x by the same effective weights, s * (q - 8) rounded once to the 16-bit dtype.
- routing: slots (token * topk + k) sorted by expert, each expert's run padded to BLOCK_SIZE_M
  with the sentinel T = M * topk, one expert id per block (-1 past the last used block) --
  vLLM's moe_align_block_size layout. On a GPU Sailfish's Router makes it (two small Triton
  launches, as vLLM's one CUDA kernel; its output equals ops.moe.align_routing's bit for bit);
  elsewhere align_routing (PyTorch). num_tokens_post_padded is the whole padded length: the
  blocks of expert -1 hold only sentinels, so the kernel writes nothing there.
- gate_up launch (output (T, 2I)); silu(gate) * up by sailfish::silu_mul, one launch with the
  roundings of vLLM's silu_and_mul (silu in fp32 rounded to the 16-bit dtype, times up, rounded);
  down launch with MUL_ROUTED_WEIGHT (the routing weights applied in the down GEMM, as vLLM's
  default), the sum over top-k (vLLM's moe_sum) in PyTorch.
- config: vLLM's default for int4_w4a16 on its Triton path (get_default_config +
  get_moe_wna16_block_config): BLOCK_SIZE_M 16 / 32 / 64 for M <= 20 / <= 40 / above,
  GROUP_SIZE_M 1, (BLOCK_SIZE_N, BLOCK_SIZE_K) = (32, 64) where the launch's A has one row, else
  (64, 32); num_warps / num_stages unset (Triton's defaults). vLLM itself sends launches with
  T / E <= 6 (and group size 32-128) to its CUDA moe_wna16 kernel instead: this peer is the
  Triton kernel at every M. vLLM ships no tuned int4_w4a16 tables for these shapes on H100.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch

KERNEL = "vllm-triton-moe"
PEER_FILE = "vllm_moe_wna16.py"


def default_peers_dir() -> str:
    """.peers at the root of the checkout this module runs from (src/sailfish/bench/../../..)."""
    return str(Path(__file__).resolve().parents[3] / ".peers")


def load_vllm(peers_dir: Optional[str], cuda: bool, dtype: torch.dtype,
              group_size: int) -> Tuple[Optional[object], str]:
    """(the peer module, "") or (None, the reason it is skipped: one line)."""
    path = Path(peers_dir or default_peers_dir()) / PEER_FILE
    if not path.is_file():
        return None, (f"{KERNEL}: skipped, no {path} (vLLM's fused_moe_kernel_gptq_awq is not shipped with "
                      "Sailfish; put it there or pass --peers DIR)")
    if group_size == -1:
        return None, f"{KERNEL}: skipped, group_size -1 (the peer takes groups along K only)"
    if not cuda and dtype == torch.bfloat16:
        # (Sailfish's kernels emulate bf16 there, kernels/common.py; the peer cannot)
        return None, (f"{KERNEL}: skipped, bf16 on the CPU: Triton's interpreter computes bf16 on raw bits; "
                      "use --dtype fp16")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        # A CPU run of the peer is Triton's interpreter, which Triton reads when a kernel is
        # defined: set for the rest of the process (Sailfish's kernels, defined on their first
        # use, then run in it too), unless they were already defined compiled.
        if any(m.startswith("sailfish.kernels") for m in sys.modules):
            return None, (f"{KERNEL}: skipped, a CPU run needs TRITON_INTERPRET=1 in the environment "
                          "(Sailfish's kernels were already defined without it)")
        os.environ["TRITON_INTERPRET"] = "1"
    spec = importlib.util.spec_from_file_location("sailfish_peer_vllm_moe_wna16", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "fused_moe_kernel_gptq_awq"):
        return None, f"{KERNEL}: skipped, {path} defines no fused_moe_kernel_gptq_awq"
    return mod, ""


def repack_experts(packed) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sailfish stacked experts (PackedExperts (E, N, K)) -> (B uint8 (E, N, K / 2), B_scale
    (E, N, G)) in the layout fused_moe_kernel_gptq_awq reads, from the same codes and scales."""
    if not packed.sym:
        raise ValueError("experts with zero points are not supported by the vllm-triton-moe adapter; "
                         "allowed: symmetric experts (zeros None)")
    if packed.perm is not None:
        raise ValueError("act-order experts (perm) are not supported by the vllm-triton-moe adapter; "
                         "allowed: perm None")
    if packed.group_size == -1 or packed.in_features % 2:
        raise ValueError(f"group_size={packed.group_size}, K={packed.in_features}: the vllm-triton-moe adapter "
                         "needs a group size of 32-256 and an even K")
    qs = packed.unstack()
    codes = torch.stack([q.qweight for q in qs])  # uint8 (E, N, K), 0..15
    b = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    scales = torch.stack([q.scales.T for q in qs]).contiguous()  # (E, N, G)
    return b, scales


def vllm_config(M: int, rows: int) -> dict:
    """vLLM's default int4_w4a16 config for its Triton path (module docstring); rows: the
    launch's A rows (M for gate_up, M * topk for down)."""
    bm = 16 if M <= 20 else 32 if M <= 40 else 64
    bn, bk = (32, 64) if rows == 1 else (64, 32)
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1, SPLIT_K=1)


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _gemm(mod, A, B, C, scales, tw, sorted_slots, block_expert, post_padded, top_k, mul_weight, cfg, group_size):
    """One launch of fused_moe_kernel_gptq_awq, arguments as vLLM's invoke_fused_moe_kernel
    passes them (C viewed (A rows, top_k, N))."""
    T = A.shape[0] * top_k
    EM = sorted_slots.numel()
    if A.shape[0] < cfg["BLOCK_SIZE_M"]:  # vLLM's small-batch cut of the grid
        EM = min(EM, T * cfg["BLOCK_SIZE_M"])
    N = B.shape[1]
    grid = (-(-EM // cfg["BLOCK_SIZE_M"]) * -(-N // cfg["BLOCK_SIZE_N"]),)
    mod.fused_moe_kernel_gptq_awq[grid](
        A, B, C, scales, None, tw, sorted_slots, block_expert, post_padded,
        N, A.shape[1], EM, T,
        A.stride(0), A.stride(1), B.stride(0), B.stride(2), B.stride(1), C.stride(1), C.stride(2),
        scales.stride(0), scales.stride(2), scales.stride(1), 0, 0, 0,
        block_k_diviable=A.shape[1] % cfg["BLOCK_SIZE_K"] == 0, group_size=group_size,
        MUL_ROUTED_WEIGHT=mul_weight, top_k=top_k, compute_type=_tl_dtype(A.dtype), has_zp=False,
        use_int4_w4a16=True, use_int8_w8a16=False, **cfg)


class VllmExperts:
    """One copy of a model's routed experts for the peer kernel: the Sailfish experts (w13
    PackedExperts (E, 2I, H), w2 (E, H, I)) re-packed once; block_fn(M, topk) gives the block."""

    def __init__(self, mod, q13, q2):
        E, H, I = q13.num_experts, q13.in_features, q2.in_features
        if q13.out_features != 2 * I or q2.out_features != H or q2.group_size != q13.group_size:
            raise ValueError(f"w13 (E, {q13.out_features}, {H}) and w2 (E, {q2.out_features}, {I}) are not one "
                             "gate_up / down pair; allowed: w13 (E, 2I, H), w2 (E, H, I), one group size")
        self.mod, self.E, self.H, self.I, self.group_size = mod, E, H, I, q13.group_size
        self.b13, self.s13 = repack_experts(q13)
        self.b2, self.s2 = repack_experts(q2)

    def block_fn(self, M: int, topk: int) -> Callable:
        """run(x (M, H), topk_ids (M, topk), topk_weights float32 (M, topk)) -> y (M, H), the
        routed experts; the routing's fixed-size buffers made here, once."""
        from ..ops.moe import Router, align_routing, max_blocks
        from ..ops.rowwise import silu_mul

        E, H, I, gs, mod = self.E, self.H, self.I, self.group_size, self.mod
        dev = self.b13.device
        cfg13, cfg2 = vllm_config(M, M), vllm_config(M, M * topk)
        bm = cfg13["BLOCK_SIZE_M"]
        T = M * topk
        router = Router(E, bm, dev.index or 0) if dev.type == "cuda" else None
        post_padded = torch.full((1,), max_blocks(T, E, bm) * bm, dtype=torch.int32, device=dev)

        def run(x, ids, w):
            sorted_slots, block_expert = router(ids) if router is not None else align_routing(ids, E, bm)
            gu = torch.empty((M, topk, 2 * I), dtype=x.dtype, device=x.device)
            _gemm(mod, x, self.b13, gu, self.s13, w, sorted_slots, block_expert, post_padded, topk, False, cfg13, gs)
            h = silu_mul(gu.view(T, 2 * I))
            rows = torch.empty((M, topk, H), dtype=x.dtype, device=x.device)
            _gemm(mod, h, self.b2, rows, self.s2, w, sorted_slots, block_expert, post_padded, 1, True, cfg2, gs)
            return rows.sum(1)
        return run
