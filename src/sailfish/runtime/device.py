"""Device facts, each asked of the driver once per device: compute capability, SM count, the
config-table name of a GPU, the instruction sets the kernels need (bf16x2, mma.sync, PDL,
Gluon's Hopper wgmma); and where an op's tensors run (CUDA, the Triton interpreter, the
PyTorch reference).

Device policy for every op: CUDA tensors run the Triton kernels. CPU tensors run the same
Triton kernels through Triton's interpreter when TRITON_INTERPRET=1 is set before triton is
first imported; otherwise the op computes the identical math with the PyTorch reference, so a
CPU model still gives the numbers.
"""
from __future__ import annotations

import contextlib
import os
import re
from functools import lru_cache
from typing import Dict, Tuple

import torch

from . import flags

def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and interpreter_enabled())


def device_of(x: torch.Tensor):
    """Context for launching kernels on x's data: torch.cuda.device(x.device) for a CUDA
    tensor, a no-op otherwise. Triton launches on the *current* CUDA device, so without it
    tensors on cuda:1 while cuda:0 is current fail ("Pointer argument cannot be accessed
    from Triton (cpu tensor?)"); the previous device is restored on exit."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def check_devices(fake: bool = False, **tensors) -> None:
    """Raise ValueError unless the named tensors (None skipped) share one device, CUDA or CPU
    (fake=True, for the fake kernels: any one device, e.g. meta while tracing). The ops call
    it after a cheap get_device() comparison fails or gives -1, which is the index of the CPU
    and of meta alike: comparing indices alone let a meta layer "run" on a CPU input."""
    named = {k: t.device for k, t in tensors.items() if t is not None}
    devices = set(named.values())
    if len(devices) == 1 and (fake or next(iter(devices)).type in ("cuda", "cpu")):
        return
    got = ", ".join(f"{k} on {d}" for k, d in named.items())
    where = "one device" if fake else "one CUDA device or all on the CPU"
    raise ValueError(f"the tensors must be on {where}, got {got}; move the layer to the "
                     "input's device (layer.to(x.device))")



# the current CUDA device index without torch.cuda.current_device()'s Python layers
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


@lru_cache(maxsize=None)
def capability(device_index: int) -> Tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, asked once."""
    return torch.cuda.get_device_capability(device_index)


@lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sms_for(device: torch.device) -> int:
    """SM count for the heuristics: the device's on CUDA; 132 (H100 / H200) elsewhere, so that
    the interpreter runs the configs a GPU would."""
    return sm_count(device.index or 0) if device.type == "cuda" else 132


def has_bf16x2(device_index: int) -> bool:
    """sub/mul.bf16x2 (the bf16 asm dequantization) need sm_90; ptxas rejects them below."""
    return capability(device_index) >= (9, 0)


def has_mma_asm(x: torch.Tensor) -> bool:
    """mma.sync m16n8k16 needs sm_80; the bf16 dequantization's sub/mul.bf16x2 sm_90."""
    if not x.is_cuda:
        return False
    cap = capability(x.device.index)
    return cap >= (9, 0) or (cap >= (8, 0) and x.dtype == torch.float16)


def gluon_capable(device_index: int) -> bool:
    """An sm_90 GPU (Gluon's Hopper warpgroup_mma), unless SAILFISH_GLUON=0 (flags.FLAGS.gluon).
    Whether this Triton's Gluon compiles the kernels is the kernel family's question
    (ops/common.gluon_device)."""
    return (flags.FLAGS.gluon and device_index >= 0 and torch.cuda.is_available()
            and capability(device_index) == (9, 0))


def pdl(device_index: int) -> bool:
    """Whether programmatic dependent launch is used on this device: W4A16's split-K chain
    (kernels/common.py: the GEMM lets the reduce launch early, the reduce waits before reading
    the partial sums), and the row kernels after W4A8's GEMMs and the decode attention
    (ops/common.as_dependent). Needs sm_90+ (griddepcontrol); the CPU (device_index
    < 0) never. SAILFISH_PDL=0 turns it off (=1 forces it, also below sm_90, where the
    launches fail)."""
    mode = flags.pdl_mode()
    if device_index < 0 or mode == "0":
        return False
    return mode == "1" or capability(device_index) >= (9, 0)


_GPU_KEYS: Dict[int, str] = {}  # device index -> table name


def gpu_key_for_name(name: str) -> str:
    """Table name for a CUDA device name: the model ("NVIDIA H200" -> 'h200', "NVIDIA
    A100-SXM4-80GB" -> 'a100'), suffixed '_pcie' / '_nvl' for those boards ("NVIDIA H100
    PCIe" -> 'h100_pcie', "NVIDIA H100 NVL" -> 'h100_nvl'): they run at other clocks, power
    and memory bandwidth than the SXM part a plain model name stands for. 'h100' itself is
    only the SXM H100 ("NVIDIA H100 80GB HBM3", the board kernels/configs/h100.json was
    tuned on); another H100 name keeps its full name. Names without a model token: the
    lowercase alphanumerics joined by '_'."""
    low = name.lower()
    full = re.sub(r"[^a-z0-9]+", "_", low).strip("_")
    m = re.search(r"\b([a-z]\d{2,4})\b", low)
    if not m:
        return full
    key = m.group(1)
    for board in ("pcie", "nvl"):
        if re.search(rf"\b{board}\b", low):
            return f"{key}_{board}"
    if key == "h100" and not re.search(r"\bhbm3\b|\bsxm", low):
        return full
    return key


def gpu_key(device: torch.device) -> str:
    """The table name of a CUDA device (gpu_key_for_name), computed once per device index."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = _GPU_KEYS.get(idx)
    if key is None:
        key = _GPU_KEYS[idx] = gpu_key_for_name(torch.cuda.get_device_name(idx))
    return key


def forget() -> None:
    """Forget the GPU names (clear_caches)."""
    _GPU_KEYS.clear()
