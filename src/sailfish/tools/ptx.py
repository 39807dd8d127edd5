"""Compile the W4A16 / W4A8 kernels for a GPU target on any machine (no GPU needed) and inspect
what they compile to: the PTX K-loop counts (does the dequantized weight tile go through shared
memory, does wgmma take it from registers), the SASS (ptxas), the wgmma register hazard, the
tensor-core GEMV's lane order. The correctness checks the tests run on every shipped config;
`python -m sailfish.bench.ptx` is their command line.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional


DTYPES = {"fp16": "*fp16", "bf16": "*bf16"}
_PTRS = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "gidx_ptr", "bias_ptr", "y_ptr", "ws_ptr")


def ast_source(fn, sig: dict, consts: dict, attrs: Optional[dict] = None):
    """triton.compiler.ASTSource of a @triton.jit kernel: sig the runtime parameters' types,
    consts the constexprs; constexpr parameters not in consts take their defaults (ASTSource
    itself does not apply them, and the launch-only ones, e.g. the PDL flags, are usually
    left out)."""
    from triton.compiler import ASTSource

    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and getattr(p, "has_default", False)},
              **consts}
    return ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
MAX_SCALE_OPS = 2
_INTS = ("M", "N", "K", "stride_xm", "stride_ym", "stride_qn", "stride_sn")


@dataclass
class LoopStats:
    st_shared: int
    ldmatrix: int
    bar_sync: int
    wgmma: int
    wgmma_a_in_registers: bool

    @property
    def roundtrip(self) -> bool:
        """The dequantized tile is stored to shared memory and reloaded for the MMA. What may
        remain is the relayout of the small scale (and zero) tiles: one st.shared or ldmatrix
        each, while the weight tile takes 8-32 of them per K tile (docs/perf_log.md v9)."""
        return (self.ldmatrix > MAX_SCALE_OPS or self.st_shared > MAX_SCALE_OPS or self.wgmma == 0
                or not self.wgmma_a_in_registers)


def compile_mma(block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
                *, dtype: str = "fp16", group_size: int = 128, has_zeros: bool = False, use_asm: bool = True,
                capability: int = 90, paired: bool = True, scale_acc: Optional[bool] = None,
                acc_fence: Optional[bool] = None, pdl_early: bool = False, prefetch: Optional[bool] = None):
    """triton.compile of kernels/w4a16._w4a16_kernel for cuda:<capability>, specialised as the
    launcher is on a GPU (16-byte aligned pointers, N / K / strides divisible by 16).
    pdl_early: the split-K variant that lets the reduce launch early (runtime/device.py pdl).
    prefetch: PREFETCH_S (None: the launcher's rule, ops/w4a16.prefetch_scales)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..kernels.w4a16 import _w4a16_kernel

    ty = DTYPES[dtype]
    sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "gidx_ptr": "*i32", "bias_ptr": ty,
           "y_ptr": ty, "ws_ptr": "*fp32", **{k: "i32" for k in _INTS}}
    from ..ops.w4a16 import paired_scales, prefetch_scales
    from ..ops.w4a16 import acc_fence as launcher_acc_fence
    from ..ops.w4a16 import scale_acc as launcher_scale_acc
    from dataclasses import replace

    from ..tuning import Config

    cfg = Config(block_m, block_n, block_k, split_k, num_warps=num_warps, num_stages=num_stages)
    sa = launcher_scale_acc(cfg, group_size, False) if scale_acc is None else scale_acc
    cfg_sa = replace(cfg, scale_acc=sa)
    consts = dict(GROUP_SIZE=0 if group_size == -1 else group_size, HAS_ZEROS=has_zeros, HAS_GIDX=False,
                  HAS_BIAS=False, EVEN_K=True, SPLIT_K=split_k, EMU_BF16=False, USE_ASM=use_asm,
                  PREFETCH_S=prefetch_scales(cfg_sa, group_size, False, has_zeros) if prefetch is None else prefetch,
                  PAIRED_S=paired and paired_scales(cfg),
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                  SCALE_ACC=sa,
                  ACC_FENCE=use_asm and (launcher_acc_fence() if acc_fence is None else acc_fence),
                  PDL_EARLY=pdl_early)
    names = list(sig)
    aligned = _PTRS + ("N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ast_source(_w4a16_kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


W4A8_TILES = ((16, 128, 128, 1, 4, 4), (16, 128, 256, 2, 4, 3), (32, 128, 128, 1, 4, 4),
              (64, 128, 128, 1, 4, 4), (32, 64, 64, 1, 4, 4), (128, 128, 128, 1, 8, 3),
              (128, 256, 128, 1, 8, 3), (256, 128, 128, 1, 8, 3))


def compile_w4a8(block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
                 *, group_size: int = 128, act_dtype: str = "int8", capability: int = 90, clamp: bool = False,
                 fixup: bool = False):
    """triton.compile of kernels/w4a8._w4a8_kernel (the inline-asm unpack, as on a GPU) for
    cuda:<capability>, with the launcher's GPU specialisation (16-byte aligned pointers, N / K /
    strides divisible by 16). act_dtype "fp8": the e4m3-activation variant. clamp: the per-group
    unpack with its +-127 clamp (scales out of quantize_qqq's range; ops/w4a8.py). fixup: split-K
    slices added inside the kernel (FIXUP; ops/w4a8.fixup_tile) instead of by the reduce kernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..kernels.w4a8 import _w4a8_kernel

    fp8 = act_dtype == "fp8"
    sig = {"xq_ptr": "*fp8e4nv" if fp8 else "*i8", "xs_ptr": "*fp32", "qb_ptr": "*i32", "sch_ptr": "*fp32",
           "sg_ptr": "*fp16", "bias_ptr": "*fp32",
           "y_ptr": "*fp16" if split_k == 1 or fixup else "*fp32" if fp8 else "*i32",
           **{k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_ym", "stride_qn", "stride_gn")}}
    consts = dict(GROUP_SIZE=0 if group_size == -1 else group_size, HAS_BIAS=False, EVEN_K=True,
                  SPLIT_K=split_k, RAW=False, EMU_BF16=False, USE_ASM=True,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, CLAMP=clamp, FIXUP=fixup)
    if fixup:
        sig.update(sync_ptr="*i32", ws_ptr="*fp32" if fp8 else "*i32")
    else:
        consts.update(sync_ptr=None, ws_ptr=None)
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + ["N", "K", "stride_xm", "stride_ym", "stride_qn"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ast_source(_w4a8_kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_gemv(block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int = 1,
                 *, dtype: str = "fp16", group_size: int = 128, has_zeros: bool = False, use_asm: bool = True,
                 capability: int = 90, even_k: bool = True, scale_acc: bool = False, fixup: bool = False):
    """triton.compile of kernels/w4a16._w4a16_gemv_mma_kernel (the M <= 8 tensor-core GEMV)
    for cuda:<capability>, specialised as the launcher is on a GPU (num_stages 2: the words
    are prefetched one K tile ahead in registers, >= 3 through a cp.async ring:
    ops/w4a16.gemv_stages; scale_acc: Config.scale_acc; fixup: split-K slices added inside the
    kernel, ops/w4a16.gemv_fixup)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ..kernels.w4a16 import _w4a16_gemv_mma_kernel, gemv_asm, gemv_pairs, gemv_warps
    from ..ops.w4a16 import gemv_stages

    ty = DTYPES[dtype]
    asm = gemv_asm(dtype == "bf16", has_zeros, even_k, gemv_pairs(block_n), scale_acc) if use_asm else ("", "")
    sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "bias_ptr": ty, "y_ptr": ty,
           "ws_ptr": "*fp32", **{k: "i32" for k in _INTS}}
    consts = dict(GROUP_SIZE=0 if group_size == -1 else group_size, HAS_ZEROS=has_zeros, HAS_BIAS=False,
                  EVEN_K=even_k, SPLIT_K=split_k, EMU_BF16=False, USE_ASM=use_asm,
                  ASM=asm[0], ASM_CONSTRAINTS=asm[1], **gemv_stages(num_stages), BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_K=block_k, SCALE_ACC=scale_acc, FIXUP=fixup)
    if fixup:
        sig["sync_ptr"] = "*i32"
    else:
        consts["sync_ptr"] = None
    names = list(sig)
    aligned = tuple(n for n in _PTRS if n != "gidx_ptr") + ("N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ast_source(_w4a16_gemv_mma_kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": gemv_warps(block_n, block_k, num_warps), "num_stages": 1})


