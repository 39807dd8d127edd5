"""Sailfish: fast low-bit matrix multiplication for LLM inference, in Triton.

    import sailfish
    layer = sailfish.QuantLinear.from_linear(linear, group_size=128, sym=True)
    y = layer(x)                      # x (..., K) fp16/bf16 on CUDA

Importing sailfish does not touch the GPU and does not compile anything.
"""
from .formats import GROUP_SIZES, QuantizedWeight, from_gptq, quantize, to_gptq
from .nn import QuantLinear, quantize_model
from .tuning import Config

__version__ = "0.1.0"
__all__ = ["QuantLinear", "quantize_model", "quantize", "QuantizedWeight", "from_gptq", "to_gptq",
           "GROUP_SIZES", "Config", "__version__"]
