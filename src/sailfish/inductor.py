"""A torch.compile (inductor) graph pass: a residual add folded into the W4A8 norm that follows it.

In a fused W4A8 decoder layer (fuse.py: DeferredRMSNorm) the norm of each W4A8 input runs as one
opaque op with its per-token quantization, sailfish::rms_norm_quant. Its input is the residual
sum `residual + out` (of the attention, mid-layer; of the MLP, for the next layer's input norm),
which inductor cannot fuse into an opaque op: every such add is a launch of its own, two a layer
(~1.8 us each in a CUDA-graph decode step on an H100, docs/perf_log.md v50), where W4A16's
plain-torch norms take the add into inductor's norm kernel. `fold_residual_adds` rewrites

    h = aten.add(a, b)   ->  view(h) (2-D)  ->  sailfish::rms_norm_quant(view, w, eps)

into one sailfish::add_rms_norm_quant(a, b, w, eps) (ops/rowwise.py), whose first output replaces
h everywhere else (the residual stream reads it) and whose codes and scales replace the norm's:
the same numbers (the kernel's sum is torch's rounded half-precision add, and its norm and
quantization rowwise_kernel's bit for bit, tests/test_inductor.py).

`install()` (called by fuse.fuse_row_ops when it defers a norm into a W4A8 input) puts the pass in
torch._inductor.config.post_grad_custom_post_pass, after a pass already there; it touches nothing
in a graph without the pattern.
"""
from __future__ import annotations

import hashlib
import operator
from typing import Optional

import torch

_PASS: Optional["FoldResidualAdds"] = None


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def fold_residual_adds(graph: torch.fx.Graph) -> int:
    """Rewrite graph in place (see the module docstring); returns how many norms took their add."""
    from .ops.rowwise import add_rms_norm_quant, add_rms_norm_quant_fp8, rms_norm_quant, rms_norm_quant_fp8

    aten = torch.ops.aten
    fused_of = {rms_norm_quant: add_rms_norm_quant, rms_norm_quant_fp8: add_rms_norm_quant_fp8}
    views = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
    done = 0
    for node in list(graph.nodes):
        fused_op = fused_of.get(node.target) if node.op == "call_function" else None
        if fused_op is None or node.kwargs or len(node.args) != 3:
            continue
        src, weight, eps = node.args
        if isinstance(src, torch.fx.Node) and src.target in views:
            src = src.args[0]
        if not (isinstance(src, torch.fx.Node) and src.target is aten.add.Tensor and len(src.args) == 2
                and not src.kwargs):
            continue
        a, b = src.args
        h, va, vb = _val(src), _val(a), _val(b)
        if not (isinstance(h, torch.Tensor) and isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
                and va.shape == vb.shape == h.shape and va.dtype == vb.dtype == h.dtype
                and h.shape[-1] == _val(node.args[0]).shape[-1]):
            continue  # (a broadcast or promoting add: not the residual stream)
        with graph.inserting_after(src):
            fused = graph.call_function(fused_op, (a, b, weight, eps))
        with graph.inserting_after(fused):
            outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(3)]
        fused.meta["val"] = fused_op(va, vb, _val(weight), eps)
        for i, out in enumerate(outs):
            out.meta["val"] = fused.meta["val"][i]
        src.replace_all_uses_with(outs[0])
        for user in list(node.users):
            if user.target is operator.getitem and user.args[0] is node:
                user.replace_all_uses_with(outs[1 + user.args[1]])
        done += 1
    if done:
        graph.eliminate_dead_code()
        graph.lint()
    return done


def _pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class FoldResidualAddsPass(CustomGraphPass):
        """fold_residual_adds as an inductor post-grad pass, then the pass that was installed
        before it (if any)."""

        def __init__(self, then=None):
            self.then = then
            self.folded = 0  # (a count for tests and probes)

        def __call__(self, graph: torch.fx.Graph) -> None:
            self.folded += fold_residual_adds(graph)
            if self.then is not None:
                self.then(graph)

        def uuid(self):  # (inductor's FX graph cache key: this file's source, and the next pass's)
            with open(__file__, "rb") as f:
                own = hashlib.sha256(f.read()).hexdigest()
            then = self.then.uuid() if self.then is not None and hasattr(self.then, "uuid") else None
            return (own, then)

    return FoldResidualAddsPass


def install():
    """Put the pass in torch._inductor.config.post_grad_custom_post_pass (once; a pass already
    there runs after it). Returns the installed pass."""
    global _PASS
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    if _PASS is not None and current is _PASS:
        return _PASS
    _PASS = _pass_class()(then=current)
    config.post_grad_custom_post_pass = _PASS
    return _PASS
