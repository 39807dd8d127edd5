"""Compile the W4A16 (or W4A8) tensor-core kernel for a GPU target on any machine (no GPU
needed) and report what its K loop does: does the dequantized weight tile go through shared
memory, and does wgmma take it from registers?

    python -m sailfish.bench.ptx                      # the shipped W4A16 'mma' configs, sm_90a
    python -m sailfish.bench.ptx --config 16,128,256,1,4,3 --dtype bf16 --group-size 32
    python -m sailfish.bench.ptx --family w4a8 --group-size -1   # the W4A8 int8 kernel
    python -m sailfish.bench.ptx --gemv               # the tensor-core GEMV: SASS instructions per weight
    python -m sailfish.bench.ptx --gluon --hazard     # the shipped tiles of the Hopper Gluon kernel
    python -m sailfish.bench.ptx --gluon --overlap --config 16,64,256,1,4,3   # its overlap variant
    python -m sailfish.bench.ptx --gluon --pipe        # the shipped tiles of its large-M chunk-pipelined kernel

The checks live in sailfish/tools/ptx.py. Per config it prints the PTX K-loop counts (st.shared / ldmatrix / bar.sync / wgmma) and the
verdict `no-fp16-smem` or `fp16-smem-roundtrip`. tests/test_w4a16.py runs the same check on
every config the tables ship, so a layout or compiler change that brings the round trip back
fails CI.
"""
from __future__ import annotations

import argparse
import re

from ..formats.int4 import GROUP_SIZES
from ..tools.ptx import (DTYPES, W4A8_TILES, compile_mma, compile_w4a8, gemv_loop, k_loop_stats, overlap_loop_ok, sass,
                         shipped_mma_configs, wgmma_register_hazard)


