"""Sailfish: fast low-bit matrix multiplication for LLM inference, in Triton.

    import sailfish
    layer = sailfish.QuantLinear.from_linear(linear, group_size=128, sym=True)
    y = layer(x)                      # x (..., K) fp16/bf16 on CUDA
    # W4A8 (int8 per-token activations, QQQ weights): a QuantLinearW4A8
    layer = sailfish.QuantLinear.from_linear(linear, act_bits=8, group_size=128)

    # whole GPTQ / AWQ / compressed-tensors checkpoints (needs the `hf` extra: transformers, safetensors)
    model = sailfish.load_quantized("path/to/Llama-GPTQ", device="cuda")
    sailfish.save_quantized(model, "out")

    # a token's output independent of the rest of the batch, bit for bit (W4A8 int8 always is)
    sailfish.set_batch_invariant(True)            # or SAILFISH_BATCH_INVARIANT=1

    # pick the fastest tile configs for a model's shapes once (CUDA; forward never tunes)
    sailfish.tune(model, m=[1, 16, 256], save="my_gpu.json")   # SAILFISH_CONFIG_FILE=my_gpu.json

Importing sailfish does not touch the GPU, compile anything or import transformers.
"""
from .checkpoint import load_quantized, save_quantized
from .formats import (GROUP_SIZES, GROUP_SIZES_W4A8, QQQWeight, QuantizedWeight, from_awq, from_gptq,
                      quantize, quantize_qqq, to_awq, to_gptq)
from .convert import quantize_model
from .moe import QuantExperts
from .nn import QuantLinear, QuantLinearW4A8
from .runtime.flags import batch_invariant, batch_invariant_mode, set_batch_invariant
from .tune_model import tune
from .tuning import Config

__version__ = "0.1.0"
__all__ = ["QuantLinear", "quantize_model", "quantize", "QuantizedWeight", "from_gptq", "to_gptq",
           "GROUP_SIZES", "Config", "tune", "__version__",
           "QuantLinearW4A8", "QQQWeight", "quantize_qqq", "GROUP_SIZES_W4A8",
           "from_awq", "to_awq", "load_quantized", "save_quantized", "SailfishConfig",
           "batch_invariant", "batch_invariant_mode", "set_batch_invariant", "QuantExperts"]


def __getattr__(name):
    # SailfishConfig lives in sailfish.hf, which imports transformers and registers the
    # quantizer there: only on first use, never on `import sailfish`.
    if name == "SailfishConfig":
        from .hf import SailfishConfig
        return SailfishConfig
    raise AttributeError(f"module 'sailfish' has no attribute {name!r}")
