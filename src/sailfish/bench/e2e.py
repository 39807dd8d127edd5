"""End-to-end decode and prefill benchmark on Llama-3 shapes: the tokens per second that a
`transformers` user gets from Sailfish's layers.

    python -m sailfish.bench.e2e                               # Llama-3-8B, default variants, all modes, batches 1,4,16,64
    python -m sailfish.bench.e2e --batches 1,16 --variants fp16,w4a16,w4a8    # --budget-s 400: ~7-8 min
    python -m sailfish.bench.e2e --batches 1,16 --variants fp16,w4a16,w4a16-unfused,w4a8,w4a8-unfused  # fusion's gain
    python -m sailfish.bench.e2e --model 70b --layers 8        # 70B layer shapes, 8 of its 80 layers
    python -m sailfish.bench.e2e --model qwen3-moe             # Qwen3-30B-A3B shapes (MoE), 8 of 48 layers, bf16
    python -m sailfish.bench.e2e --model deepseek-v2-lite      # DeepSeek-V2-Lite shapes (MLA, 2 shared experts), 8 of 27
    python -m sailfish.bench.e2e --quick                       # 4 layers of the 8B, batches 1,16
    python -m sailfish.bench.e2e --device cpu                  # tiny model: every code path, times meaningless

Models: transformers' LlamaForCausalLM from a LlamaConfig (Qwen3MoeForCausalLM for qwen3-moe and
tiny-moe: 128 experts of width 768, top-8, experts run by transformers' grouped_mm; quantized:
sailfish.QuantExperts; DeepseekV2ForCausalLM for deepseek-v2-lite and tiny-deepseek: multi-head
latent attention, 64 routed experts of width 1408, top-6, 2 shared experts, which the quantized
model runs inside its QuantExperts, the first layer dense) with random weights (nothing is downloaded), sdpa attention,
transformers' StaticCache. Variants, converted with
sailfish.quantize_model (lm_head stays in the model dtype, except in w4a16-lmhead): fp16, bf16,
w4a16 (sym, group 128, fp16), w4a16-asym-bf16 (asym, group 128, bf16: the GPTQ format), w4a8 (int8 per-token
activations, group 128, fp16). The quantized variants run q/k/v and gate/up fused (one layer
each, quantize_model's default); w4a16-unfused and w4a8-unfused (fuse=False, not run unless
named in --variants or "all") run the seven projections separately.

Decode step: model(ids) on a (batch, 1) token buffer, argmax, written back into the buffer
(greedy decoding with no host synchronisation). The cache holds --context tokens and the steps
run at its last positions; as in transformers, attention reads the whole static cache (masked).
Modes:
  eager    no CUDA graph: median of --steps calls timed with CUDA events, per-call host overhead
           included, as generate() users see it (generate adds its own Python per token);
  graph    the same step captured in one CUDA graph: median of --replays replays;
  compile  torch.compile(step, mode=--compile-mode, fullgraph=True, dynamic=False), then
           captured in one CUDA graph as in `graph` (not mode="reduce-overhead": the graph is
           ours, so the time is the device time of the compiled step, comparable to `graph`);
  generate (not run unless named in --modes or "all") transformers' own generation loop:
           model.generate(prompt, cache_implementation="static", max_cache_len=--context,
           greedy), which on CUDA compiles the decode forward itself (its default CompileConfig;
           on a model Sailfish converted, through sailfish.generation's DecodeGraphs:
           "compiled_call", with the stop check deferred a step: "stop_check"); the time per
           token is (wall time of --gen-tokens + 4 new tokens - that of 4) / --gen-tokens,
           median of 7 each after two warm-up calls: prefill and compilation cancel out, the
           generate loop's own Python per token stays in, as a generate() user sees it.
Per layer = (step - head) / layers run, head = embedding + final norm + lm_head + argmax timed
in its own CUDA graph; whole model = head + per layer x the model's layers, which is the step
itself unless --layers cuts the model (then marked "extrapolated"). tokens/s = batch / whole-
model step. Speedups: against fp16 (and bf16) of the same process, mode and batch.

Also measured: prefill of a --prefill-token prompt (batch 1, no graph, median of 3); weight bytes
of each variant and the transient memory of a step (peak minus resident); the split of the
graph step into decoder linear layers / head / the rest (attention, norms, rotary, KV-cache
update), each part timed in its own CUDA graph; a correctness line per variant: logits finite,
and next-token agreement with a model of the same dtype holding the dequantized weights in
nn.Linear layers, over --check-steps greedy steps at batch --check-batch (on CUDA, for a fused
variant, also with the same variant unfused).

--budget-s (default 400 s on CUDA; 0 = none) bounds the run. Order: build, eager, graph, split,
prefill, correctness for each variant, then the compile units (each variant rebuilt); a unit
whose estimated time no longer fits is skipped and listed. The JSON is rewritten after every
unit, so an interrupted run keeps what finished.

Writes <out-dir>/<name>.json and <name>_tokens.png; default name
e2e_<gpu>_<model>[_L<layers>][_<variants>][_<modes>] (the last two when not all).
Without CUDA (or --device cpu): the tiny model, eager mode, Sailfish's Triton kernels in Triton's
interpreter (TRITON_INTERPRET=0 in the environment: the PyTorch reference ops instead); every
step runs and is recorded but the times are meaningless (timings_meaningful: false); files are
written only with --out-dir or --name. Exit status: 0 ok, 1 a unit failed or a correctness line
is bad, 2 nothing could run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import gc
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from .shapes import parse_ints
from .llama import DEFAULT_VARIANTS, MODELS, MOE_DEFAULT_VARIANTS, VARIANTS

MODES = ("eager", "graph", "compile", "generate")
DEFAULT_MODES = MODES[:3]
MODE_TITLES = {"eager": "eager, no graph", "graph": "eager ops, one CUDA graph",
               "compile": "torch.compile + one CUDA graph",
               "generate": "model.generate(), static cache (transformers' own compile)"}
GEN_PROMPT = 16  # prompt tokens of the generate mode (CPU: 4)
GEN_SHORT = 4  # new tokens of its short call
DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_70B_LAYERS = 8
DEFAULT_LAYERS = {"70b": DEFAULT_70B_LAYERS, "qwen3-moe": 8, "deepseek-v2-lite": 8}  # run extrapolated by default
QUICK = dict(layers=4, batches=(1, 16), variants=("fp16", "w4a16", "w4a8"), prefill=512)
CPU = dict(model="tiny", context=32, batches=(1, 2), prefill=16, warmup=0, steps=1, prefill_reps=1, gen_tokens=2,
           check_batch=2, check_steps=2, check_prompt=8)
GPU_BUDGET_S = 400.0
# Correctness gate: W4A16 multiplies by exactly the reference's weights, so only accumulation
# order and output rounding differ and nearly every greedy token must agree. W4A8 also
# quantizes the activations, which the reference does not: reported, not gated.
MIN_AGREEMENT_W4A16 = 0.9


# ----------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------
def default_variants(model: str):
    """What runs without --variants: the MoE models run bf16 (transformers' grouped_mm experts
    kernels are bf16 ones) against W4A16 in bf16."""
    return MOE_DEFAULT_VARIANTS if MODELS[model].moe else DEFAULT_VARIANTS


def parse_names(text: str, allowed: Sequence[str], what: str) -> List[str]:
    """'all' or a comma list of names from `allowed`; returned in `allowed` order."""
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if items == ["all"]:
        return list(allowed)
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"bad {what} {','.join(bad) or repr(text)}: choose from {', '.join(allowed)} (or all)")
    return [a for a in allowed if a in items]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sailfish.bench.e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default 8b (CPU: tiny)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers to build (default all; " + ", ".join(f"{m}: {n}" for m, n in DEFAULT_LAYERS.items())
                         + "); fewer than the "
                         "model's: whole-model numbers are extrapolated")
    ap.add_argument("--variants", default=None, help="comma list or all (default: all but the -unfused ones, w4a16-lmhead and w4a16-bf16; "
                    "MoE models: bf16,w4a16-bf16): "
                    + ", ".join(VARIANTS))
    ap.add_argument("--modes", default=None,
                    help="comma list of eager, graph, compile, generate, or all (default eager, graph, compile; "
                         "CPU: eager)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,4,16,64; --quick 1,16; CPU 1,2)")
    ap.add_argument("--context", type=int, default=None, help="StaticCache length in tokens (default 1024; CPU 32)")
    ap.add_argument("--prefill", type=int, default=None, help="prefill prompt tokens, 0 = none (default 2048; CPU 16)")
    ap.add_argument("--warmup", type=int, default=None, help="eager steps before timing (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="timed eager steps (default 20)")
    ap.add_argument("--replays", type=int, default=20, help="timed CUDA graph replays (default 20, >= 3)")
    ap.add_argument("--gen-tokens", type=int, default=None,
                    help="tokens timed per generate() call in the generate mode (default 64; CPU 2)")
    ap.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
                    help="mode= of torch.compile in the compile mode (default: default)")
    ap.add_argument("--check-batch", type=int, default=None, help="correctness batch (default 4; CPU 2)")
    ap.add_argument("--check-steps", type=int, default=None, help="correctness greedy steps (default 16; CPU 2)")
    ap.add_argument("--check-prompt", type=int, default=None, help="correctness prompt tokens (default 64; CPU 8)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness lines")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"time budget in seconds, 0 = none (default {GPU_BUDGET_S:.0f} on CUDA, none on CPU)")
    ap.add_argument("--quick", action="store_true",
                    help="4 layers of the model, batches 1,16, fp16/w4a16/w4a8, 512-token prefill")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: CUDA when available, else the CPU check")
    ap.add_argument("--out-dir", default=None, help="where to write results (default benchmarks/results)")
    ap.add_argument("--name", default=None,
                    help="file stem (default e2e_<gpu>_<model>[_L<layers>][_<variants>][_<modes>])")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG")
    ap.add_argument("--seed", type=int, default=0, help="weights and token seed")
    return ap


@dataclass
class Settings:
    cuda: bool
    model: str
    layers: int
    variants: List[str]
    modes: List[str]
    batches: List[int]
    context: int
    prefill: int
    prefill_reps: int
    warmup: int
    steps: int
    replays: int
    gen_tokens: int
    compile_mode: str
    check: bool
    check_batch: int
    check_steps: int
    check_prompt: int
    budget_s: float
    seed: int

    @property
    def full_layers(self) -> int:
        return MODELS[self.model].layers

    @property
    def extrapolated(self) -> bool:
        return self.layers < self.full_layers

    @property
    def gen_prompt(self) -> int:
        return GEN_PROMPT if self.cuda else 4

    @property
    def gen_long(self) -> int:
        """New tokens of the generate mode's long call (its short call makes GEN_SHORT)."""
        return GEN_SHORT + self.gen_tokens

    def reserve(self) -> int:
        """Cache positions the longest mode consumes (at most): eager warmup + 1 (memory) + steps;
        graph 1 + 1 (side-stream warm-up) + 2 + replays; compile one more (two calls before
        capture). The steps start at context - reserve."""
        return max(self.warmup + 1 + self.steps, 5 + self.replays) + 2


