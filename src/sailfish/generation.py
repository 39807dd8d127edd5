"""transformers' generate() at the compiled decode step's speed (issue 39 item 6): the model's
compiled call replayed from CUDA graphs of its own, the decode step's attention mask in a few
ops, and the stop check deferred by a step.

Why (docs/perf_log.md v48-v49; H100, Llama-3-8B shapes, 32 layers, W4A16, transformers 5.17):
with a static cache generate() compiles the forward (get_compiled_call: torch.compile, mode
"reduce-overhead", inductor's cudagraph trees) and then, every token, waits for the GPU (its stop
check reads a device flag), prepares the next step's inputs on the host, builds the 4-D attention
mask in eager PyTorch (create_masks_for_generate) and calls the compiled forward. The GPU idles for
all of that host time: the compiled call's wrappers 770-930 us a token, the inputs 450-730 us, of
which the mask 240-340 us; generate() ran 4.2-4.8 ms a token at batch 1 against a 2.9 ms step.

- DecodeGraphs (installed as the model's get_compiled_call): torch.compile of the forward with
  the compile config's options but without inductor's CUDA graphs, and per call signature (the
  keyword arguments' shapes / dtypes / devices, scalars by value, the cache by the structure of
  its tensors, the embedding and output weights by address) the first call runs compiled, the
  second is captured into a CUDA graph and replayed, and every later one copies its tensors into
  the graph's inputs and replays it. The graph reads and writes the cache's tensors at the
  addresses of the capture: every cache of that structure keeps its state in those tensors while
  it is used (_Home: a new one moves in with one copy, as generate(cache_implementation="static")
  makes a new StaticCache every call; one living there before moves out into a copy of its own),
  and a graph keeps no cache alive. A replay returns copies of the graph's output tensors (the
  logits: one copy kernel) with the call's cache, so outputs a caller keeps stay valid, as
  generate() keeps each step's attentions or hidden states when asked (the graph's own are
  overwritten by the next replay). Graphed only where a replay is the call: keyword arguments of
  CUDA tensors, scalars and a cache whose layers are all transformers' StaticLayer (their state
  lives in tensors updated in place; a layer with Python-side state would go stale in a replay);
  anything else runs transformers' own compiled call (the same torch.compile arguments).
- decode_masks (installed as the model's create_masks_for_generate): for a decode step (one
  query token) over such a cache, with a 2-D padding mask and a full-attention causal config,
  sdpa's boolean mask (B, 1, 1, kv) from the padding mask and the query position in four ops,
  the values of transformers' create_causal_mask / sdpa_mask (tests/test_generation.py compares
  them); everything else goes to transformers' create_masks_for_generate.
- Generate (installed as the model's generate): the class's generate() with transformers' own
  deferred stop check on CUDA, where transformers enables it only on MPS (see the class).

install(model) puts them on a model instance (fuse.fuse_row_ops does, for the models it
converts); remove(model) takes them off.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import logging
import operator
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

log = logging.getLogger("sailfish")

MAX_GRAPHS = 8  # graphs kept per model (least recently used dropped): one per batch size and cache
_SCALARS = (bool, int, float, str, type(None))
_MASK_ATTENTION = ("sdpa", "sailfish")  # implementations whose masks are sdpa_mask's (fuse.ATTENTION: "sailfish")


def _static_layer_type():
    from transformers.cache_utils import StaticLayer
    return StaticLayer


def _static_layers(cache) -> Optional[list]:
    """The cache's layers if every one is a StaticLayer (exact type) holding its tensors, else None."""
    layers = getattr(cache, "layers", None)
    static = _static_layer_type()
    if not layers or any(type(layer) is not static or getattr(layer, "keys", None) is None for layer in layers):
        return None
    return layers


_STATE: list = []  # [names of StaticLayer's tensor attributes, their attrgetter], read off the first layer seen


def _cache_state(cache) -> Optional[Tuple[list, List[torch.Tensor]]]:
    """(layers, every tensor of their state: keys, values, the position counter, layer by layer)
    of a cache of initialized StaticLayers, else None. ~10 us for 32 layers (a generic walk of
    each layer's attributes took ~40)."""
    layers = _static_layers(cache)
    if layers is None:
        return None
    if not _STATE:
        names = [k for k, v in vars(layers[0]).items() if isinstance(v, torch.Tensor)]
        _STATE.extend([names, operator.attrgetter(*names) if len(names) > 1 else lambda layer: (getattr(layer, names[0]),)])
    get = _STATE[1]
    try:
        return layers, [t for layer in layers for t in get(layer)]
    except AttributeError:  # (a layer without one of them)
        return None


