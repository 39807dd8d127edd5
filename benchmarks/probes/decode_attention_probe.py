"""Decode attention: sailfish::decode_attention against transformers' sdpa path on the shapes the
e2e benchmark decodes (issue 39: at batch 16 the rest of the 8B step, mostly attention over the
1024-token static cache, was 14.2 of 16.6 ms in a CUDA graph, perf_log v43).

Prediction (written before any GPU run): Llama-3-8B (32 / 8 heads of 128), 1024 cached tokens:
the limit is K and V read once, 4 MB a layer at batch 1 (~1.3 us at 3.3 TB/s, so launch-bound:
~4-5 us with the split combine), 67 MB at batch 16 (~20 us; the kernel ~25 us). transformers'
sdpa path under compile / in graphs copies K and V to 32 heads (repeat_kv: 4x the bytes written
and read again) before sdpa: expected >= 100 us a layer at batch 16, i.e. 3+ ms of the 32-layer
step, which the kernel would take down to ~0.8 ms.

    PYTHONPATH=src python benchmarks/probes/decode_attention_probe.py [--batches 1,4,16,64] [--context 1024,4096]
        [--heads 32,8] [--json out.json]

Per (batch, context): one call's share of a CUDA graph of --graph-calls calls, median of --rounds
interleaved rounds (us), for
  sdpa     transformers' sdpa_attention_forward as a decode step calls it under torch.compile
           (repeat_kv, then torch's sdpa with the boolean mask)
  eager    transformers' sdpa_attention_forward as the installed release runs it eagerly (5.17:
           repeat_kv; later releases fold the query heads instead, pack_gqa)
  sailfish sailfish::decode_attention (the op, as the model's attention function calls it)
and the limit (K + V bytes at the --copy-gbps rate, default: measured device-to-device copy), with
each path's fraction of it. The outputs are checked against the fp32 reference first (the script
stops if the kernel's max error exceeds 2 ** -8 of max |v|). Needs CUDA.
"""
import argparse
import json

import torch

from sailfish.bench.timing import hbm_ceiling_gbps, interleaved_graph_times_us
from sailfish.ops.attention import decode_attention, decode_attention_reference


class _Module(torch.nn.Module):  # what sdpa_attention_forward reads of the attention module
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--context", default="1024,4096")
    ap.add_argument("--heads", default="32,8", help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copy-gbps", type=float, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from transformers.integrations import sdpa_attention as S

    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    hq, hkv = (int(x) for x in a.heads.split(","))
    D = a.head_dim
    gbps = a.copy_gbps or hbm_ceiling_gbps()
    module = _Module(hq // hkv)
    scale = D ** -0.5
    rows = []
    print(f"{torch.cuda.get_device_name()}  heads {hq}/{hkv} x {D} {a.dtype}  copy {gbps:.0f} GB/s")
    print(f"{'batch':>5} {'ctx':>5} {'limit':>7} {'sdpa':>8} {'eager':>8} {'sailfish':>8}  fraction of the limit")
    for L in (int(x) for x in a.context.split(",")):
        for B in (int(x) for x in a.batches.split(",")):
            g = torch.Generator(device="cuda").manual_seed(B * 7 + L)
            q = torch.randn(B, hq, 1, D, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(B, hkv, L, D, device="cuda", dtype=dtype, generator=g)
            v = torch.randn(B, hkv, L, D, device="cuda", dtype=dtype, generator=g)
            mask = torch.ones(B, 1, 1, L, device="cuda", dtype=torch.bool)
            mask[:, :, :, L - 3:] = False  # (the static cache's unwritten tail)
            ref = decode_attention_reference(q, k, v, mask, scale)
            got = decode_attention(q, k, v, mask, scale)
            err = (got.float() - ref.float()).abs().max().item()
            if not err <= 2 ** -8 * v.abs().max().item():
                raise SystemExit(f"decode_attention off the reference by {err} at batch {B}, context {L}")

            def sdpa():  # the compiled model's path: repeat_kv, then torch's sdpa with the mask
                kr, vr = S.repeat_kv(k, hq // hkv), S.repeat_kv(v, hq // hkv)
                return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=scale)

            def eager():  # sdpa_attention_forward as the installed transformers runs it eagerly
                return S.sdpa_attention_forward(module, q, k, v, mask, scaling=scale)[0]

            def ours():
                return decode_attention(q, k, v, mask, scale)

            t = interleaved_graph_times_us({"sdpa": sdpa, "eager": eager, "sailfish": ours}, a.graph_calls, a.rounds)
            limit = 2 * k.numel() * k.element_size() / (gbps * 1e3)
            row = {"batch": B, "context": L, "heads": [hq, hkv], "head_dim": D, "dtype": a.dtype, "limit_us": limit,
                   "max_err": err, **{f"{n}_us": x for n, x in t.items()}}
            rows.append(row)
            print(f"{B:5d} {L:5d} {limit:7.2f} {t['sdpa']:8.2f} {t['eager']:8.2f} "
                  f"{t['sailfish']:8.2f}  sdpa {limit / t['sdpa']:.2f}, sailfish {limit / t['sailfish']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": gbps, "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
