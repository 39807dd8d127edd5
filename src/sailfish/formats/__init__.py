"""Weight formats: quantizers, the kernel layouts, checkpoint import / export (GPTQ, AWQ,
compressed-tensors). Pure PyTorch."""
from .awq import from_awq, to_awq
from .compressed_tensors import from_compressed_tensors, to_compressed_tensors
from .gptq import from_gptq, to_gptq
from .int4 import GROUP_SIZES, PackedW4, QuantizedWeight, pack, quantize, unpack
from .qqq import (GROUP_SIZES_W4A8, PackedQQQ, QQQWeight, pack_qqq, quantize_activations, quantize_qqq,
                  unpack_qqq)

__all__ = ["GROUP_SIZES", "PackedW4", "QuantizedWeight", "pack", "unpack", "quantize",
           "from_gptq", "to_gptq", "from_awq", "to_awq", "from_compressed_tensors",
           "to_compressed_tensors",
           "GROUP_SIZES_W4A8", "PackedQQQ", "QQQWeight", "pack_qqq", "unpack_qqq", "quantize_qqq",
           "quantize_activations"]
