"""pqcache as an attention backend of Hugging Face transformers (torch).

    import pqcache_hf
    model = pqcache_hf.from_pretrained(path)      # AutoModelForCausalLM, attn_implementation="pqcache"
    out = model.generate(ids, max_new_tokens=32, do_sample=False,
                         cache=pqcache_hf.cache_for(model, budget_ratio=0.1))

or register the backend yourself (pqcache_hf.register()) and pass
attn_implementation="pqcache" to from_pretrained / from_config. Supported: the
decoder-only models whose attention goes through transformers' attention-function
registry and whose keys are rotated with rotate_half (Llama, Mistral, Qwen2, Gemma 3 and
their relatives); greedy or sampled generate() with one sequence or a batch of unpadded
ones (one pqcache cache per sequence). Hybrid models (Gemma 2 and 3's layer_types,
Qwen2's use_sliding_window, Mistral's sliding_window): the sliding-window layers keep
transformers' own sliding cache layers, mask and SDPA attention; pqcache serves the
full-attention layers, one pqcache cache over just those (PQCache.pq_layer maps a
model layer to its pqcache layer).

The pieces are named and split as transformers' own integrations are: PQCache (the
Cache, made by cache_for), PQCacheLayer (the cache layer of a full-attention layer: it
stores the rows and gives back the rows a query attends over) and
pqcache_attention_forward (the attention function registered as "pqcache": torch's SDPA
over those rows), with pqcache_mask (the mask function). PQCacheHF and pqcache_attention
are the previous names of PQCache and pqcache_attention_forward, kept as deprecated
aliases for one release.

What happens: the prompt's forward pass observes each layer's last queries (as many as
the resolved `observe` setting says: the library's default 32), stores its keys and
values in the sequence's pqcache cache (every full-attention layer, every KV head; the
layer's PQ build starts in the background) and attends densely and causally over the
prompt, as the model would. Each decode step appends the new token's key and value,
selects sinks + top-k + window per KV head with the step's queries, gathers the selected
rows and attends over them.
The settings of cache_for are pqcache.Cache's (budget_ratio, m, bits, ...); the shape
of the model (layers, heads, head size) and the RoPE layout come from its config.

A later prompt on the same cache (the next turn of a conversation: generate() again with
the whole conversation so far and the same cache) attends densely to every token the
cache holds and causally among its own, then its tokens join the cache as decode tokens
do (appended; the codes follow through the cache's rebuilds). PQCache.fork() branches a
cache: the copy shares the stored rows with the original (the library's fork) and goes on
on its own, as a second conversation from the same prefix.

Not supported (a clear error says so): a padded batch (an attention mask with zeros),
beam search, layer types other than full and sliding-window attention, a cache used with
a different model.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
import transformers
import transformers.masking_utils
from transformers.cache_utils import Cache as _HFCache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import pqcache

NAME = "pqcache"

# How the pieces meet. transformers' own integrations are a stateless attention function
# over a Cache whose layers store what attention reads: an attention module calls
# cache.update(key, value, layer_idx) (the layer stores the new rows and returns the rows
# to attend over), then the registered attention function with (query, those rows, mask).
# PQCacheLayer keeps as much of that split as pqcache allows, and two things bend it:
#   - storing needs the query: a prompt's keys go in after its last queries are observed
#     (the library weighs each head's PQ distance by them, so observe comes before
#     prefill), and the rows a decode step reads are a selection made with the step's
#     query; update is handed keys and values only. So update only counts the tokens, and
#     the layer stores and gathers in prompt_rows / decode_rows, which the attention
#     function calls with the query;
#   - the attention function is handed no cache: the attention modules take `cache` as an
#     argument of their own forward and pass only the rest of their keyword arguments on.
#     So PQCache.update leaves the cache in a thread-local (_tls) just before the module
#     calls the attention function on the same thread, and the attention function takes
#     it out (once: a later forward pass without a pqcache cache finds none and says so).
_tls = threading.local()


class PQCacheError(pqcache.PQCacheError):
    """Misuse of the transformers backend (the message says what to do instead)."""


class _Hooks:
    """Instrumentation for the tests and benchmarks, off by default; not part of the API.

    recorder: None, or a callable(kind, layer, b, *arrays) called for sequence b at each
    pqcache layer (its index among the pqcache layers) of each prompt ("prefill" for the
    first, "extend" for a later one: queries, keys and values, (T, H, D) float32) and decode
    step ("decode": the query, key and value rows, then the selection, a list per KV head).
    seconds: None, or a dict to which the decode steps add their time: "library" in the
    library's calls (append, select, fetch), "backend" in the whole attention call."""

    def __init__(self) -> None:
        self.recorder: Callable[..., Any] | None = None
        self.seconds: dict[str, float] | None = None

    @contextlib.contextmanager
    def recording(self, recorder: Callable[..., Any] | None) -> Iterator[None]:
        """Sets recorder for the duration of a with block."""
        previous, self.recorder = self.recorder, recorder
        try:
            yield
        finally:
            self.recorder = previous

    def timing(self) -> dict[str, float]:
        """Starts counting decode seconds from zero; returns the dict that collects them."""
        self.seconds = {"library": 0.0, "backend": 0.0}
        return self.seconds