def _point(layers: list, tensors: List[torch.Tensor]) -> None:
    """Make `tensors` (as _cache_state lists them) the layers' state."""
    names, it = _STATE[0], iter(tensors)
    for layer in layers:
        for name in names:
            setattr(layer, name, next(it))


class _Home:
    """The tensors that the caches of one structure (their tensors' shapes, dtypes and devices)
    keep their state in while DecodeGraphs' graphs use them: a graph reads and writes these
    addresses, whichever cache the call passes. They are the first such cache's own tensors; a
    later cache moves in (its state copied in, its layers pointed at them: one copy of the cache
    per generate() call, which makes a new StaticCache for cache_implementation="static"), and
    the cache living there before, if still alive, moves out into a copy of its own, so that two
    caches never share their state."""

    def __init__(self, tensors: List[torch.Tensor], number: int):
        self.tensors, self.number = tensors, number  # (number: the graphs' keys name the home by it)
        self.tenant: Optional[weakref.ref] = None

    def holds(self, cache, tensors: List[torch.Tensor]) -> bool:
        return self.tenant is not None and self.tenant() is cache and all(map(operator.is_, tensors, self.tensors))

    def move_in(self, cache, layers: list, tensors: List[torch.Tensor]) -> None:
        old = self.tenant() if self.tenant is not None else None
        if old is not None and old is not cache:
            state = _cache_state(old)
            if state is not None and len(state[1]) == len(self.tensors):
                own = []  # its tensors still here (all, or those not replaced since) move out
                for t, h in zip(state[1], self.tensors):
                    if t is h:
                        t = h.clone()
                        torch._dynamo.mark_static_address(t)  # (as StaticLayer marks its tensors)
                    own.append(t)
                _point(state[0], own)
        if any(a is not b for a, b in zip(tensors, self.tensors)):
            torch._foreach_copy_(self.tensors, tensors)
            _point(layers, self.tensors)
        self.tenant = weakref.ref(cache)


_CALL_CACHE = object()  # (where a graph's outputs hold the cache: the call's cache goes there)


def _copied(v, old=None, new=None, clone: bool = True):
    """v with every tensor in it (a ModelOutput, tuple, list or dict of them) cloned (clone=True)
    and the object `old` replaced by `new`; other objects as they are."""
    if v is old:
        return new
    if isinstance(v, torch.Tensor):
        return v.clone() if clone else v
    if isinstance(v, dict):  # (transformers' ModelOutput is an OrderedDict dataclass)
        items = {k: _copied(x, old, new, clone) for k, x in v.items()}
        return type(v)(**items) if hasattr(v, "to_tuple") else type(v)(items)
    if isinstance(v, (tuple, list)) and not hasattr(v, "_fields"):
        return type(v)(_copied(x, old, new, clone) for x in v)
    return v


class _Graph:
    """One captured call: the CUDA graph, its input tensors (copied into before each replay) and
    its outputs (the call's cache in them replaced by a marker: the graph keeps no cache alive);
    the constructor runs the call under capture. (record and launch are the CUDA parts, which
    tests stand in for on the CPU: DecodeGraphs.graph_class.)"""

    def __init__(self, fn: Callable, kwargs: Dict[str, Any], names: List[str], pool, cache):
        static = {k: (v.clone() if k in names else v) for k, v in kwargs.items()}
        self.inputs = [static[k] for k in names]
        out = self.record(fn, static, pool)
        self.out = out if cache is None else _copied(out, cache, _CALL_CACHE, clone=False)

    def record(self, fn: Callable, static: Dict[str, Any], pool):
        """fn(**static) run under capture into this graph: its outputs."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            return fn(**static)

    def launch(self) -> None:
        self.graph.replay()

    def replay(self, tensors: List[torch.Tensor], cache):
        """Copy this call's tensors into the graph's inputs (none: they are already there), replay,
        return copies of the outputs with this call's cache (_copied)."""
        if tensors:
            torch._foreach_copy_(self.inputs, tensors)
        self.launch()
        return _copied(self.out, _CALL_CACHE, cache)