def resolve(args, cuda: bool, ap: argparse.ArgumentParser) -> Settings:
    q = args.quick
    cpu = {} if cuda else CPU
    model = args.model or cpu.get("model", "8b")
    full = MODELS[model].layers
    layers = args.layers if args.layers is not None else (
        min(full, QUICK["layers"]) if q else DEFAULT_LAYERS.get(model, full))
    try:
        variants = parse_names(args.variants, list(VARIANTS), "variant") if args.variants else (
            list(QUICK["variants"]) if q else list(default_variants(model)))
        modes = parse_names(args.modes, MODES, "mode") if args.modes else (list(DEFAULT_MODES) if cuda else ["eager"])
        batches = parse_ints(args.batches, "batch", ", comma separated") if args.batches else list(
            cpu.get("batches") or (QUICK["batches"] if q else DEFAULT_BATCHES))
    except ValueError as e:
        ap.error(str(e))

    def pick(value, key, default):
        return value if value is not None else cpu.get(key, default)

    s = Settings(cuda=cuda, model=model, layers=layers, variants=variants, modes=modes, batches=batches,
                 context=pick(args.context, "context", 1024),
                 prefill=pick(args.prefill, "prefill", QUICK["prefill"] if q else 2048),
                 prefill_reps=cpu.get("prefill_reps", 3), warmup=pick(args.warmup, "warmup", 3),
                 steps=pick(args.steps, "steps", 20), replays=args.replays,
                 gen_tokens=pick(args.gen_tokens, "gen_tokens", 64), compile_mode=args.compile_mode,
                 check=not args.no_check, check_batch=pick(args.check_batch, "check_batch", 4),
                 check_steps=pick(args.check_steps, "check_steps", 16),
                 check_prompt=pick(args.check_prompt, "check_prompt", 64),
                 budget_s=args.budget_s if args.budget_s is not None else (GPU_BUDGET_S if cuda else 0.0),
                 seed=args.seed)
    minimum = {"--layers": (s.layers, 1), "--warmup": (s.warmup, 0), "--steps": (s.steps, 1),
               "--replays": (s.replays, 3), "--gen-tokens": (s.gen_tokens, 1), "--prefill": (s.prefill, 0), "--check-batch": (s.check_batch, 1),
               "--check-steps": (s.check_steps, 1), "--check-prompt": (s.check_prompt, 1),
               "--budget-s": (s.budget_s, 0)}
    for flag, (value, low) in minimum.items():
        if value < low:
            ap.error(f"{flag}={value} is not allowed: use >= {low}")
    if s.layers > full:
        ap.error(f"--layers={s.layers} is more than {MODELS[model].name} has ({full})")
    if s.context <= s.reserve():
        ap.error(f"--context={s.context} is too short: the timed steps use the last {s.reserve()} "
                 "positions of the cache (fewer --steps/--replays/--warmup, or a longer context)")
    if "generate" in s.modes and s.extrapolated:
        ap.error(f"the generate mode needs all {full} layers of the model (--layers {full}): generate()'s "
                 "own per-token host time is not a per-layer cost, so it cannot be extrapolated")
    if "generate" in s.modes and s.context < s.gen_prompt + s.gen_long:
        ap.error(f"--context={s.context} is too short for the generate mode: it needs {s.gen_prompt} prompt + "
                 f"{s.gen_long} new tokens (fewer --gen-tokens, or a longer context)")
    return s