def _main_gluon(cfgs, args) -> int:
    """The Gluon kernel's K loop for each config: shared-memory stores / ldmatrix (0: the weights
    never leave registers), wgmma A in registers, the wait_group depths (only 0; --overlap: the
    overlap kernel's structure, overlap_loop_ok; --pipe: 1 and 0, a chunk left in flight), and
    with --hazard the SASS register-hazard check."""
    from ..kernels.w4a16_gluon import compile_sm90

    bad = 0
    for gpu, cfg in cfgs:
        k = compile_sm90(cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_stages, args.group_size, cfg.SPLIT_K, args.dtype,
                         num_warps=cfg.num_warps, pdl_early=cfg.SPLIT_K > 1, has_zeros=args.zeros,
                         overlap=args.overlap, pipe=args.pipe)
        st = k_loop_stats(k.asm["ptx"])
        waits = sorted(set(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", k.asm["ptx"])))
        ok = st is not None and not st.st_shared and not st.ldmatrix and st.wgmma_a_in_registers
        if args.overlap:  # waits 2 and 0 by design: the SASS loop's structure instead
            loop_ok, waits = overlap_loop_ok(sass(k.asm["cubin"]))
            ok = ok and loop_ok
        else:
            ok = ok and waits == (["0", "1"] if args.pipe else ["0"])
        verdict = "weights in registers" if ok else "SHARED-MEMORY TRIP OR OTHER WAITS"
        hz, verdict = _hazard_and_dump(k, args, verdict)
        bad += not ok or hz
        print(f"[{gpu}] BM={cfg.BLOCK_M} BN={cfg.BLOCK_N} split={cfg.SPLIT_K} w={cfg.num_warps} "
              f"ring={cfg.num_stages}: {st} waits={waits} [{verdict}]")
    return 1 if bad else 0


def _hazard_and_dump(k, args, verdict: str):
    """(hazard found, verdict) with --hazard's SASS check appended; --dump writes the PTX."""
    hz = False
    if args.hazard:
        hz = wgmma_register_hazard(sass(k.asm["cubin"]))
        verdict += ", WGMMA-REGISTER-HAZARD" if hz else ", no register hazard"
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(k.asm["ptx"])
    return hz, verdict


def _main_gemv(cfgs, args) -> int:
    """--gemv: SASS instructions per weight of the tensor-core GEMV's K loop, and its lane order."""
    bad = 0
    for gpu, cfg in cfgs:
        loop = gemv_loop(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.SPLIT_K, cfg.num_warps, cfg.num_stages,
                         dtype=args.dtype,
                         group_size=args.group_size, has_zeros=args.zeros, use_asm=not args.no_asm,
                         capability=args.capability, scale_acc=cfg.scale_acc)
        top = ", ".join(f"{op} {n}" for op, n in sorted(loop.ops.items(), key=lambda kv: -kv[1])[:8])
        bad += not loop.lane_order
        print(f"[{gpu}] BM={cfg.BLOCK_M} BN={cfg.BLOCK_N} BK={cfg.BLOCK_K} split={cfg.SPLIT_K} w={cfg.num_warps} "
              f"st={cfg.num_stages}{' scale_acc' if cfg.scale_acc else ''}: "
              f"{loop.instructions} instructions / {loop.weights} weights per thread and K tile = "
              f"{loop.per_weight:.2f} per weight; lane order {'ok' if loop.lane_order else 'WRONG'} ({top})")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sailfish.bench.ptx", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[],
                    help="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages (repeatable); "
                         "default: every shipped W4A16 mma config (w4a8: W4A8_TILES)")
    ap.add_argument("--family", choices=("w4a16", "w4a8", "w4a8-fp8"), default="w4a16",
                    help="w4a8: the int8 kernel, w4a8-fp8 its e4m3-activation variant (--group-size -1 "
                         "or 128; --dtype, --zeros, --no-asm ignored)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128)
    ap.add_argument("--zeros", action="store_true", help="asymmetric (zero points)")
    ap.add_argument("--no-asm", action="store_true", help="the pure-Triton dequantization")
    ap.add_argument("--capability", type=int, default=90, help="compute capability, e.g. 90 (sm_90a), 80")
    ap.add_argument("--dump", default=None, help="write the PTX of the last config here")
    ap.add_argument("--hazard", action="store_true",
                    help="also check the SASS K loop for a wgmma register hazard (wgmma_register_hazard)")
    ap.add_argument("--gemv", action="store_true",
                    help="the M <= 8 tensor-core GEMV instead (default configs: the shipped 'gemv' ones): "
                         "SASS instructions per weight in its K loop and its lane-order check")
    ap.add_argument("--gluon", action="store_true",
                    help="the Hopper Gluon W4A16 kernel instead (default configs: the shipped 'gluon' ones; "
                         "--group-size, --dtype, --zeros apply): its K loop and wgmma waits")
    ap.add_argument("--overlap", action="store_true",
                    help="with --gluon: its overlap variant (kernel 'gluon_overlap', the words through the "
                         "ring; give --config: the default configs are the plain kernel's): two steps' wgmmas in "
                         "flight, each on its own A registers")
    ap.add_argument("--pipe", action="store_true",
                    help="with --gluon: its large-M kernel 'gluon_pipe' (default configs: the shipped "
                         "'gluon_pipe' ones): one chunk's wgmmas in flight while the next is dequantized")
    args = ap.parse_args(argv)
    if args.pipe and (args.overlap or not args.gluon):
        ap.error("--pipe goes with --gluon and without --overlap")
    from ..tuning import Config

    if args.config:
        cfgs = []
        for c in args.config:
            v = [int(t) for t in c.split(",") if t.strip().lstrip("-").isdigit()]
            if len(v) != 6 or len(c.split(",")) != 6:
                ap.error(f"--config {c!r}: want BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages")
            cfgs.append(("cli", Config(v[0], v[1], v[2], SPLIT_K=v[3], num_warps=v[4], num_stages=v[5])))
    elif args.family.startswith("w4a8"):
        cfgs = [(args.family, Config(*t[:3], SPLIT_K=t[3], num_warps=t[4], num_stages=t[5])) for t in W4A8_TILES
                if args.family == "w4a8" or args.group_size == -1 or t[2] <= args.group_size]
    else:
        cfgs = shipped_mma_configs("gemv" if args.gemv else "gluon_pipe" if args.pipe else "gluon" if args.gluon
                                   else "mma")
    if args.gemv:
        return _main_gemv(cfgs, args)
    if args.gluon:
        return _main_gluon(cfgs, args)
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
        hz, verdict = _hazard_and_dump(k, args, verdict)
        bad += st.roundtrip or hz
        print(f"{tag}: st.shared={st.st_shared} ldmatrix={st.ldmatrix} bar.sync={st.bar_sync} "
              f"wgmma={st.wgmma} A-in-registers={st.wgmma_a_in_registers} [{verdict}]")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
