"""sailfish.generation: the decode step's mask against transformers' own, DecodeGraphs' choice of
when a replay stands for a call (the CUDA graph replaced by a stand-in that re-runs the call on
the captured inputs), and generate() through both on the CPU (and on a GPU when there is one)."""
import copy
import functools
import pickle
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402
from transformers.generation.configuration_utils import CompileConfig  # noqa: E402
from transformers.masking_utils import create_masks_for_generate  # noqa: E402

import sailfish  # noqa: E402
from sailfish import generation  # noqa: E402
from sailfish.generation import DecodeGraphs, decode_mask, decode_masks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tiny(arch: str = "llama", device: str = "cpu", attn: str = "sdpa"):
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              "qwen3": lambda: transformers.Qwen3Config(**common),
              "mistral-window": lambda: transformers.MistralConfig(sliding_window=4, **common)}[arch]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16,
                                                         attn_implementation=attn).to(device).eval()


def _cache_kw(fn) -> str:
    """The name a transformers function takes the cache under ("cache" from 5.24)."""
    import inspect
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _prefilled(model, batch: int, prompt: int, context: int = 16, pad_left: int = 0):
    """A StaticCache of `context` positions after the model's prefill of a (batch, prompt) input
    (row 0 left-padded by pad_left tokens), and the 2-D padding mask."""
    cache = StaticCache(config=model.config, max_cache_len=context)
    ids = torch.randint(1, 96, (batch, prompt))
    mask = torch.ones(batch, prompt, dtype=torch.long)
    mask[0, :pad_left] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{_cache_kw(model.forward): cache})
    return cache, mask


# ----------------------------------------------------------------------------------
# The decode mask
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch,pad_left", [(1, 0), (3, 2)])
def test_decode_masks_are_transformers_masks(arch, batch, pad_left):
    model = _tiny(arch)
    cache, mask = _prefilled(model, batch, prompt=5, pad_left=pad_left)
    for step in range(3):  # the 2-D mask grows by one each step, as generate() extends it
        m2 = torch.cat([mask, torch.ones(batch, step + 1, dtype=mask.dtype)], dim=1)
        emb = torch.empty((batch, 1, 0), dtype=torch.float16)
        kwargs = dict(config=model.config, inputs_embeds=emb, attention_mask=m2, position_ids=None,
                      **{_cache_kw(create_masks_for_generate): cache})
        ours, theirs = decode_masks(**kwargs), create_masks_for_generate(**kwargs)
        if isinstance(theirs, dict):  # (configs with layer_types: one mask per pattern)
            assert isinstance(ours, dict) and ours.keys() == theirs.keys()
            ours, theirs = ours["full_attention"], theirs["full_attention"]
        assert ours.dtype == theirs.dtype == torch.bool and ours.shape == theirs.shape == (batch, 1, 1, 16)
        assert torch.equal(ours, theirs)
        assert not ours[0, 0, 0, :pad_left].any()  # the padding stays out
        with torch.no_grad():  # the cache moves on by one position
            model(input_ids=torch.randint(1, 96, (batch, 1)), attention_mask=m2, **{_cache_kw(model.forward): cache})


def test_copied_outputs():
    out = transformers.modeling_outputs.CausalLMOutputWithPast(logits=torch.ones(2, 1, 4), past_key_values="cache",
                                                               hidden_states=(torch.zeros(2), torch.ones(2)))
    got = generation._copied(out)
    assert type(got) is type(out) and got.past_key_values == "cache" and torch.equal(got.logits, out.logits)
    assert got.logits.data_ptr() != out.logits.data_ptr()
    assert all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in zip(got.hidden_states, out.hidden_states))
    t = torch.ones(3)
    lst = generation._copied([t, 5])
    assert type(lst) is list and lst[0] is not t and torch.equal(lst[0], t) and lst[1] == 5


def test_decode_mask_positions_and_tensor_offset():
    pad = torch.tensor([[0, 1, 1], [1, 1, 1]])
    got = decode_mask(pad, torch.tensor(3), kv_length=6, kv_offset=0)
    want = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)  # 3 and later: padding
    assert torch.equal(got[:, 0, 0], want)
    assert torch.equal(decode_mask(torch.ones(1, 8), 2, 6, 0)[0, 0, 0], torch.tensor([1, 1, 1, 0, 0, 0]).bool())


