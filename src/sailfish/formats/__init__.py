"""Weight formats: quantizers, the kernel layouts, checkpoint import. Pure PyTorch."""
from .gptq import from_gptq, to_gptq
from .int4 import GROUP_SIZES, PackedW4, QuantizedWeight, pack, quantize, unpack

__all__ = ["GROUP_SIZES", "PackedW4", "QuantizedWeight", "pack", "unpack", "quantize",
           "from_gptq", "to_gptq"]