# ----------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.monotonic()

    def left(self) -> float:
        return float("inf") if not self.seconds else self.seconds - (time.monotonic() - self.t0)


@dataclass
class Results:
    variants: Dict[str, dict] = field(default_factory=dict)
    decode: List[dict] = field(default_factory=list)
    split: List[dict] = field(default_factory=list)
    prefill: List[dict] = field(default_factory=list)
    correctness: List[dict] = field(default_factory=list)
    skipped: List[dict] = field(default_factory=list)
    errors: List[dict] = field(default_factory=list)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


class Runner:
    """Runs the units (build, eager, graph, split, prefill, check, compile) of each variant,
    within the budget, recording into `res`; `save()` is called after every unit."""

    # First guesses (s) until a unit of the kind has run; compile scales with the layers.
    GUESS = {"build": 20.0, "eager": 5.0, "graph": 5.0, "split": 5.0, "prefill": 5.0, "check": 20.0,
             "generate": 60.0}

    def __init__(self, s: Settings, device, prog, save: Callable[[], None]):
        self.s, self.device, self.prog, self.save = s, device, prog, save
        self.res = Results()
        self.budget = Budget(s.budget_s)
        self.estimate = dict(self.GUESS, compile=15.0 + 1.5 * s.layers)
        self.base = None

    # -- bookkeeping ------------------------------------------------------------------
    def _free(self) -> None:
        import torch

        gc.collect()
        if self.s.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def unit(self, kind: str, variant: str, batch: Optional[int], fn: Callable[[], object]):
        """Run one unit if it fits the budget; returns fn's result or None (skipped/failed)."""
        where = f"{variant} {kind}" + (f" batch {batch}" if batch is not None else "")
        left, est = self.budget.left(), self.estimate[kind]
        if left < est:
            self.res.skipped.append({"variant": variant, "unit": kind, "batch": batch,
                                     "reason": f"budget: {max(0.0, left):.0f} s of --budget-s left, "
                                               f"~{est:.0f} s needed"})
            self.prog.step()
            return None
        self.prog.set_status(where)
        if not self.prog.tty and kind in ("build", "compile", "check"):
            self.prog.line(f"... {where}")
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - one unit must not end the run
            self.res.errors.append({"variant": variant, "unit": kind, "batch": batch, "error": _short(e)})
            self.prog.line(f"FAIL {where}: {_short(e)}", counted=True)
            out = None
            self._free()
        else:
            self.estimate[kind] = time.monotonic() - t0
        self.prog.step()
        self.save()
        return out

    def skip_all(self, kind: str, reason: str) -> None:
        self.res.skipped.append({"variant": "all", "unit": kind, "batch": None, "reason": reason})

    # -- models -----------------------------------------------------------------------
    def base_in(self, dtype):
        """The random base model in `dtype`: built in fp16 from the seed; converted in place
        to bf16 for the bf16 variants; rebuilt from the seed when fp16 is needed again."""
        import torch

        from .llama import base_dtype, build_model

        if self.base is not None and base_dtype(self.base) != dtype:
            if dtype == torch.bfloat16:
                self.base.to(torch.bfloat16)
            else:
                self.base = None
                self._free()
        if self.base is None:
            self.base = build_model(MODELS[self.s.model], self.s.layers, self.device, seed=self.s.seed)
            if dtype != torch.float16:
                self.base.to(dtype)
        return self.base

    def build(self, name: str):
        from .llama import decoder_linears, make_variant, tensor_bytes

        v = VARIANTS[name]
        t0 = time.monotonic()
        model = make_variant(self.base_in(v.dtype), v)
        if self.s.cuda:
            import torch
            torch.cuda.synchronize()
        report = getattr(model, "sailfish_report", None)
        info = {"label": v.label, "dtype": str(v.dtype).replace("torch.", ""), "quant": v.quant,
                "build_s": round(time.monotonic() - t0, 3), "weight_bytes": tensor_bytes(model),
                "decoder_linear_bytes": sum(tensor_bytes(m) for _, m in decoder_linears(model)),
                "quantized_layers": None if report is None else len(report["quantized"]),
                "experts_modules": None if report is None else len(report.get("experts", [])),
                "skipped_layers": None if report is None else report["skipped"],
                "fused_layers": None if report is None else sorted(report.get("fused", {})),
                "shared_experts_folded": None if report is None else report.get("shared_experts_folded", []),
                "not_fused": None if report is None else report.get("not_fused", {}),
                "row_ops": None if report is None else {k: len(v) for k, v in report.get("row_ops", {}).items()}}
        self.res.variants.setdefault(name, info)
        return model

    # -- measurement units ----------------------------------------------------------------
    def _decoder(self, model, batch: int):
        from .llama import Decoder

        dec = Decoder(model, batch, self.s.context, seed=self.s.seed)
        dec.seek(self.s.context - self.s.reserve())
        return dec

    def _check_position(self, dec) -> None:
        if dec.position() > self.s.context:  # by construction never; a CUDA error would come first
            raise RuntimeError(f"decode ran past the cache: position {dec.position()} > {self.s.context}")

    def eager(self, model, batch: int) -> dict:
        from .timing import call_times_us, transient_bytes

        dec = self._decoder(model, batch)
        for _ in range(self.s.warmup):
            dec.step()
        transient = transient_bytes(dec.step, self.s.cuda)
        times = call_times_us(dec.step, self.s.steps, self.s.cuda)
        self._check_position(dec)
        return {"step_us": statistics.median(times), "transient_bytes": transient,
                "timing": f"median of {self.s.steps} calls ({'CUDA events' if self.s.cuda else 'wall clock'}), "
                          f"after {self.s.warmup} warm-up steps"}

    def graph(self, model, batch: int, fn_of=None) -> dict:
        from .timing import graph_time_us

        dec = self._decoder(model, batch)
        fn = dec.step if fn_of is None else fn_of(dec)
        fn()  # outside any capture: config autotuning, compilation, allocator warm-up
        us = graph_time_us([fn], replays=self.s.replays)
        self._check_position(dec)
        return {"step_us": us, "timing": f"one CUDA graph, median of {self.s.replays} replays"}

    def compile(self, model, batch: int) -> dict:
        import torch

        state: dict = {}

        def compiled(dec):
            torch._dynamo.reset()  # a fresh cache per model and batch (no recompile limit, no stale guards)
            t0 = time.monotonic()
            try:
                fn = torch.compile(dec.step, fullgraph=True, dynamic=False, mode=self.s.compile_mode)
                fn()
                state["fullgraph"] = True
            except Exception as e:  # noqa: BLE001 - a graph break: compile what can be
                state.update(fullgraph=False, note=f"fullgraph=True failed ({_short(e)}); compiled with graph breaks")
                torch._dynamo.reset()
                dec.seek(self.s.context - self.s.reserve())
                fn = torch.compile(dec.step, fullgraph=False, dynamic=False, mode=self.s.compile_mode)
                fn()
            torch.cuda.synchronize()
            state["compile_s"] = round(time.monotonic() - t0, 2)
            return fn

        try:
            out = self.graph(model, batch, fn_of=compiled)
        finally:
            torch._dynamo.reset()
        out.update(state, compile_mode=self.s.compile_mode)
        return out

    def generate(self, model, batch: int) -> dict:
        """Time per new token of transformers' generate() with cache_implementation="static" and
        max_cache_len --context (a new StaticCache every call, as a user's generate() makes it; on
        CUDA it compiles the decode forward itself): the difference of a long and a short
        call, each the median of 7 after two warm-up calls of the long one (3 left the host's
        jitter in: 3.0 and 4.0 ms a token for the same step in two runs, docs/perf_log.md v48)."""
        import torch

        from ..generation import DecodeGraphs, Generate

        s = self.s
        gen = torch.Generator().manual_seed(s.seed)
        prompt = torch.randint(model.config.vocab_size, (batch, s.gen_prompt), generator=gen).to(self.device)
        had_compiled = hasattr(model, "_compiled_call")

        def call(n: int) -> float:
            if s.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(prompt, cache_implementation="static", max_cache_len=s.context, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
            if s.cuda:
                torch.cuda.synchronize()
            if out.shape[1] != s.gen_prompt + n:
                raise RuntimeError(f"generate() made {out.shape[1] - s.gen_prompt} tokens, {n} were asked")
            return (time.perf_counter() - t0) * 1e6

        torch._dynamo.reset()
        try:
            for _ in range(2 if s.cuda else 1):
                call(s.gen_long)
            reps = 7 if s.cuda else 3  # (CPU: a median of 3, a single call of each was noise-bound in CI)
            long_us = statistics.median(call(s.gen_long) for _ in range(reps))
            short_us = statistics.median(call(GEN_SHORT) for _ in range(reps))
            compiled = hasattr(model, "_compiled_call") and not had_compiled
            runner = model.__dict__.get("_compiled_call")
            graphs = isinstance(runner, DecodeGraphs)
            calls = dict(runner.stats) if graphs else None
        finally:
            torch._dynamo.reset()
            if hasattr(model, "_compiled_call") and not had_compiled:
                del model._compiled_call  # (its graphs hold the model's memory)
        if long_us <= short_us:
            raise RuntimeError(f"generate() of {s.gen_long} tokens took no longer than of {GEN_SHORT} "
                               f"({long_us:.0f} vs {short_us:.0f} us): timing noise; use more --gen-tokens")
        return {"step_us": (long_us - short_us) / s.gen_tokens, "compiled_by_generate": compiled,
                "compiled_call": "sailfish DecodeGraphs" if graphs else "transformers (reduce-overhead)",
                "decode_graph_calls": calls,
                "stop_check": ("deferred a step (sailfish Generate)" if isinstance(model.__dict__.get("generate"), Generate)
                               else "every token (transformers)"),
                "timing": f"(median of {reps} generate() calls of {s.gen_long} new tokens - median of {reps} of "
                          f"{GEN_SHORT}) / {s.gen_tokens}, wall clock, prompt {s.gen_prompt}, greedy"}

    def split(self, model, batch: int) -> dict:
        """Decoder linear layers alone, and the head alone, each in its own CUDA graph."""
        import torch

        from .llama import base_dtype, decoder_experts, decoder_linears
        from .timing import graph_time_us

        dtype = base_dtype(model)
        lins = [m for _, m in decoder_linears(model)]
        xs = {k: torch.randn(batch, k, dtype=dtype, device=self.device) for k in {m.in_features for m in lins}}
        calls = [functools.partial(m, xs[m.in_features]) for m in lins]
        for c in calls:
            c()
        linears_us = graph_time_us(calls, replays=self.s.replays) * len(calls)
        experts = decoder_experts(model)
        experts_us = None
        if experts:  # every MoE block's experts on one fixed uniform routing (the router is a linear above)
            shape = MODELS[self.s.model]
            gen = torch.Generator().manual_seed(self.s.seed)
            ids = torch.rand(batch, shape.experts, generator=gen).topk(shape.topk, dim=1).indices.to(self.device)
            w = torch.softmax(torch.randn(batch, shape.topk, generator=gen), -1).to(self.device, dtype)
            x = torch.randn(batch, shape.hidden, dtype=dtype, device=self.device)
            calls = [functools.partial(m, x, ids, w) for m in experts]
            for c in calls:
                c()
            experts_us = graph_time_us(calls, replays=self.s.replays) * len(calls)
        ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        emb, norm, head = model.get_input_embeddings(), model.model.norm, model.lm_head

        def head_fn():
            return head(norm(emb(ids))).argmax(-1)

        head_fn()
        head_us = graph_time_us([head_fn], replays=self.s.replays)
        return {"linears_us": linears_us, "linear_calls": len(lins), "head_us": head_us,
                **({"experts_us": experts_us, "experts_calls": len(experts)} if experts else {})}

    def prefill(self, model) -> dict:
        import torch

        from .llama import Decoder
        from .timing import call_times_us, transient_bytes

        n = self.s.prefill
        dec = Decoder(model, 1, n, seed=self.s.seed)
        gen = torch.Generator().manual_seed(self.s.seed)
        ids = torch.randint(model.config.vocab_size, (1, n), generator=gen).to(self.device)

        def run():
            return dec.forward(ids)

        def rewind():
            dec.seek(0)

        if self.s.cuda:  # warm-up: config autotuning at M = n, the allocator
            rewind()
            run()
        rewind()
        transient = transient_bytes(run, self.s.cuda)
        times = call_times_us(run, self.s.prefill_reps, self.s.cuda, before=rewind)
        return {"tokens": n, "batch": 1, "time_us": statistics.median(times), "transient_bytes": transient,
                "timing": f"no graph, median of {self.s.prefill_reps} ({'CUDA events' if self.s.cuda else 'wall clock'})"}

    def check(self, name: str, model) -> dict:
        from .llama import dequantized_reference, greedy_agreement

        v = VARIANTS[name]
        ref = dequantized_reference(model, self.base_in(v.dtype)) if v.quant is not None else None
        try:
            out = greedy_agreement(model, ref, batch=self.s.check_batch, prompt=self.s.check_prompt,
                                   steps=self.s.check_steps, seed=self.s.seed)
        finally:
            ref = None  # the reference holds a dense copy of the weights: free it now
        gate = MIN_AGREEMENT_W4A16 if v.quant is not None and v.quant.get("act_bits", 16) == 16 else None
        ok = out["logits_finite"] and out.get("ref_logits_finite", True) and (
            gate is None or out["agreement"] >= gate)
        out.update(reference=(f"{str(v.dtype)[6:]} model, nn.Linear layers holding the dequantized weights"
                              if v.quant is not None else "none (not quantized: its own reference)"),
                   min_agreement=gate, ok=bool(ok))
        if self.s.cuda and v.quant is not None and v.quant.get("fuse", True):
            out["vs_unfused"] = self._vs_unfused(v, model)
        return out

    def _vs_unfused(self, v, model) -> dict:
        """Next-token agreement of a fused variant with the same variant unfused, on the same
        greedy run: the two differ only in the fused GEMMs' summation order (issue 39 asks
        >= 0.98; reported, not gated)."""
        import dataclasses

        from .llama import greedy_agreement, make_variant

        twin = make_variant(self.base_in(v.dtype), dataclasses.replace(v, quant={**v.quant, "fuse": False}))
        try:
            r = greedy_agreement(model, twin, batch=self.s.check_batch, prompt=self.s.check_prompt,
                                 steps=self.s.check_steps, seed=self.s.seed)
        finally:
            twin = None  # its quantized layers: free them now
        return {"agreement": r["agreement"], "logits_rel_err": r["logits_rel_err"]}

    # -- passes -----------------------------------------------------------------------
    def run(self) -> None:
        s = self.s
        if not s.cuda:
            for mode in ("graph", "compile"):
                if mode in s.modes:
                    self.skip_all(mode, "needs CUDA")
        for name in s.variants:
            self._variant(name, measure_units(s))
        if last_pass(s):  # the most expensive units last, each variant rebuilt
            for name in s.variants:
                self._variant(name, last_pass(s))

    def _variant(self, name: str, units: Sequence[tuple]) -> None:
        model = self.unit("build", name, None, lambda: self.build(name))
        if model is None:  # skipped or failed: so are its units
            for kind, batch in units:
                self.res.skipped.append({"variant": name, "unit": kind, "batch": batch,
                                         "reason": "the variant's build was skipped or failed"})
            self.prog.step(len(units))
            return
        run = {"eager": self.eager, "graph": self.graph, "compile": self.compile, "generate": self.generate,
               "split": self.split,
               "prefill": lambda m, _: self.prefill(m), "check": lambda m, _: self.check(name, m)}
        for kind, b in units:
            out = self.unit(kind, name, b, lambda: run[kind](model, b))
            if out is None:
                continue
            if kind in MODES:
                self._record_decode(name, kind, b, out)
            elif kind == "split":
                self.res.split.append(dict(variant=name, batch=b, **out))
            elif kind == "prefill":
                self.res.prefill.append(dict(variant=name, **out))
                self.prog.line(f"{name:<16} prefill  {out['tokens']} tokens  {out['time_us'] / 1e3:9.3f} ms",
                               counted=True)
            else:
                self.res.correctness.append(dict(variant=name, **out))
                self.prog.line(f"{name:<16} {correctness_line(out)}", counted=True)
        model = run = None
        self._free()

    def _record_decode(self, name: str, mode: str, batch: int, out: Optional[dict]) -> None:
        if out is None:
            return
        row = dict(variant=name, mode=mode, batch=batch, **out)
        self.res.decode.append(row)
        ref = "fp16" if "fp16" in self.s.variants or "bf16" not in self.s.variants else "bf16"
        base = next((r for r in self.res.decode if r["variant"] == ref and r["mode"] == mode
                     and r["batch"] == batch), None)
        vs = f"  {base['step_us'] / row['step_us']:5.2f}x {ref}" if base is not None and name != ref else ""
        self.prog.line(f"{name:<16} {mode:<8} batch {batch:<4} step {row['step_us'] / 1e3:9.3f} ms{vs}"
                       + (f"  (compiled in {row['compile_s']:.0f} s)" if "compile_s" in row else ""), counted=True)


def measure_units(s: Settings) -> List[tuple]:
    """(kind, batch) of the first pass's units after a variant's build, in run order."""
    units: List[tuple] = []
    for b in s.batches:
        units += [("eager", b)] if "eager" in s.modes else []
        units += [("graph", b), ("split", b)] if s.cuda and "graph" in s.modes else []
    return units + [("prefill", None)] * bool(s.prefill) + [("check", None)] * s.check


def last_pass(s: Settings) -> List[tuple]:
    """(kind, batch) of the second pass's units (compile on CUDA, generate), run after every
    variant's first pass with the variant rebuilt."""
    units = [("compile", b) for b in s.batches] if s.cuda and "compile" in s.modes else []
    return units + [("generate", b) for b in s.batches if "generate" in s.modes]


def progress_total(s: Settings) -> int:
    second = last_pass(s)
    return len(s.variants) * (1 + len(measure_units(s))) + (len(s.variants) * (1 + len(second)) if second else 0)


# ----------------------------------------------------------------------------------
# derived numbers, tables, files
# ----------------------------------------------------------------------------------
def derive(res: Results, s: Settings) -> None:
    """Per-layer and whole-model times, tokens/s and speedups (recomputed from the raw rows)."""
    head = {(r["variant"], r["batch"]): r["head_us"] for r in res.split}
    for r in res.decode:
        h = head.get((r["variant"], r["batch"]))
        if h is not None and h < r["step_us"]:
            per_layer = (r["step_us"] - h) / s.layers
            whole = h + per_layer * s.full_layers
            method = "(step - head) / layers; whole = head + per_layer * model layers"
        else:
            per_layer = r["step_us"] / s.layers
            whole = per_layer * s.full_layers
            method = "step / layers; whole = per_layer * model layers (no head timing)"
        r.update(per_layer_us=per_layer, whole_model_us=whole, extrapolated=s.extrapolated,
                 tokens_per_s=r["batch"] * 1e6 / whole, per_layer_method=method)
    for rows, key, t in ((res.decode, ("mode", "batch"), "whole_model_us"), (res.prefill, ("tokens",), "time_us")):
        for r in rows:
            for base in ("fp16", "bf16"):
                b = next((x for x in rows if x["variant"] == base and all(x[k] == r[k] for k in key)), None)
                r[f"speedup_vs_{base}"] = b[t] / r[t] if b is not None else None
    for r in res.prefill:
        r["tokens_per_s"] = r["tokens"] * 1e6 / r["time_us"]
    graph = {(r["variant"], r["batch"]): r["step_us"] for r in res.decode if r["mode"] == "graph"}
    for r in res.split:
        step = graph.get((r["variant"], r["batch"]))
        r["step_graph_us"] = step
        r["rest_us"] = None if step is None else step - r["linears_us"] - r["head_us"] - r.get("experts_us", 0.0)


def _ms(us) -> str:
    return "-" if us is None else f"{us / 1e3:.3f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _size(nbytes) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 0}f} {unit}"
    return f"{nbytes} B"


def _pct(part, whole) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.0f}%"