_hooks = _Hooks()


def _model_shape(config):
    """(layers, query heads, KV heads, head size) of a decoder config"""
    config = getattr(config, "get_text_config", lambda: config)()
    try:
        layers, hq = int(config.num_hidden_layers), int(config.num_attention_heads)
        hkv = int(getattr(config, "num_key_value_heads", None) or hq)
        hd = int(getattr(config, "head_dim", None) or config.hidden_size // hq)
    except (AttributeError, TypeError) as e:
        raise PQCacheError("pqcache backend: the model's config has no decoder shape (%s)" % e) from None
    return layers, hq, hkv, hd


def _layer_kinds(config):
    """("full" or "sliding" per layer, the sliding window or None): layer_types where the
    config has them (Gemma 2 and 3, Qwen2 with use_sliding_window), else every layer
    sliding where it has a sliding_window (Mistral's), else every layer full"""
    config = getattr(config, "get_text_config", lambda: config)()
    layers = _model_shape(config)[0]
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise PQCacheError("pqcache backend: layer_types %s: only full_attention and sliding_attention layers "
                               "are supported" % unknown)
        kinds = ["sliding" if t == "sliding_attention" else "full" for t in types]
    else:
        kinds = ["sliding" if window else "full"] * layers
    if len(kinds) != layers:
        raise PQCacheError("pqcache backend: %d layer_types for %d layers" % (len(kinds), layers))
    if "sliding" in kinds and not (isinstance(window, int) and window > 0):
        raise PQCacheError("pqcache backend: sliding-window layers without a sliding_window (%r)" % (window,))
    return kinds, (window if "sliding" in kinds else None)


def _softmax_scale(config, module=None):
    """The model's attention scale for the caches' softmax-sum scores: Gemma's
    query_pre_attn_scalar^-0.5, else the attention module's scaling, else 0 (the
    library's 1/sqrt(head_dim))"""
    qpas = getattr(getattr(config, "get_text_config", lambda: config)(), "query_pre_attn_scalar", None)
    if isinstance(qpas, (int, float)) and qpas > 0:
        return float(qpas) ** -0.5
    scaling = getattr(module, "scaling", None)
    return float(scaling) if isinstance(scaling, (int, float)) and scaling > 0 else 0.0


def _rows(t, f32=False):
    """The (T, H, D) rows of an (H, T, D) tensor, tokens first, as the library reads them: a
    numpy view of the torch storage where that layout is already there (the projections of
    transformers' attention modules make it so: heads-first is a transposed view of it), in
    float32 or float16, or bfloat16 as uint16 (which the binding reads as bfloat16); a copy
    only where the layout or dtype differs (f32: float32 always)."""
    r = t.detach().transpose(0, 1)
    if r.device.type != "cpu":
        r = r.cpu()
    if r.dtype == torch.bfloat16 and not f32:
        return r.contiguous().view(torch.int16).numpy().view(np.uint16)
    if r.dtype not in ((torch.float32,) if f32 else (torch.float32, torch.float16)):
        r = r.float()
    return r.contiguous().numpy()


class PQCacheLayer(CacheLayerMixin):
    """The cache layer of a full-attention layer of a PQCache: its rows live in the
    sequences' pqcache caches (one per sequence of the batch), at pqcache layer `index`.

    update() only counts the new tokens (it sees no query, and pqcache stores a prompt after
    observing its queries and reads a selection made with the query); prompt_rows() and
    decode_rows(), called by the attention function with the query, store the new rows and
    return the rows it attends over.

    Args:
        index: the layer's index among the pqcache layers (PQCache.pq_layer[model layer]).
    """

    is_sliding = False

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        self.index = index
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts the new tokens and hands their rows back to the attention function, which
        stores them (prompt_rows, decode_rows).

        Args:
            key_states: the new tokens' keys, (batch, KV heads, tokens, head size).
            value_states: their values, the same shape.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise PQCacheError("pqcache backend: a cache cannot be reset; make a new one with cache_for(model)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise PQCacheError("pqcache backend: beam search is not supported")

    def prompt_rows(self, c: pqcache.Cache, b: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    observe: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Stores a prompt's tokens of one sequence; returns the keys and values its queries
        attend to, (KV heads, S, head size) float32, and the mask: None for causal over
        the prompt alone, else (T, S), true where a query attends. The first prompt fills
        the cache (prefill, after observing its last `observe` queries; the PQ build
        starts); a later one (the next turn of a conversation) attends densely to every
        token the cache holds and causally among its own, and joins the cache token by
        token as decode tokens do.

        Args:
            c: the sequence's pqcache cache.
            b: the sequence's index in the batch.
            query: (query heads, T, head size), after RoPE.
            key: (KV heads, T, head size), after RoPE.
            value: (KV heads, T, head size).
            observe: the resolved `observe` setting: how many of the last queries to
                observe, -1 for none.
        """
        held = c.tokens(self.index)
        T = query.shape[1]
        if held == 0:
            k_rows, v_rows = _rows(key), _rows(value)
            if observe > 0:
                c.observe(self.index, _rows(query[:, T - min(T, observe):], f32=True))
            c.prefill(self.index, k_rows, v_rows)
            if _hooks.recorder:
                _hooks.recorder("prefill", self.index, b, _rows(query, f32=True), k_rows, v_rows)
            return key.float(), value.float(), None
        past = [c.kv(self.index, h) for h in range(key.shape[0])]
        pk = torch.from_numpy(np.stack([pqcache._to_f32(kh) for kh, _ in past]))   # bfloat16 comes as uint16
        pv = torch.from_numpy(np.stack([pqcache._to_f32(vh) for _, vh in past]))
        allowed = torch.arange(held + T)[None, :] <= held + torch.arange(T)[:, None]
        keys, values = torch.cat([pk, key.float()], 1), torch.cat([pv, value.float()], 1)
        k32, v32 = _rows(key, f32=True), _rows(value, f32=True)
        for t in range(T):
            c.append(self.index, k32[t], v32[t])
        if _hooks.recorder:
            _hooks.recorder("extend", self.index, b, _rows(query, f32=True), k32, v32)
        return keys, values, allowed

    def decode_rows(self, c: pqcache.Cache, b: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    out: pqcache.Selection | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stores a decode step's token of one sequence, selects sinks + top-k + window per KV
        head with its query and returns the selected keys and values, (KV heads, S, head
        size) float32 in selection order, and the mask (KV heads, 1, S), true for a head's
        selected rows (a head's rows past its count are zeros, masked out).

        Args:
            c: the sequence's pqcache cache.
            b: the sequence's index in the batch.
            query: (query heads, 1, head size), after RoPE.
            key: (KV heads, 1, head size), after RoPE.
            value: (KV heads, 1, head size).
            out: a Selection of c to fill (c.selection()), or None for a new one.
        """
        seconds = _hooks.seconds
        t0 = time.perf_counter()
        k1, v1 = _rows(key, f32=True)[0], _rows(value, f32=True)[0]   # (Hkv, D): views at float32
        q1 = _rows(query, f32=True)[0]
        c.append(self.index, k1, v1)
        sel = c.select(self.index, q1, out=out)
        ks, vs = c.fetch(self.index, sel)                            # (Hkv, S, D), rows in selection order
        if seconds is not None:
            seconds["library"] += time.perf_counter() - t0
        if _hooks.recorder:
            _hooks.recorder("decode", self.index, b, q1, k1, v1, sel.tolist())
        cn = np.asarray(sel.counts, dtype=np.int64)
        for h in np.nonzero(cn < ks.shape[1])[0]:
            # rows past a head's count are whatever the buffer held: masked out, but a NaN
            # there would still reach the output (NaN + -inf is NaN, 0 x NaN is NaN)
            ks[h, cn[h]:] = 0.0
            vs[h, cn[h]:] = 0.0
        mask = torch.arange(ks.shape[1])[None, None, :] < torch.from_numpy(cn)[:, None, None]
        return torch.from_numpy(ks), torch.from_numpy(vs), mask


class PQCache(_HFCache):
    """A transformers Cache whose full-attention layers (PQCacheLayer) keep their keys and
    values in pqcache caches, one per sequence of the batch (made at the prompt, when the
    batch size is known), over those layers only; sliding-window layers keep transformers'
    own sliding cache layers and attention. Made by cache_for().

    Args:
        config: the model's config (its shape, layer types and sliding window).
        runtime: a pqcache.Runtime for the caches' background work, or None (inline).
        **settings: pqcache.Cache's settings (budget_ratio, n_sink, window, m, bits, ...);
            the shape and the RoPE layout come from config.

    Attributes:
        pq_layer: model layer -> its pqcache layer, for the full-attention layers.
        resolved: the settings every sequence's cache gets, as the library resolves them
            (pqcache.resolve: each default filled in), a dict of pqcache.Cache's keywords.
        caches: the sequences' pqcache.Cache objects (empty before the first prompt).
    """

    def __init__(self, config: transformers.PretrainedConfig, runtime: pqcache.Runtime | None = None,
                 **settings: Any) -> None:
        self.shape = _model_shape(config)
        self.kinds, window = _layer_kinds(config)
        self.pq_layer = {}
        for layer, kind in enumerate(self.kinds):
            if kind == "full":
                self.pq_layer[layer] = len(self.pq_layer)
        super().__init__(layers=[PQCacheLayer(self.pq_layer[l]) if kind == "full"
                                 else DynamicSlidingWindowLayer(sliding_window=window)
                                 for l, kind in enumerate(self.kinds)])
        if "budget_ratio" in settings and not (isinstance(settings["budget_ratio"], (int, float))
                                               and settings["budget_ratio"] > 0):
            # the library reads 0 as its default; here it is a mistake
            raise PQCacheError("pqcache backend: budget_ratio %r: a share of the tokens in (0, 1e6] (1 attends "
                               "to every token)" % (settings["budget_ratio"],))
        layers, hq, hkv, hd = self.shape
        # (a model of sliding-window layers only makes no pqcache cache: its settings are checked as one layer's)
        self._desc = dict(n_layers=len(self.pq_layer) or 1, n_q_heads=hq, n_kv_heads=hkv, head_dim=hd, rope="half",
                          softmax_scale=_softmax_scale(config))
        self._desc.update(settings)
        try:
            self.resolved = pqcache.resolve(runtime, **self._desc)
        except (pqcache.PQCacheError, TypeError) as e:
            raise PQCacheError("pqcache backend: %s" % e) from e
        self.runtime = runtime
        self.settings = dict(settings)
        self.caches: list[pqcache.Cache] = []
        self._sels: list[pqcache.Selection] = []
        self._modules: dict[int, int] = {}   # model layer -> the attention module that ran it (one model per cache)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' Cache.update; also leaves this cache where the attention function
        that follows finds it (see the comment at _tls).

        Args:
            key_states: the new tokens' keys, (batch, KV heads, tokens, head size).
            value_states: their values, the same shape.
            layer_idx: the model layer.
        """
        _tls.cache = self
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _make(self, batch, hkv, hd, module=None):
        layers, hq, mkv, mhd = self.shape
        if (hkv, hd) != (mkv, mhd):
            raise PQCacheError("pqcache backend: keys of %d heads of %d, the cache was made for %d of %d "
                               "(a cache is for one model)" % (hkv, hd, mkv, mhd))
        if not self.caches:
            if not self._desc.get("softmax_scale"):   # not in the config: the attention module's scaling
                self._desc["softmax_scale"] = _softmax_scale(None, module)
                self.resolved["softmax_scale"] = pqcache.resolve(self.runtime, **self._desc)["softmax_scale"]
            self.caches = [pqcache.Cache(self.runtime, **self._desc) for _ in range(batch)]
            self._sels = [c.selection() for c in self.caches]
        elif len(self.caches) != batch:
            raise PQCacheError("pqcache backend: a batch of %d, the cache holds %d sequences" % (batch, len(self.caches)))

    def _bind(self, layer, module):
        """Checks that module (the attention module running model layer `layer`) is the one that ran it before."""
        if self._modules.setdefault(layer, id(module)) != id(module):
            raise PQCacheError("pqcache backend: this cache holds another model's layer %d (a cache is for one model "
                               "and its conversation; make a new one with cache_for(model))" % layer)

    def fork(self) -> PQCache:
        """A new cache that holds what this one holds and goes on independently: its pqcache
        caches are forks of this one's (pqcache.Cache.fork: the stored rows are shared, not
        copied), its sliding-window layers copies of this one's. generate() on the fork with
        this cache's tokens and more continues from here, as it would on this cache, and
        leaves this one as it was. For the same model; between forward passes.
        """
        new = copy.copy(self)
        new.layers = []
        for layer in self.layers:
            layer = copy.copy(layer)
            if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized:
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            new.layers.append(layer)
        new.caches = []
        try:
            for c in self.caches:
                new.caches.append(c.fork())
        except BaseException:
            new.close()
            raise
        new._sels = [c.selection() for c in new.caches]
        new.settings = dict(self.settings)
        new._desc = dict(self._desc)
        new.resolved = dict(self.resolved)
        new._modules = dict(self._modules)
        return new

    def close(self) -> None:
        """Frees the sequences' pqcache caches (the cache can take a new prompt after)."""
        for c in self.caches:
            c.close()
        self.caches = []
        self._sels = []


def cache_for(model: transformers.PreTrainedModel, runtime: pqcache.Runtime | None = None,
              **settings: Any) -> PQCache:
    """A PQCache for model (its config's shape and RoPE layout), for generate(cache=...) (called
    past_key_values before transformers 5.24).

    Args:
        model: a model loaded with attn_implementation="pqcache" (from_pretrained, from_config).
        runtime: a pqcache.Runtime for the caches' background work, or None (inline).
        **settings: pqcache.Cache's settings (budget_ratio, n_sink, window, m, bits, ...).
    """
    if getattr(model.config, "_attn_implementation", None) != NAME:
        raise PQCacheError("pqcache backend: the model runs attn_implementation=%r; load it with "
                           "attn_implementation=\"pqcache\" (pqcache_hf.from_pretrained does)"
                           % getattr(model.config, "_attn_implementation", None))
    return PQCache(model.config, runtime, **settings)


def _attend(query, keys, values, mask, scale):
    """torch's SDPA: query (Hq, T, D), keys and values (Hkv, S, D), float32; mask None
    (causal), (T, S) (shared by the heads) or (Hkv, 1, S) (one query token, a mask per KV
    head). Returns (Hq, T, D)."""
    hq, T, D = query.shape
    hkv = keys.shape[0]
    F = torch.nn.functional
    if mask is not None and mask.dim() == 3:
        # a KV head's query heads as its query rows (transformers' pack_gqa for one token):
        # the mask per KV head applies to all of them, no key or value is repeated
        o = F.scaled_dot_product_attention(query.reshape(1, hkv, hq // hkv, D), keys[None], values[None],
                                           attn_mask=mask[None], scale=scale)
        return o.reshape(hq, 1, D)
    # the causal prompt: torch's memory-efficient kernel, no T x T matrix at long prompts
    o = F.scaled_dot_product_attention(query[None], keys[None], values[None], attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0]


def pqcache_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None = None,
                              dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as "pqcache". A full-attention layer's rows come
    from its PQCacheLayer (the prompt's own, densely and causally; a decode step's
    selection), attended by torch's SDPA; a sliding-window layer runs transformers' own SDPA
    attention over its own cache layer.

    Args:
        module: the attention module (its layer_idx).
        query: (batch, query heads, T, head size), after RoPE.
        key: (batch, KV heads, T, head size) of the T new tokens, after RoPE (as the cache
            layer's update returned them).
        value: (batch, KV heads, T, head size).
        attention_mask: pqcache_mask's (None for a full-attention layer).
        scaling: the softmax scale (None: head size ** -0.5).
        dropout: transformers' attention dropout (a sliding-window layer's only).

    Returns:
        ((batch, T, query heads, head size), None).
    """
    t_enter = time.perf_counter()
    cache = getattr(_tls, "cache", None)
    _tls.cache = None
    if not isinstance(cache, PQCache):
        raise PQCacheError("pqcache backend: no pqcache cache for this forward pass; pass "
                           "cache=pqcache_hf.cache_for(model) to generate() or to the model")
    cache._bind(int(module.layer_idx), module)
    layer = cache.layers[int(module.layer_idx)]
    if not isinstance(layer, PQCacheLayer):   # a sliding-window layer: transformers' own cache layer and attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and torch.is_tensor(attention_mask) and attention_mask.dtype == torch.bool \
            and not bool(attention_mask.all()):
        raise PQCacheError("pqcache backend: a padded batch is not supported (one sequence, or unpadded ones)")
    B, hq, T, D = query.shape
    scale = float(scaling) if scaling is not None else D ** -0.5
    cache._make(B, key.shape[1], key.shape[3], module)
    observe = int(cache.resolved["observe"])
    out = torch.empty((B, T, hq, D), dtype=torch.float32)
    decode = False
    for b, c in enumerate(cache.caches):
        if T > 1 or c.tokens(layer.index) == 0:
            keys, values, mask = layer.prompt_rows(c, b, query[b], key[b], value[b], observe)
        else:
            decode = True
            keys, values, mask = layer.decode_rows(c, b, query[b], key[b], value[b], out=cache._sels[b])
        out[b] = _attend(query[b].float(), keys, values, mask, scale).transpose(0, 1)
    if decode and _hooks.seconds is not None:
        _hooks.seconds["backend"] += time.perf_counter() - t_enter
    return out.to(query.dtype), None


def pqcache_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered as "pqcache": none for the full-attention layers (the prompt attends
    causally and a decode step over its selection); a sliding-window layer's (transformers passes its
    window as local_size) is transformers' own SDPA mask. A padded batch is refused here, where the padding
    mask is still in sight.

    Args:
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask: as
            transformers' mask functions take them (masking_utils.sdpa_mask).
        **kwargs: the rest of them (local_size: a sliding-window layer's window).
    """
    if attention_mask is not None and torch.is_tensor(attention_mask) and not bool(attention_mask.bool().all()):
        raise PQCacheError("pqcache backend: a padded batch is not supported (one sequence, or unpadded ones "
                           "of equal length)")
    if kwargs.get("local_size") is not None:
        if mask_function is not None:
            kwargs["mask_function"] = mask_function
        return transformers.masking_utils.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                                    attention_mask=attention_mask, **kwargs)
    return None


def register() -> None:
    """Registers the "pqcache" attention and mask functions with transformers (idempotent)."""
    transformers.AttentionInterface.register(NAME, pqcache_attention_forward)
    transformers.masking_utils.AttentionMaskInterface.register(NAME, pqcache_mask)


def from_pretrained(path: str, **kwargs: Any) -> transformers.PreTrainedModel:
    """AutoModelForCausalLM.from_pretrained(path, attn_implementation="pqcache", **kwargs).

    Args:
        path: a model directory or hub name.
        **kwargs: from_pretrained's (dtype, ...).
    """
    register()
    kwargs.setdefault("attn_implementation", NAME)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)


def from_config(config: transformers.PretrainedConfig, **kwargs: Any) -> transformers.PreTrainedModel:
    """AutoModelForCausalLM.from_config(config, attn_implementation="pqcache", **kwargs), on a copy of
    config (transformers records the attention implementation in the config it is given).

    Args:
        config: the model's config.
        **kwargs: from_config's.
    """
    register()
    kwargs.setdefault("attn_implementation", NAME)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)


# the previous names, deprecated: kept for one release
PQCacheHF = PQCache
pqcache_attention = pqcache_attention_forward
