"""transformers integration: quantize a model with Sailfish while from_pretrained loads it.

    from transformers import AutoModelForCausalLM
    from sailfish.hf import SailfishConfig
    model = AutoModelForCausalLM.from_pretrained(
        name, quantization_config=SailfishConfig(group_size=128, sym=True), dtype=torch.float16)

Importing this module registers quant_method "sailfish" in transformers' quantizer registry
(transformers.quantizers.auto.register_quantization_config / register_quantizer); `import
sailfish` does not import it (sailfish.SailfishConfig imports it on first use).

The quantizer lets transformers load the fp16 / bf16 weights as usual and then runs
sailfish.quantize_model on the loaded model (round to nearest), so the peak memory is that
of the unquantized model. Such a model cannot be written back with save_pretrained
(transformers has no format for Sailfish's packed buffers): use sailfish.save_quantized,
which writes a GPTQ, AWQ or compressed-tensors checkpoint.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

try:
    from transformers.quantizers.auto import (AUTO_QUANTIZER_MAPPING, register_quantization_config,
                                              register_quantizer)
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as e:  # transformers missing, or too old to accept third-party quantizers
    raise ImportError("sailfish.hf needs transformers >= 4.56 (third-party quantizer registration): "
                      "pip install 'sailfish[hf]'") from e

from .formats.int4 import HALF_DTYPES, _check_bits, _check_group_size
from .formats.qqq import check_group_size_w4a8
from .fuse import check_fuse_flag
from .convert import DEFAULT_SKIP, quantize_model, skip_names
from .nn import _check_act_bits

QUANT_METHOD = "sailfish"
log = logging.getLogger("sailfish")


class SailfishConfig(QuantizationConfigMixin):
    """Quantize every supported nn.Linear on load, as sailfish.quantize_model does.

    bits: 4. group_size: 32, 64, 128, 256 or -1 (act_bits=8: -1 or 128). sym: symmetric
    (Marlin) or asymmetric weights. act_bits: 16 (W4A16 QuantLinear) or 8 (W4A8).
    modules_to_not_convert: module names (or name components) left in full precision,
    default ["lm_head"]; one name may be given as a str. lm_head=True: quantize the lm_head
    too (then the default list is empty). fuse: q/k/v and gate/up as one layer each, and
    DeepSeek's shared experts inside the MoE block, where exact (sailfish.fuse).
    """

    def __init__(self, bits: int = 4, group_size: int = 128, sym: bool = True, act_bits: int = 16,
                 modules_to_not_convert: Optional[Iterable[str]] = DEFAULT_SKIP, fuse: bool = True,
                 lm_head: bool = False, **kwargs):
        self.quant_method = QUANT_METHOD
        self.bits, self.group_size, self.sym, self.act_bits = bits, group_size, sym, act_bits
        self.fuse = fuse
        self.lm_head = lm_head
        self.modules_to_not_convert = list(skip_names(modules_to_not_convert, lm_head, "modules_to_not_convert"))
        self.post_init()

    def post_init(self) -> None:
        """Reject bad settings here, before transformers reads any weight."""
        _check_bits(self.bits)
        _check_act_bits(self.act_bits)
        check_fuse_flag(self.fuse)
        if not isinstance(self.sym, bool):
            raise TypeError(f"sym={self.sym!r} must be a bool")
        if self.act_bits == 8:
            check_group_size_w4a8(self.group_size)
            if not self.sym:
                raise ValueError("W4A8 (act_bits=8) weights are symmetric; sym=False is not supported")
        else:
            _check_group_size(self.group_size)


class SailfishHfQuantizer(HfQuantizer):
    """transformers' side of SailfishConfig: plain load, then quantize_model."""

    requires_calibration = False

    def __init__(self, quantization_config: SailfishConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        if self.pre_quantized:
            raise ValueError('quant_method "sailfish" is applied while loading an unquantized checkpoint; '
                             "to load a Sailfish-saved (GPTQ) checkpoint use sailfish.load_quantized")

    def update_dtype(self, dtype):
        # QuantLinear runs in float16 or bfloat16; float32 (transformers' default) -> float16.
        return dtype if dtype in HALF_DTYPES else torch.float16

    update_torch_dtype = update_dtype  # the name transformers 4.x calls

    def _process_model_before_weight_loading(self, model, **kwargs):
        return model  # nothing to replace before the weights: quantize_model runs after them

    def _process_model_after_weight_loading(self, model, **kwargs):
        c = self.quantization_config
        return quantize_model(model, bits=c.bits, group_size=c.group_size, sym=c.sym,
                              skip=c.modules_to_not_convert, act_bits=c.act_bits, fuse=c.fuse)

    def is_serializable(self, *args, **kwargs) -> bool:
        # transformers raises after this, pointing at the log for the reason.
        log.warning("sailfish: save_pretrained cannot write Sailfish layers; use "
                    "sailfish.save_quantized(model, path) (GPTQ, AWQ or compressed-tensors format)")
        return False

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # The layers are torch.library ops (fullgraph-compilable); without this generate() never
        # compiles a quantizer-loaded model (transformers' default is False).
        return True


if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantization_config(QUANT_METHOD)(SailfishConfig)
    register_quantizer(QUANT_METHOD)(SailfishHfQuantizer)