def summary(res: Results, s: Settings) -> str:
    """Markdown tables: decode, split, prefill, memory."""
    out = []
    base = "fp16" if "fp16" in s.variants or "bf16" not in s.variants else "bf16"  # the MoE runs: bf16
    modes = [m for m in MODES if any(r["mode"] == m for r in res.decode)]
    if modes:
        head = ["variant", "batch"] + [f"{m}: ms, tok/s, vs {base}" for m in modes]
        out += ["Decode step" + (f" (whole model extrapolated from {s.layers} of {s.full_layers} layers)"
                                 if s.extrapolated else "") + ":",
                "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in s.variants:
            for b in s.batches:
                cells = []
                for m in modes:
                    r = next((x for x in res.decode if (x["variant"], x["mode"], x["batch"]) == (name, m, b)), None)
                    cells.append("-" if r is None else
                                 f"{_ms(r['whole_model_us'])} ms, {r['tokens_per_s']:.0f}, {_x(r[f'speedup_vs_{base}'])}")
                if any(c != "-" for c in cells):
                    out.append(f"| {name} | {b} | " + " | ".join(cells) + " |")
    if res.split:
        moe = any("experts_us" in r for r in res.split)
        out += ["", f"Split of the graph step ({s.layers} layers; parts timed in their own CUDA graphs"
                + ("; experts: one fixed uniform routing" if moe else "") + "):",
                "| variant | batch | step ms | decoder linears | " + ("MoE experts | " if moe else "")
                + "embed+norm+lm_head+argmax | rest: attention, norms, rotary, cache" + (", routing" if moe else "")
                + " |", "|---|---|---|---|---|---|" + ("---|" if moe else "")]
        for r in res.split:
            st = r["step_graph_us"]
            ex = f"{_ms(r['experts_us'])} ms ({_pct(r['experts_us'], st)}) | " if moe else ""
            out.append(f"| {r['variant']} | {r['batch']} | {_ms(st)} | {_ms(r['linears_us'])} ms ({_pct(r['linears_us'], st)}) "
                       f"| {ex}{_ms(r['head_us'])} ms ({_pct(r['head_us'], st)}) | {_ms(r['rest_us'])} ms ({_pct(r['rest_us'], st)}) |")
        minor = [f"{r['variant']} b={r['batch']}" for r in res.split
                 if r["step_graph_us"] and r["linears_us"] + r.get("experts_us", 0.0) < 0.5 * r["step_graph_us"]]
        if minor:
            out.append("The decoder's linear layers" + (" and experts" if moe else "")
                       + " are under half of the step (the rest dominates) for: "
                       + ", ".join(minor))
    if res.prefill:
        out += ["", "Prefill (batch 1, no graph" + (f", {s.layers} layers" if s.extrapolated else "") + "):",
                f"| variant | tokens | ms | tokens/s | vs {base} |", "|---|---|---|---|---|"]
        for r in res.prefill:
            out.append(f"| {r['variant']} | {r['tokens']} | {_ms(r['time_us'])} | {r['tokens_per_s']:.0f} "
                       f"| {_x(r[f'speedup_vs_{base}'])} |")
    if res.variants:
        out += ["", "Memory" + (f" ({s.layers} layers)" if s.extrapolated else "") +
                ": weights, and the transient of one step (peak minus resident):",
                "| variant | weights | decoder linears | " + " | ".join(f"decode b={b}" for b in s.batches)
                + " | prefill |", "|" + "---|" * (4 + len(s.batches))]
        for name, v in res.variants.items():
            tr = {r["batch"]: r.get("transient_bytes") for r in res.decode if r["variant"] == name and r["mode"] == "eager"}
            pf = next((r.get("transient_bytes") for r in res.prefill if r["variant"] == name), None)
            out.append(f"| {name} | {_size(v['weight_bytes'])} | {_size(v['decoder_linear_bytes'])} | "
                       + " | ".join(_size(tr.get(b)) for b in s.batches) + f" | {_size(pf)} |")
    return "\n".join(out)


def correctness_line(c: dict) -> str:
    finite = "logits finite" if c["logits_finite"] else "NON-FINITE LOGITS"
    if c["agreement"] is None:
        return f"correctness: {finite}"
    agree = round(c["agreement"] * c["tokens_compared"])
    gate = "" if c.get("min_agreement") is None else f" (gate >= {c['min_agreement']})"
    fused = c.get("vs_unfused")
    return (f"correctness: {finite}; next-token agreement {c['agreement']:.3f} ({agree}/{c['tokens_compared']}) "
            f"with the model of its dequantized weights{gate}, logits rel err {c['logits_rel_err']:.1e}"
            + ("" if fused is None else f"; with the unfused model {fused['agreement']:.3f}, logits rel err "
                                        f"{fused['logits_rel_err']:.1e}")
            + ("" if c.get("ok", True) else "  FAILED"))


def plot(path: str, res: Results, s: Settings, title: str) -> Optional[str]:
    from .report import line_panels

    panels = []
    for m in MODES:
        rows = [r for r in res.decode if r["mode"] == m]
        if rows:
            series = [(VARIANTS[v].label, sorted((r["batch"], r["tokens_per_s"]) for r in rows if r["variant"] == v),
                       "--" if VARIANTS[v].quant is None else "-", 2 * i)  # tab20's dark shades
                      for i, v in enumerate(VARIANTS)]
            panels.append((MODE_TITLES[m], series))
    if not panels:
        return None
    return line_panels(path, panels, title=title, xlabel="batch (sequences)",
                       ylabel="tokens/s" + (" (extrapolated)" if s.extrapolated else ""), ylim0=True)


def default_name(key: str, s: Settings) -> str:
    """e2e_<gpu>_<model>[_L<layers>][_<variants>][_<modes>]: runs with different subsets do
    not overwrite each other."""
    parts = [f"e2e_{key}_{s.model}"] + ([f"L{s.layers}"] if s.extrapolated else [])
    parts += ["-".join(s.variants)] if s.variants != list(default_variants(s.model)) else []
    parts += ["-".join(s.modes)] if s.modes != list(DEFAULT_MODES) and s.cuda else []
    return "_".join(parts)


def _setup_cpu_kernels() -> str:
    """CPU: run Sailfish's Triton kernels in the interpreter, as the tests do, unless the
    environment chose otherwise (TRITON_INTERPRET=0) or the kernels were already imported
    without it (then they cannot take CPU tensors, and the ops use the PyTorch reference)."""
    if "TRITON_INTERPRET" not in os.environ and "sailfish.kernels.w4a16" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from ..ops import interpreter_enabled

    return "triton interpreter" if interpreter_enabled() else "pytorch reference ops"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    cuda = args.device != "cpu" and torch.cuda.is_available()
    s = resolve(args, cuda, ap)
    backend = "cuda" if cuda else _setup_cpu_kernels()
    try:
        from .llama import require_transformers
        tf_version = require_transformers()
    except (ImportError, RuntimeError) as e:
        print(f"error: {e}")
        return 2
    import triton

    from . import report as RP

    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        from ..tuning import gpu_key
        gpu, key = torch.cuda.get_device_name(0), gpu_key(device)
    else:
        gpu, key = "cpu", "cpu"
    shape = MODELS[s.model]
    name = args.name or default_name(key, s)
    out_dir = args.out_dir or os.path.join("benchmarks", "results")
    write_files = cuda or args.out_dir is not None or args.name is not None
    command = "python -m sailfish.bench.e2e" + ("" if not argv else " " + shlex.join(argv))
    t_start = time.time()

    print(f"sailfish.bench.e2e: {gpu} | torch {torch.__version__} | triton {triton.__version__} | "
          f"transformers {tf_version}")
    print(f"model {shape.name}: hidden {shape.hidden}, intermediate {shape.intermediate}, "
          f"{s.layers} of {shape.layers} layers{' (whole model extrapolated)' if s.extrapolated else ''}, "
          f"heads {shape.heads}/{shape.kv_heads}, vocab {shape.vocab} | context {s.context} | batches "
          f"{','.join(map(str, s.batches))} | modes {','.join(s.modes)} | variants {','.join(s.variants)}"
          + (f" | budget {s.budget_s:.0f} s" if s.budget_s else ""))
    if not cuda:
        print(f"CPU check ({backend}): every code path runs, but the TIMES ARE MEANINGLESS.")

    prog = RP.Progress(progress_total(s))
    runner = Runner(s, device, prog, save=lambda: None)
    state = {"partial": True}

    def document() -> dict:
        derive(runner.res, s)
        r = runner.res
        return {
            "benchmark": "sailfish.bench.e2e", "command": command,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "gpu": gpu, "gpu_key": key, "device": device.type, "backend": backend,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": tf_version,
            "cuda": getattr(torch.version, "cuda", None),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("SAILFISH_", "TRITON_INTERPRET"))},
            "timings_meaningful": cuda, "partial": state["partial"],
            "elapsed_s": round(time.time() - t_start, 1),
            "model": {"name": shape.name, "key": s.model, "hidden": shape.hidden, "intermediate": shape.intermediate,
                      "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab,
                      "layers": s.layers, "model_layers": shape.layers, "extrapolated": s.extrapolated,
                      "random_weights": True, "attention": "sdpa", "cache": "transformers StaticCache"},
            "settings": {"context": s.context, "decode_positions": [s.context - s.reserve(), s.context - 1],
                         "batches": s.batches, "modes": s.modes, "variants": s.variants, "prefill": s.prefill,
                         "warmup": s.warmup, "steps": s.steps, "replays": s.replays,
                         "generate": "generate" in s.modes and {"prompt": s.gen_prompt, "tokens": s.gen_tokens,
                                                                "short": GEN_SHORT},
                         "compile": f"torch.compile(step, mode={s.compile_mode!r}, fullgraph=True, dynamic=False), "
                                    "then one CUDA graph captured by the benchmark",
                         "check": s.check and {"batch": s.check_batch, "steps": s.check_steps,
                                               "prompt": s.check_prompt},
                         "budget_s": s.budget_s or None, "seed": s.seed},
            "variants": r.variants, "decode": r.decode, "split": r.split, "prefill": r.prefill,
            "correctness": r.correctness, "skipped": r.skipped, "errors": r.errors,
        }

    path = os.path.join(out_dir, f"{name}.json")
    if write_files:
        runner.save = lambda: RP.write_json(path, document())
    interrupted = False
    with torch.no_grad():
        try:
            runner.run()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            prog.close()
    state["partial"] = interrupted
    res = runner.res
    doc = document()

    print()
    if interrupted:
        print("interrupted: reporting what finished")
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, transformers {tf_version}, "
          f"{time.time() - t_start:.0f} s" + ("" if cuda else " -- CPU: times are meaningless"))
    print(summary(res, s))
    if res.correctness:
        print()
        for c in res.correctness:
            print(f"{c['variant']}: {correctness_line(c)}")
    for sk in res.skipped:
        print(f"skipped {sk['variant']} {sk['unit']}" + (f" batch {sk['batch']}" if sk["batch"] else "")
              + f": {sk['reason']}")
    for e in res.errors:
        print(f"FAILED {e['variant']} {e['unit']}" + (f" batch {e['batch']}" if e["batch"] else "") + f": {e['error']}")
    if write_files:
        RP.write_json(path, doc)
        print(f"wrote {path}")
        if not args.no_plots:
            title = (f"{gpu}: {shape.name} decode, context {s.context}, tokens/s"
                     + (f" (extrapolated from {s.layers} of {s.full_layers} layers)" if s.extrapolated else "")
                     + ("" if cuda else " -- CPU check, times meaningless"))
            png = plot(os.path.join(out_dir, f"{name}_tokens.png"), res, s, title)
            if png:
                print(f"wrote {png}")
    else:
        print("CPU check: no files written (pass --out-dir or --name to write them)")
    print(f"reproduce: {command}")

    if interrupted:
        return 130
    if not (res.decode or res.prefill or res.correctness):
        return 2
    bad = [c for c in res.correctness if not c["ok"]]
    return 1 if res.errors or bad else 0


if __name__ == "__main__":
    sys.exit(main())
