"""Calibrated quantization: weights chosen with the layer's inputs in view (GPTQ)."""
from .gptq import Hessian, gptq_quantize

__all__ = ["Hessian", "gptq_quantize"]
