"""The MoE benchmark's vllm-triton-moe peer (bench/moe_peers.py): vLLM's Triton W4A16 MoE kernel
from an uncommitted file (.peers/vllm_moe_wna16.py). Without the file (CI) the kernel tests are
skipped and the benchmark skips the column with one line."""
import json
import os

import pytest
import torch

from test_moe import assert_moe_close, make_problem, moe_bound
from sailfish.bench import moe as B
from sailfish.bench.moe_peers import KERNEL, PEER_FILE, VllmExperts, default_peers_dir, load_vllm

HAVE_PEER = os.path.isfile(os.path.join(default_peers_dir(), PEER_FILE))
needs_peer = pytest.mark.skipif(not HAVE_PEER, reason=f"no {os.path.join(default_peers_dir(), PEER_FILE)} "
                                                      "(vLLM's kernel is not shipped with Sailfish)")


@needs_peer
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("M", [1, 3])  # M = 1: vLLM's (BLOCK_SIZE_N, K) = (32, 64) for gate_up; else (64, 32)
def test_vllm_peer_per_element(M, dtype, device):
    """The peer block on the re-packed Sailfish experts is the MoE block on the same effective
    weights: every element within moe_bound (as Sailfish's own kernel, tests/test_moe.py, with
    the silu rounding of its silu_and_mul step)."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("Triton's interpreter computes bf16 on raw bits (kernels/common.py); the peer cannot emulate")
    E, topk, H, I, gs = 4, 2, 256, 128, 128
    mod, why = load_vllm(None, device == "cuda", dtype, gs)
    assert mod is not None, why
    args, w13, w2 = make_problem(E, topk, M, H, I, gs, True, dtype, device)
    x, ids, tw = args[:3]
    y = VllmExperts(mod, w13, w2).block_fn(M, topk)(x, ids, tw)
    assert y.shape == (M, H) and y.dtype == dtype
    ref, bound = moe_bound(x.cpu(), ids.cpu(), tw.cpu(), w13.dequantize().cpu(), w2.dequantize().cpu(), dtype,
                           silu_rounded=True)  # (sailfish::silu_mul, as vLLM's silu_and_mul)
    assert_moe_close(y.cpu(), ref, bound)


@needs_peer
@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs on the CPU (Triton's interpreter)")
def test_bench_checks_and_times_the_peer(tmp_path):
    """--kernels vllm-triton-moe: the bench checks it against the reference like its other kernels
    and writes its rows."""
    out = tmp_path / "moe.json"
    rc = B.main(["--smoke", "--dtype", "fp16", "--models", "tiny", "--m", "3", "--routing", "uniform",
                 "--kernels", f"sailfish-moe-w4a16,{KERNEL}", "--replays", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0
    assert [(c["kernel"], c["ok"]) for c in doc["checks"]] == [("sailfish-moe-w4a16", True), (KERNEL, True)]
    row = [r for r in doc["rows"] if r["kernel"] == KERNEL]
    assert len(row) == 1 and row[0]["M"] == 3 and row[0]["time_us"] > 0
    assert (row[0]["dtype"], row[0]["group_size"]) == ("fp16", 128)


def test_missing_peer_file_is_one_skip_line(tmp_path, capsys):
    """No peer file: one printed line naming the path, no error, no rows for the peer."""
    out = tmp_path / "moe.json"
    rc = B.main(["--smoke", "--models", "tiny", "--m", "1", "--routing", "uniform", "--kernels", KERNEL,
                 "--peers", str(tmp_path), "--out", str(out)])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if KERNEL in ln]
    assert lines == [f"{KERNEL}: skipped, no {tmp_path / PEER_FILE} (vLLM's fused_moe_kernel_gptq_awq is not "
                     "shipped with Sailfish; put it there or pass --peers DIR)"]
    assert json.loads(out.read_text())["rows"] == []