class DecodeGraphs:
    """The model's compiled call for generate() (see the module docstring): `runner(**kwargs)`."""

    graph_class = _Graph  # (tests stand in for the CUDA parts: graph_class, device_type)
    device_type = "cuda"

    def __init__(self, model: nn.Module, compile_config=None):
        self.model_ref = model
        self.config = compile_config
        options = compile_config.to_dict() if compile_config is not None else {}
        self.options = dict(options)
        mode = options.pop("mode", None)
        mode = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
        if mode is not None:
            options["mode"] = mode
        self.compiled = torch.compile(model.__call__, **options)  # (no CUDA graphs of inductor's)
        self._fallback: Optional[Callable] = None
        self.graphs: "OrderedDict[tuple, Any]" = OrderedDict()
        self.seen: set = set()
        self.failed: set = set()
        self.pool = None
        self.homes: Dict[tuple, _Home] = {}  # by the structure of the caches living there
        self._numbers = itertools.count()
        self.stats = {"replays": 0, "captures": 0, "compiled": 0, "fallback": 0}  # calls by path
        emb, out = model.get_input_embeddings(), model.get_output_embeddings()
        self.weights = [m.weight for m in (emb, out) if isinstance(getattr(m, "weight", None), torch.Tensor)]

    def fallback(self, *args, **kwargs):
        """transformers' own compiled call (its torch.compile arguments, inductor's CUDA graphs)."""
        if self._fallback is None:
            self._fallback = torch.compile(self.model_ref.__call__, **self.options)
        return self._fallback(*args, **kwargs)

    def home(self, cache) -> Optional[_Home]:
        """The home the cache's state now lives in (moved there if it lived elsewhere), or None for a
        cache that is not made of initialized StaticLayers (a replay cannot stand for its call)."""
        state = _cache_state(cache)
        if state is None:
            return None
        layers, tensors = state
        for home in self.homes.values():
            if home.holds(cache, tensors):
                return home
        structure = tuple((t.shape, t.dtype, t.device) for t in tensors)
        home = self.homes.get(structure)
        if home is None:
            home = self.homes[structure] = _Home(tensors, next(self._numbers))
        home.move_in(cache, layers, tensors)
        return home

    def signature(self, kwargs: Dict[str, Any]):
        """(key, tensor names, tensors, cache) of a call that a replay can stand for, else None."""
        key: list = [tuple(w.data_ptr() for w in self.weights), None]
        names, tensors, cache = [], [], None
        for name, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                if v.device.type != self.device_type or v.requires_grad:
                    return None
                key.append((name, v.shape, v.dtype, v.device.index))
                names.append(name)
                tensors.append(v)
            elif isinstance(v, _SCALARS):
                key.append((name, v))
            else:  # the cache (one)
                home = None if cache is not None else self.home(v)
                if home is None:
                    return None
                key[1], cache = home.number, v
                key.append(name)
        return tuple(key), names, tensors, cache

    def __call__(self, *args, **kwargs):
        sig = None if args or torch.is_grad_enabled() else self.signature(kwargs)
        if sig is None:
            self.stats["fallback"] += 1
            return self.fallback(*args, **kwargs)
        key, names, tensors, cache = sig
        graph = self.graphs.get(key)
        if graph is not None:
            self.stats["replays"] += 1
            self.graphs.move_to_end(key)
            return graph.replay(tensors, cache)
        if key not in self.seen:  # first call: compile (and run) outside a capture
            if len(self.seen) > 4 * MAX_GRAPHS:
                self.seen.clear()
            self.seen.add(key)
        elif key not in self.failed:  # second call: capture, and replay for this call's outputs
            graph = self._capture(key, kwargs, names, cache)
            if graph is not None:
                return graph.replay([], cache)  # (the captured inputs are this call's)
        self.stats["compiled"] += 1
        return self.compiled(**kwargs)

    def _capture(self, key: tuple, kwargs: Dict[str, Any], names: List[str], cache):
        """The call captured into a graph kept under `key` (least recently used ones dropped past
        MAX_GRAPHS, and the homes no graph uses), or None, with a warning, where the capture fails
        (the key then stays compiled)."""
        try:
            if self.pool is None and self.device_type == "cuda":
                self.pool = torch.cuda.graph_pool_handle()
            graph = self.graph_class(self.compiled, kwargs, names, self.pool, cache)
        except Exception as e:  # noqa: BLE001 - a call that cannot be captured still runs
            self.failed.add(key)
            log.warning("sailfish: generate()'s decode step could not be captured in a CUDA graph (%s: %s); "
                        "it runs compiled without one", type(e).__name__, e)
            return None
        self.stats["captures"] += 1
        self.graphs[key] = graph
        if len(self.graphs) > MAX_GRAPHS:
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
            used = {k[1] for k in self.graphs}
            self.homes = {s: h for s, h in self.homes.items() if h.number in used}
        return graph


