"""Compile the W4A16 (or W4A8) tensor-core kernel for a GPU target on any machine (no GPU
needed) and report what its K loop does: does the dequantized weight tile go through shared
memory, and does wgmma take it from registers?

    python -m sailfish.bench.ptx                      # the shipped W4A16 'mma' configs, sm_90a
    python -m sailfish.bench.ptx --config 16,128,256,1,4,3 --dtype bf16 --group-size 32
    python -m sailfish.bench.ptx --family w4a8 --group-size -1   # the W4A8 int8 kernel

Per config it prints the PTX K-loop counts (st.shared / ldmatrix / bar.sync / wgmma) and the
verdict `no-fp16-smem` or `fp16-smem-roundtrip`. tests/test_w4a16.py runs the same check on
every config the tables ship, so a layout or compiler change that brings the round trip back
fails CI.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from typing import Optional

DTYPES = {"fp16": "*fp16", "bf16": "*bf16"}
_PTRS = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "gidx_ptr", "bias_ptr", "y_ptr", "ws_ptr")
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
                capability: int = 90, paired: bool = True):
    """triton.compile of kernels/w4a16._w4a16_kernel for cuda:<capability>, specialised as the
    launcher is on a GPU (16-byte aligned pointers, N / K / strides divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..kernels.w4a16 import _w4a16_kernel

    ty = DTYPES[dtype]
    sig = {"x_ptr": ty, "qw_ptr": "*i32", "s_ptr": ty, "z_ptr": ty, "gidx_ptr": "*i32", "bias_ptr": ty,
           "y_ptr": ty, "ws_ptr": "*fp32", **{k: "i32" for k in _INTS}}
    from ..ops.w4a16 import paired_scales, prefetch_scales
    from ..tuning import Config

    cfg = Config(block_m, block_n, block_k, split_k, num_warps=num_warps, num_stages=num_stages)
    consts = dict(GROUP_SIZE=0 if group_size == -1 else group_size, HAS_ZEROS=has_zeros, HAS_GIDX=False,
                  HAS_BIAS=False, EVEN_K=True, SPLIT_K=split_k, EMU_BF16=False, USE_ASM=use_asm,
                  PREFETCH_S=prefetch_scales(cfg, group_size), PAIRED_S=paired and paired_scales(cfg),
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8)
    names = list(sig)
    aligned = _PTRS + ("N", "K", "stride_xm", "stride_ym", "stride_qn")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=_w4a16_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


W4A8_TILES = ((16, 128, 128, 1, 4, 4), (16, 128, 256, 2, 4, 3), (32, 128, 128, 1, 4, 4),
              (64, 128, 128, 1, 4, 4), (32, 64, 64, 1, 4, 4), (128, 128, 128, 1, 8, 3),
              (128, 256, 128, 1, 8, 3), (256, 128, 128, 1, 8, 3))


def compile_w4a8(block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
                 *, group_size: int = 128, act_dtype: str = "int8", capability: int = 90):
    """triton.compile of kernels/w4a8._w4a8_kernel (the inline-asm unpack, as on a GPU) for
    cuda:<capability>, with the launcher's GPU specialisation (16-byte aligned pointers, N / K /
    strides divisible by 16). act_dtype "fp8": the e4m3-activation variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..kernels.w4a8 import _w4a8_kernel

    fp8 = act_dtype == "fp8"
    sig = {"xq_ptr": "*fp8e4nv" if fp8 else "*i8", "xs_ptr": "*fp32", "qb_ptr": "*i8", "sch_ptr": "*fp32",
           "sg_ptr": "*fp16", "bias_ptr": "*fp32",
           "y_ptr": "*fp16" if split_k == 1 else "*fp32" if fp8 else "*i32",
           **{k: "i32" for k in ("M", "N", "K", "stride_xm", "stride_ym", "stride_qn", "stride_gn")}}
    consts = dict(GROUP_SIZE=0 if group_size == -1 else group_size, HAS_BIAS=False, EVEN_K=True,
                  SPLIT_K=split_k, RAW=False, EMU_BF16=False, USE_ASM=True,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8)
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + ["N", "K", "stride_xm", "stride_ym", "stride_qn"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=_w4a8_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


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


def shipped_mma_configs():
    """(gpu, config) for every distinct W4A16 'mma' config in the shipped tables."""
    from ..tuning import CONFIG_DIR, Config

    seen = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        with open(path) as f:
            table = json.load(f).get("configs", {})
        for key, entry in table.items():
            cfg = Config(**entry)
            if key.startswith("w4a16|") and cfg.kernel == "mma":
                seen.setdefault(cfg, path.stem)
    return [(gpu, cfg) for cfg, gpu in seen.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[],
                    help="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages (repeatable); "
                         "default: every shipped W4A16 mma config (w4a8: W4A8_TILES)")
    ap.add_argument("--family", choices=("w4a16", "w4a8", "w4a8-fp8"), default="w4a16",
                    help="w4a8: the int8 kernel, w4a8-fp8 its e4m3-activation variant (--group-size -1 "
                         "or 128; --dtype, --zeros, --no-asm ignored)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--zeros", action="store_true", help="asymmetric (zero points)")
    ap.add_argument("--no-asm", action="store_true", help="the pure-Triton dequantization")
    ap.add_argument("--capability", type=int, default=90, help="compute capability, e.g. 90 (sm_90a), 80")
    ap.add_argument("--dump", default=None, help="write the PTX of the last config here")
    args = ap.parse_args(argv)
    from ..tuning import Config

    if args.config:
        cfgs = []
        for c in args.config:
            v = [int(t) for t in c.split(",")]
            if len(v) != 6:
                ap.error(f"--config {c!r}: want BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages")
            cfgs.append(("cli", Config(v[0], v[1], v[2], SPLIT_K=v[3], num_warps=v[4], num_stages=v[5])))
    elif args.family.startswith("w4a8"):
        cfgs = [(args.family, Config(*t[:3], SPLIT_K=t[3], num_warps=t[4], num_stages=t[5])) for t in W4A8_TILES
                if args.family == "w4a8" or args.group_size == -1 or t[2] <= args.group_size]
    else:
        cfgs = shipped_mma_configs()
    bad = 0
    for gpu, cfg in cfgs:
        tile = (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, cfg.num_stages)
        if args.family.startswith("w4a8"):
            k = compile_w4a8(*tile, group_size=args.group_size, capability=args.capability,
                             act_dtype="fp8" if args.family == "w4a8-fp8" else "int8")
        else:
            k = compile_mma(*tile, dtype=args.dtype, group_size=args.group_size, has_zeros=args.zeros,
                            use_asm=not args.no_asm, capability=args.capability)
        st = k_loop_stats(k.asm["ptx"])
        tag = (f"[{gpu}] BM={cfg.BLOCK_M} BN={cfg.BLOCK_N} BK={cfg.BLOCK_K} split={cfg.SPLIT_K} "
               f"w={cfg.num_warps} st={cfg.num_stages}")
        if st is None:
            print(f"{tag}: no wgmma K loop found")
            bad += 1
            continue
        kind = {"w4a8": "int8", "w4a8-fp8": "fp8"}.get(args.family, "fp16")
        verdict = f"{kind}-smem-roundtrip" if st.roundtrip else f"no-{kind}-smem"
        bad += st.roundtrip
        print(f"{tag}: st.shared={st.st_shared} ldmatrix={st.ldmatrix} bar.sync={st.bar_sync} "
              f"wgmma={st.wgmma} A-in-registers={st.wgmma_a_in_registers} [{verdict}]")
        if args.dump:
            with open(args.dump, "w") as f:
                f.write(k.asm["ptx"])
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
