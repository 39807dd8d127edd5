"""Launchers and torch.library ops, one module per kernel family (w4a16, w4a8, moe; rowwise: the
RMSNorm / SiLU-and-multiply row ops; attention: decode attention; router: the MoE router's (linear +) softmax + top-k; autograd adds the input-gradient formulas). Importing the
package registers the sailfish::* ops. This module only re-exports; the machinery lives in
sailfish.runtime."""
from ..runtime.device import check_devices, device_of, interpreter_enabled, use_triton
from ..runtime.dispatch import LIB, define_op, direct_call_ok, plain_context
from ..runtime.flags import batch_invariant, batch_invariant_mode, set_batch_invariant
# (sailfish::w4a16_gemm, w4a8 ops, w4a8_linear, moe_w4a16, rms_norm / silu_mul and their _quant forms,
# decode_attention, router_topk, router_linear_topk)
from . import w4a16, w4a8, autograd, moe, rowwise, attention, router  # noqa: F401,E401

__all__ = ["LIB", "autograd", "batch_invariant", "batch_invariant_mode", "check_devices", "define_op", "device_of",
           "direct_call_ok", "interpreter_enabled", "plain_context", "set_batch_invariant", "use_triton", "w4a16",
           "w4a8", "moe", "rowwise", "attention", "router"]