class CompiledCall:
    """The model's get_compiled_call (transformers' signature, `model.get_compiled_call(config)`):
    a DecodeGraphs on CUDA, kept (as transformers keeps its own, in model._compiled_call) while
    the compile config stays the same; transformers' own call elsewhere. A picklable object, not a
    bound method, so that the model still pickles and deep-copies."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, compile_config=None) -> Callable:
        model = self.model
        if getattr(model, "device", torch.device("cpu")).type != "cuda":
            return type(model).get_compiled_call(model, compile_config)
        runner = model.__dict__.get("_compiled_call")
        if not isinstance(runner, DecodeGraphs) or runner.config != compile_config:
            runner = DecodeGraphs(model, compile_config)
            model._compiled_call = runner
        return runner


# ----------------------------------------------------------------------------------
# The decode step's mask
# ----------------------------------------------------------------------------------
_POSITIONS: Dict[tuple, torch.Tensor] = {}  # arange(kv_offset, kv_offset + kv_length) by (offset, length, device)


def _full_attention_only(config) -> bool:
    """The text config's masks are all create_causal_mask's: causal, no sliding window or chunks."""
    if not getattr(config, "is_causal", True):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return set(types) == {"full_attention"}
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None


def decode_mask(attention_mask: torch.Tensor, q_offset, kv_length: int, kv_offset: int) -> torch.Tensor:
    """sdpa_mask's boolean mask (B, 1, 1, kv_length) of one query token at position q_offset (an
    int or a 0-d tensor) over cache positions kv_offset .. kv_offset + kv_length - 1, with the 2-D
    padding mask attention_mask (B, L) (any dtype, nonzero = keep; positions past L are padding):
    position j is kept where j <= q_offset and the padding mask keeps it."""
    dev = attention_mask.device
    k = (kv_offset, kv_length, dev)
    positions = _POSITIONS.get(k)
    if positions is None:
        positions = _POSITIONS[k] = torch.arange(kv_offset, kv_offset + kv_length, device=dev)
    pad = attention_mask.to(dtype=torch.bool)
    missing = kv_offset + kv_length - pad.shape[-1]
    if missing > 0:
        pad = torch.nn.functional.pad(pad, (0, missing))
    return (pad[:, kv_offset:kv_offset + kv_length] & (positions <= q_offset))[:, None, None, :]


@functools.lru_cache(maxsize=None)
def _cache_keyword() -> str:
    """The name transformers' create_masks_for_generate takes the cache under ("cache" from 5.24,
    "past_key_values" before)."""
    from transformers.masking_utils import create_masks_for_generate

    return "cache" if "cache" in inspect.signature(create_masks_for_generate).parameters else "past_key_values"


def decode_masks(config, inputs_embeds: torch.Tensor, attention_mask: Optional[torch.Tensor], cache=None,
                 position_ids: Optional[torch.Tensor] = None, or_mask_function=None, and_mask_function=None,
                 block_sequence_ids=None, past_key_values=None, **kwargs):
    """The model's create_masks_for_generate (transformers' signature, the cache as `cache` or
    `past_key_values`): decode_mask where that is transformers' mask (see the module docstring),
    else transformers' create_masks_for_generate."""
    from transformers.masking_utils import create_masks_for_generate

    cache = past_key_values if cache is None else cache
    text = config.get_text_config()
    if (inputs_embeds.shape[1] == 1 and attention_mask is not None and attention_mask.ndim == 2
            and or_mask_function is None and and_mask_function is None and block_sequence_ids is None
            and getattr(text, "_attn_implementation", None) in _MASK_ATTENTION and _full_attention_only(text)
            and _static_layers(cache) is not None):
        kv_length, kv_offset = cache.get_mask_sizes(1, 0)
        offset = getattr(cache, "get_query_offset", cache.get_seq_length)(0)
        mask = decode_mask(attention_mask.to(inputs_embeds.device), offset, kv_length, kv_offset)
        return {"full_attention": mask} if getattr(text, "layer_types", None) is not None else mask
    return create_masks_for_generate(config, inputs_embeds, attention_mask, position_ids=position_ids,
                                     or_mask_function=or_mask_function, and_mask_function=and_mask_function,
                                     block_sequence_ids=block_sequence_ids, **{_cache_keyword(): cache}, **kwargs)


