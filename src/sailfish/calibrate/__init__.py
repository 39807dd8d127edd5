"""Calibrated quantization: weights chosen with the layer's inputs in view (GPTQ; for W4A8,
QQQ's smoothing + GPTQ)."""
from .gptq import Hessian, gptq_quantize, gptq_quantize_qqq
from .smooth import search_scales

__all__ = ["Hessian", "gptq_quantize", "gptq_quantize_qqq", "search_scales"]