@pytest.mark.parametrize("case", ["prefill", "sliding", "dynamic", "and_mask"])
def test_decode_masks_hand_everything_else_to_transformers(case, monkeypatch):
    model = _tiny("mistral-window" if case == "sliding" else "llama")
    cache, mask = _prefilled(model, 2, prompt=5)
    q = 5 if case == "prefill" else 1
    kwargs = dict(config=model.config, inputs_embeds=torch.empty((2, q, 0), dtype=torch.float16),
                  attention_mask=torch.cat([mask, torch.ones(2, q, dtype=mask.dtype)], 1),
                  **{_cache_kw(create_masks_for_generate): cache})
    if case == "dynamic":
        kwargs[_cache_kw(create_masks_for_generate)] = transformers.DynamicCache()
    if case == "and_mask":
        kwargs["and_mask_function"] = lambda b, h, q_idx, kv_idx: kv_idx >= 0
    calls = []

    @functools.wraps(create_masks_for_generate)  # (its signature: the cache's keyword is read from it)
    def counted(*a, **k):
        calls.append(1)
        return create_masks_for_generate(*a, **k)
    monkeypatch.setattr("transformers.masking_utils.create_masks_for_generate", counted)
    decode_masks(**kwargs)
    assert calls == [1]


# ----------------------------------------------------------------------------------
# DecodeGraphs, the CUDA graph replaced by a stand-in
# ----------------------------------------------------------------------------------
def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    items = v.values() if isinstance(v, dict) else v if isinstance(v, (tuple, list)) else []
    return [t for x in items for t in _tensors(x)]


class _StandIn(generation._Graph):
    """A 'graph' that re-runs the call on its captured inputs and on the tensors the call's cache
    had at the capture (a graph's fixed addresses), writing into its own outputs: what a replay
    computes, so that a replay that missed copying an input, or a cache whose state did not move
    into those tensors, shows up as a wrong output. The rest (input copies, the outputs' cache) is
    generation._Graph's."""
    captures = 0
    fail = False

    def record(self, fn, static, pool):
        if _StandIn.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        _StandIn.captures += 1
        names = generation._STATE[0] if generation._STATE else []
        fixed = {k: (types.SimpleNamespace(layers=[types.SimpleNamespace(**{n: getattr(layer, n) for n in names})
                                                    for layer in v.layers]) if hasattr(v, "layers") else v)
                 for k, v in static.items()}
        self.run = lambda: fn(**{k: fixed[k] for k in static})
        return fn(**static)

    def launch(self):
        for dst, src in zip(_tensors(self.out), _tensors(self.run())):
            dst.copy_(src)


class _Runner(DecodeGraphs):
    graph_class = _StandIn
    device_type = "cpu"