# ----------------------------------------------------------------------------------
# The stop check
# ----------------------------------------------------------------------------------
_IN_GENERATE = contextvars.ContextVar("sailfish_generate", default=False)
_IS_SUPPORTED: list = []  # [transformers' DeferredStopCheck.is_supported]


def _stop_check_deferrable(device, *args, **kwargs) -> bool:
    """transformers' DeferredStopCheck.is_supported, answered for CUDA as transformers answers
    for MPS (its conditions on the cache and assisted generation) inside a generate() of a model
    Sailfish installed Generate on, as transformers answers elsewhere."""
    if _IN_GENERATE.get() and torch.device(device).type == "cuda":
        device = torch.device("mps")
    return _IS_SUPPORTED[0](device, *args, **kwargs)


def _route_stop_check() -> bool:
    """Route transformers' DeferredStopCheck.is_supported through _stop_check_deferrable (once);
    False for a transformers without a deferred stop check."""
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:
        return False
    if not _IS_SUPPORTED:
        _IS_SUPPORTED.append(DeferredStopCheck.is_supported)
        DeferredStopCheck.is_supported = staticmethod(_stop_check_deferrable)
    return True


class Generate:
    """The model's generate() (installed on the instance): the class's generate(), with the stop
    check deferred by a step on CUDA. Why: generate() reads the stop flag of every token on the
    host (StopCheck), so the GPU idles for all the host time between that read and the next
    step's launch (the inputs, the mask, the call: 0.36-0.42 ms, and the loop's small kernels
    after the step), 15-20% of a W4A16 decode step (H100, 8B shapes, docs/perf_log.md v49).
    transformers' DeferredStopCheck reads the previous token's flag instead (the host queues the
    next step while the GPU runs this one; where a sequence stops early the one extra step is
    undone) and is enabled only on MPS ("we should enable it for cuda if we observe perf gains"):
    with it generate() ran at the compiled step's time, 2.97 vs 3.01 ms a token at batch 1 and
    3.81 vs 3.81 at batch 16 (e2e_h100_8b_generate_v49.json), the tokens unchanged."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        token = _IN_GENERATE.set(True)
        try:
            return type(self.model).generate(self.model, *args, **kwargs)
        finally:
            _IN_GENERATE.reset(token)


# ----------------------------------------------------------------------------------
# Installing
# ----------------------------------------------------------------------------------
def install(model: nn.Module) -> List[str]:
    """Put DecodeGraphs (as get_compiled_call), decode_masks (as create_masks_for_generate, where
    the model's attention takes sdpa's masks and its class has no mask function of its own) and
    Generate (as generate, where the instance has no generate of its own, as a custom generate
    from the Hub, and transformers has a deferred stop check) on a transformers model instance.
    Returns the names installed ([] for a model without get_compiled_call, or already done)."""
    cls = type(model)
    if not callable(getattr(cls, "get_compiled_call", None)) or "get_compiled_call" in model.__dict__:
        return []
    model.get_compiled_call = CompiledCall(model)
    done = ["get_compiled_call"]
    text = model.config.get_text_config() if hasattr(getattr(model, "config", None), "get_text_config") else None
    if (text is not None and getattr(text, "_attn_implementation", None) in _MASK_ATTENTION
            and getattr(cls, "create_masks_for_generate", None) is None):
        model.create_masks_for_generate = decode_masks
        done.append("create_masks_for_generate")
    if "generate" not in model.__dict__ and callable(getattr(cls, "generate", None)) and _route_stop_check():
        model.generate = Generate(model)
        done.append("generate")
    return done


def remove(model: nn.Module) -> None:
    """Take install's functions (and their graphs) off the model."""
    for name in ("get_compiled_call", "create_masks_for_generate"):
        model.__dict__.pop(name, None)
    if isinstance(model.__dict__.get("generate"), Generate):
        del model.__dict__["generate"]
    if isinstance(model.__dict__.get("_compiled_call"), DecodeGraphs):
        del model.__dict__["_compiled_call"]


__all__ = ["DecodeGraphs", "CompiledCall", "Generate", "decode_mask", "decode_masks", "install", "remove", "MAX_GRAPHS"]