@dataclass
class SassLoop:
    """The K loop of a compiled kernel in SASS: per-thread instruction counts per iteration."""
    instructions: int
    ops: dict  # opcode (predicate and modifiers dropped after the first dot) -> count
    weights: int  # weights one thread handles per iteration
    lane_order: Optional[bool] = None  # GEMV: the asm's layout is the one it needs

    @property
    def per_weight(self) -> float:
        return self.instructions / self.weights


def sass(cubin: bytes) -> str:
    """cuobjdump -sass of a cubin (the cuobjdump that ships with Triton's NVIDIA backend)."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout


def ptxas_report(ptx: str, arch: str = "sm_90a") -> str:
    """ptxas -v of a kernel's PTX (the ptxas Triton's NVIDIA backend compiles with for sm_90): its
    resource lines ("Used N registers", "N bytes spill stores") and warnings."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    found = get_ptxas(90)  # an object with .path (Triton 3.9) or a (path, version) pair (3.6)
    tool = getattr(found, "path", None) or found[0]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        rep = subprocess.run([tool, f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    return rep.stdout + rep.stderr


def sass_loop(sass_text: str, marker: str, weights: int) -> Optional[SassLoop]:
    """The innermost backward branch's body that contains `marker` (e.g. "HMMA")."""
    ins = []  # (address, text)
    for line in sass_text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best = None
    for i, (addr, text) in enumerate(ins):
        b = re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", text)
        if not b or int(b.group(1), 16) >= addr:
            continue
        body = [t for a, t in ins if int(b.group(1), 16) <= a <= addr]
        if any(marker in t for t in body) and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        return None
    ops: dict = {}
    for t in best:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return SassLoop(len(best), ops, weights)


def _sass_instructions(sass_text: str) -> list:
    out = []
    for line in sass_text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _written_registers(text: str) -> set:
    """The registers an instruction writes (its first operand, widened for 64/128-bit ops);
    empty for stores, branches, barriers and the wgmma instructions themselves."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    parts = text.split(None, 1)
    if len(parts) < 2:
        return set()
    op, rest = parts
    m = re.match(r"R(\d+)\b", rest.strip())
    if not m or op.startswith(("ST", "RED", "ATOM", "BRA", "BAR", "WARPGROUP")) or re.match(r"[HIQ]GMMA", op):
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or op.startswith("IMAD.WIDE")) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_loop(sass_text: str) -> Optional[list]:
    """The SASS instructions of the innermost loop that issues wgmma (HGMMA / IGMMA / QGMMA), or
    None."""
    ins = _sass_instructions(sass_text)
    body = None
    for addr, text in ins:
        b = re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", text)
        if not b or int(b.group(1), 16) >= addr:
            continue
        cand = [t for a, t in ins if int(b.group(1), 16) <= a <= addr]
        if any(re.search(r"[HIQ]GMMA", t) for t in cand) and (body is None or len(cand) < len(body)):
            body = cand
    return body


def overlap_loop_ok(sass_text: str) -> tuple:
    """(ok, summary) for kernels/w4a16_gluon.w4a16_gluon_overlap_kernel's SASS K loop: two K steps
    per iteration whose 32 wgmmas read 32 different A register quads, and one wait per step that
    leaves the other step's two wgmma groups in flight (WARPGROUP.DEPBAR.LE gsb0, 0x2), i.e. each
    step's dequantization overlaps the previous step's wgmmas."""
    body = wgmma_loop(sass_text) or []
    quads = [m.group(1) for t in body for m in [re.search(r"GMMA\S*\s+R\d+,\s*(R\d+)", t)] if m]
    waits = [t.split()[-1] for t in body if "WARPGROUP.DEPBAR" in t]
    ok = len(quads) == 32 and len(set(quads)) == 32 and waits == ["0x2", "0x2"]
    return ok, f"{len(quads)} wgmmas over {len(set(quads))} A quads, waits {waits}"


def wgmma_register_hazard(sass_text: str) -> bool:
    """True if, in the innermost loop that issues wgmma (SASS HGMMA / IGMMA / QGMMA) with its A
    operand in registers, an instruction writes a register that an earlier wgmma still in
    flight reads as A (its group not yet retired by a WARPGROUP.DEPBAR.LE gsb0, N), the loop body
    walked twice so that the back edge counts. Reading such registers while the wgmma runs is
    undefined (PTX ISA, wgmma.mma_async); Triton 3.6-3.8 compile the mma kernel's loop that
    way unless ACC_FENCE, and an H200 gave wrong, run-to-run different outputs for it."""
    body = wgmma_loop(sass_text)
    if body is None:
        return False
    # wgmma groups in flight (the A registers of each), the last one still open: SASS closes a
    # group (wgmma.commit_group) with the gsb0 of its last HGMMA, and WARPGROUP.DEPBAR.LE gsb0, N
    # waits until N groups are left
    inflight: list = []
    cur: set = set()
    for walk in range(2):
        for text in body:
            if re.search(r"[HIQ]GMMA", text):
                m = re.search(r"[HIQ]GMMA\S*\s+R\d+,\s*R(\d+)", text)  # (none: A from shared memory)
                if m:
                    cur |= set(range(int(m.group(1)), int(m.group(1)) + 4))
                if "gsb0" in text:
                    inflight.append(cur)
                    cur = set()
                continue
            d = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", text)
            if d:
                n = int(d.group(1), 16)
                inflight = inflight[len(inflight) - n:] if n else []
                continue
            if walk and any(_written_registers(text) & a for a in inflight + [cur]):
                return True
    return False


# lane bit -> (virtual row, lane-in-group) step of the GEMV asm's (V, 4) tensors: lane = 4 g + t
GEMV_LANES = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]


def _lane_bases(layout: str) -> Optional[list]:
    """The lane bases of a 2-D TTGIR layout (#ttg.blocked or #ttg.linear), or None."""
    m = re.search(r"lane = (\[\[.*?\]\])", layout)
    if layout.startswith("#ttg.linear") and m:
        return json.loads(m.group(1))
    if not layout.startswith("#ttg.blocked"):
        return None
    spt, tpw, order = (json.loads(re.search(name + r" = (\[[^\]]*\])", layout).group(1))
                       for name in ("sizePerThread", "threadsPerWarp", "order"))
    if len(spt) != 2:
        return None
    bases = []
    for dim in order:  # lanes fill the dims fastest first, above the per-thread elements
        for bit in range(tpw[dim].bit_length() - 1):
            step = [0, 0]
            step[dim] = spt[dim] << bit
            bases.append(step)
    return bases


def gemv_lane_order(ttgir: str) -> bool:
    """Whether the GEMV's mma asm runs in the lane order it assumes: every lane's element is
    (virtual row 8 w + g, t) with lane = 4 g + t, i.e. the (V, 4) operands' lanes are
    GEMV_LANES. Any other layout gives wrong results (a lane's words would not be its
    m16n8k16 A fragment)."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<\{.*\}>)", ttgir, re.M))
    found = False
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" not in line or "mma.sync" not in line:
            continue
        found = True
        res = re.search(r"->\s*\(?tensor<[^,]*,\s*(#\w+)>", line)
        if not res or _lane_bases(layouts.get(res.group(1), "")) != GEMV_LANES:
            return False
    return found


def gemv_loop(block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int = 1,
              **kw) -> SassLoop:
    """SASS K-loop counts of the tensor-core GEMV for one config (raises if none is found)."""
    k = compile_gemv(block_m, block_n, block_k, split_k, num_warps, num_stages, **kw)
    from ..kernels.w4a16 import gemv_warps

    warps = gemv_warps(block_n, block_k, num_warps)
    loop = sass_loop(sass(k.asm["cubin"]), "HMMA", block_n * block_k // (32 * warps))
    if loop is None:
        raise RuntimeError("no K loop with an HMMA in the compiled GEMV")
    loop.lane_order = gemv_lane_order(k.asm["ttgir"])
    return loop


def k_loop_stats(ptx: str) -> Optional[LoopStats]:
    """Counts inside the PTX loop that issues the wgmma (the K loop); None if there is none."""
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", line.strip())
        if not m:
            continue
        lab = re.escape(m.group(1))
        end = next((j for j in range(i + 1, len(lines)) if re.search(r"bra(\.uni)?\s+" + lab + ";", lines[j])),
                   None)
        if end is None:
            continue
        body = lines[i:end + 1]
        wg = [b for b in body if "wgmma.mma_async" in b]
        if not wg:
            continue
        text = "\n".join(body)
        # register A: the operand list after the accumulators is a brace list of %r registers
        a_reg = all(re.search(r"\},\s*\{%r", b) for b in wg)
        return LoopStats(text.count("st.shared"), text.count("ldmatrix"), text.count("bar.sync"), len(wg), a_reg)
    return None


def shipped_mma_configs(kernel: str = "mma"):
    """(gpu, config) for every distinct W4A16 config of this kernel in the shipped tables
    ('gemv': those the tensor-core GEMV runs, BLOCK_M <= 8, BLOCK_N >= 16)."""
    from ..tuning import CONFIG_DIR, Config

    seen = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        with open(path) as f:
            table = json.load(f).get("configs", {})
        for key, entry in table.items():
            cfg = Config(**entry)
            if key.startswith("w4a16|") and cfg.kernel == kernel and (
                    kernel != "gemv" or (cfg.BLOCK_M <= 8 and cfg.BLOCK_N >= 16)):
                seen.setdefault(cfg, path.stem)
    return [(gpu, cfg) for cfg, gpu in seen.items()]