class _Counted(torch.nn.Module):
    """A model whose calls are counted: {"y": x * w + the sum of the cache's first keys, "cache": the cache}."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 4)
        self.calls = 0

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return None

    def forward(self, x, cache=None, scale=1.0):
        self.calls += 1
        layers = getattr(cache, "layers", None)
        return {"y": x * self.emb.weight[0, 0] * scale + (layers[0].keys.sum() if layers else 0), "cache": cache}


def _static_cache(seed: int = 0):
    model = _tiny("llama")
    torch.manual_seed(seed)
    cache, _ = _prefilled(model, 1, prompt=3)
    return cache


def _state(cache) -> list:
    return [t.clone() for t in generation._cache_state(cache)[1]]


@pytest.fixture
def runner(monkeypatch):
    _StandIn.captures, _StandIn.fail = 0, False
    model = _Counted()
    r = _Runner(model, CompileConfig(backend="eager", mode=None))
    fallbacks = []
    monkeypatch.setattr(r, "fallback", lambda *a, **k: fallbacks.append(1) or model(*a, **k))
    return model, r, fallbacks


def test_decode_graphs_first_call_compiled_second_captured_then_replayed(runner):
    model, r, fallbacks = runner
    cache = _static_cache()
    with torch.no_grad():
        outs = []
        for i in range(5):
            x = torch.full((2, 3), float(i))
            got = r(x=x, cache=cache, scale=2.0)
            outs.append(got["y"])
            assert torch.equal(got["y"], model(x, cache, 2.0)["y"])  # a replay computes the call on this call's x
            assert got["cache"] is cache  # and hands back the call's cache
    # every call's output kept its values (replays return copies, not the graph's own output)
    assert all(torch.equal(o, model(torch.full((2, 3), float(i)), cache, 2.0)["y"]) for i, o in enumerate(outs))
    assert _StandIn.captures == 1 and len(r.graphs) == 1 and not fallbacks
    with torch.no_grad():  # another shape, another scalar: new signatures (first call compiled, no capture)
        r(x=torch.ones(4, 3), cache=cache, scale=2.0)
        r(x=torch.ones(2, 3), cache=cache, scale=3.0)
    assert _StandIn.captures == 1
    with torch.no_grad():  # the cache's tensors replaced (e.g. reallocated): its state moves back where the graph reads
        layer = cache.layers[0]
        home = layer.keys
        layer.keys = layer.keys.clone() + 1
        got = r(x=torch.ones(2, 3), cache=cache, scale=2.0)
    assert _StandIn.captures == 1 and cache.layers[0].keys is home
    assert torch.equal(got["y"], model(torch.ones(2, 3), cache, 2.0)["y"])


def test_decode_graphs_replay_for_every_cache_of_the_captured_structure(runner):
    """generate(cache_implementation="static") makes a new StaticCache every call: its state moves
    into the tensors the graph was captured on (no new capture, no cache kept alive by the graph),
    and a cache living there before keeps its own state in a copy."""
    model, r, _ = runner
    a, b = _static_cache(0), _static_cache(1)
    state_a, state_b = _state(a), _state(b)
    assert not torch.equal(state_a[0], state_b[0])
    x = torch.ones(1, 3)
    with torch.no_grad():
        for _ in range(3):
            r(x=x, cache=a)
        got = r(x=x, cache=b)
        assert _StandIn.captures == 1 and got["cache"] is b
        assert torch.equal(got["y"], model(x, b)["y"]) and torch.equal(got["y"], x * model.emb.weight[0, 0] + state_b[0].sum())
        assert all(torch.equal(t, s) for t, s in zip(_state(a), state_a))  # a moved out with its own state
        assert all(torch.equal(t, s) for t, s in zip(_state(b), state_b))
        assert generation._cache_state(b)[1][0] is next(iter(r.homes.values())).tensors[0]
        got = r(x=x, cache=a)  # and back in
        assert torch.equal(got["y"], x * model.emb.weight[0, 0] + state_a[0].sum()) and _StandIn.captures == 1
        assert all(torch.equal(t, s) for t, s in zip(_state(b), state_b))
        a.layers[1].keys = a.layers[1].keys.clone()  # a tensor of a replaced by its user: a keeps it
        mine = a.layers[1].keys
        r(x=x, cache=b)
        assert a.layers[1].keys is mine and all(torch.equal(t, s) for t, s in zip(_state(a), state_a))
        assert all(torch.equal(t, s) for t, s in zip(_state(b), state_b))
    ref = __import__("weakref").ref(b)
    del b, got
    assert ref() is None  # nothing of DecodeGraphs' keeps a cache alive
    with torch.no_grad():  # another structure: a home of its own
        c = StaticCache(config=_tiny("llama").config, max_cache_len=8)
        _prefilled_into = _tiny("llama")
        _prefilled_into(input_ids=torch.ones(1, 2, dtype=torch.long), use_cache=True, **{_cache_kw(_prefilled_into.forward): c})
        r(x=x, cache=c)
    assert len(r.homes) == 2


def test_decode_graphs_fall_back_where_a_replay_is_not_the_call(runner):
    model, r, fallbacks = runner
    x = torch.ones(2, 3)
    with torch.no_grad():
        r(x)  # positional
        r(x=x, cache=transformers.DynamicCache())  # a cache with Python-side state
        r(x=x, cache=object())  # an object it does not know
    r(x=x)  # gradients on
    assert len(fallbacks) == 4 and _StandIn.captures == 0


def test_decode_graphs_capture_failure_runs_compiled(runner, caplog):
    model, r, fallbacks = runner
    _StandIn.fail = True
    with torch.no_grad():
        outs = [r(x=torch.full((1, 3), float(i))) for i in range(4)]
    assert all(torch.equal(o["y"], model(torch.full((1, 3), float(i)))["y"]) for i, o in enumerate(outs))
    assert "could not be captured" in caplog.text and not r.graphs and not fallbacks


def test_decode_graphs_keep_at_most_max_graphs(runner):
    model, r, _ = runner
    with torch.no_grad():
        for b in range(generation.MAX_GRAPHS + 3):
            for _ in range(2):
                r(x=torch.ones(b + 1, 3))
    assert len(r.graphs) == generation.MAX_GRAPHS
    assert [k[2][1][0] for k in r.graphs] == list(range(4, generation.MAX_GRAPHS + 4))  # the newest


# ----------------------------------------------------------------------------------
# Installed on a converted model
# ----------------------------------------------------------------------------------
def test_installed_by_quantize_model_unless_fuse_false():
    model = sailfish.quantize_model(_tiny("llama"))
    assert model.sailfish_report["row_ops"]["generate"] == ["get_compiled_call", "create_masks_for_generate", "generate"]
    assert isinstance(model.get_compiled_call, generation.CompiledCall) and model.create_masks_for_generate is decode_masks
    assert isinstance(model.generate, generation.Generate)
    assert generation.install(model) == []  # once
    assert "get_compiled_call" not in sailfish.quantize_model(_tiny("llama"), fuse=False).__dict__
    eager = _tiny("llama", attn="eager")  # float masks: transformers' own mask function stays
    assert generation.install(eager) == ["get_compiled_call", "generate"]
    custom = _tiny("llama")
    custom.generate = functools.partial(lambda model, *a, **k: None, model=custom)  # (a custom generate from the Hub)
    assert generation.install(custom) == ["get_compiled_call", "create_masks_for_generate"]


def test_stop_check_deferred_on_cuda_inside_generate_only():
    from transformers.generation.utils import DeferredStopCheck

    model = _tiny("llama")
    generation.install(model)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    returned = _static_cache()  # (a user's StaticCache: returned to them, and not croppable)
    assert DeferredStopCheck.is_supported(cuda, None, False, is_assistant=False) is False  # transformers' answer
    token = generation._IN_GENERATE.set(True)
    try:  # inside a Sailfish model's generate(): transformers' answer for MPS
        assert DeferredStopCheck.is_supported(cuda, None, False, is_assistant=False) is True
        assert DeferredStopCheck.is_supported(cuda, returned, True, is_assistant=False) is returned.is_croppable
        assert DeferredStopCheck.is_supported(cuda, None, False, is_assistant=True) is False
        assert DeferredStopCheck.is_supported(cpu, None, False, is_assistant=False) is False
    finally:
        generation._IN_GENERATE.reset(token)
    seen = []
    real = generation._IS_SUPPORTED[0]
    generation._IS_SUPPORTED[0] = lambda device, *a, **k: seen.append((device.type, generation._IN_GENERATE.get())) or real(device, *a, **k)
    try:
        ids = torch.randint(1, 96, (1, 3))
        model.generate(ids, max_new_tokens=2, do_sample=False)
        type(model).generate(model, ids, max_new_tokens=2, do_sample=False)  # (the class's: outside)
    finally:
        generation._IS_SUPPORTED[0] = real
    assert seen == [("cpu", True), ("cpu", False)] and not generation._IN_GENERATE.get()


def test_generate_takes_the_decode_masks_and_keeps_its_tokens(monkeypatch):
    model = _tiny("llama")
    ids = torch.randint(1, 96, (2, 4))
    attn = torch.ones_like(ids)
    ids[0, 0], attn[0, 0] = 0, 0  # a left-padded row

    def run():
        return model.generate(ids, attention_mask=attn, max_new_tokens=4, do_sample=False,
                              cache_implementation="static", disable_compile=True)
    want = run()
    assert generation.install(model) == ["get_compiled_call", "create_masks_for_generate", "generate"]
    calls = []
    real = generation.decode_mask
    monkeypatch.setattr(generation, "decode_mask", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(run(), want)
    assert len(calls) == 3  # every decode step's mask (the prompt's is transformers')
    # the model still copies and pickles; remove() takes it all off
    copy.deepcopy(model)
    pickle.loads(pickle.dumps(model))
    generation.remove(model)
    assert not {"get_compiled_call", "create_masks_for_generate", "generate"} & model.__dict__.keys()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_compiled_through_decode_graphs_on_the_gpu():
    model = sailfish.quantize_model(_tiny("llama", "cuda"))
    ids = torch.randint(1, 96, (2, 5), device="cuda")
    # transformers' own generate (the class's: per-token stop check), uncompiled
    want = type(model).generate(model, ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                                disable_compile=True)
    cache = StaticCache(config=model.config, max_cache_len=32)
    for _ in range(3):
        cache.reset()
        got = model.generate(ids, max_new_tokens=8, do_sample=False, **{_cache_kw(model.forward): cache})
        assert torch.equal(got, want)
    runner = model._compiled_call
    assert isinstance(runner, DecodeGraphs) and len(runner.graphs) == 1
    # 7 decode steps a call: compiled, captured, then replays (and every step of the later calls)
    assert runner.stats == {"replays": 5 + 7 + 7, "captures": 1, "compiled": 1, "fallback": 0}
    # cache_implementation="static": a new cache every call, replayed from the same graph; the stop
    # check deferred (one step late): a row that stops early at an EOS token is padded as before
    eos = int(want[0, 5 + 2])
    want = type(model).generate(model, ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0,
                                cache_implementation="static", max_cache_len=32, disable_compile=True)
    for _ in range(3):
        got = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0,
                             cache_implementation="static", max_cache_len=32)
        assert torch.equal(got, want)
    assert runner.stats["captures"] == 1 and len(runner.homes) == 1
