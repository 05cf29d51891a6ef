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
full-attention layers, one pqcache cache over just those (PQCacheHF.pq_layer maps a
model layer to its pqcache layer).

What happens: the prompt's forward pass observes each layer's last queries
(`observe` settings: the library's default 32), stores its keys and values in the
sequence's pqcache cache (every full-attention layer, every KV head; the layer's PQ
build starts in the background) and attends densely and causally over the prompt, as
the model would. Each decode step appends the new token's key and value, selects sinks
+ top-k + window per KV head with the step's queries, gathers the selected rows and
attends over them.
The settings of cache_for are pqcache.Cache's (budget_ratio, m, bits, ...); the shape
of the model (layers, heads, head size) and the RoPE layout come from its config.

A later prompt on the same cache (the next turn of a conversation: generate() again with
the whole conversation so far and the same cache) attends densely to every token the
cache holds and causally among its own, then its tokens join the cache as decode tokens
do (appended; the codes follow through the cache's rebuilds).

Not supported (a clear error says so): a padded batch (an attention mask with zeros),
beam search, layer types other than full and sliding-window attention, a cache used with
a different model.
"""
import copy
import threading
import time

import numpy as np
import torch
import transformers
import transformers.masking_utils
from transformers.cache_utils import Cache as _HFCache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import pqcache

NAME = "pqcache"
_tls = threading.local()   # the cache whose layer is being run, set by its update


class PQCacheError(pqcache.PQCacheError):
    """Misuse of the transformers backend (the message says what to do instead)."""


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


def _softmax_scale(config, module):
    """The model's attention scale for the caches' softmax-sum scores: Gemma's
    query_pre_attn_scalar^-0.5, else the attention module's scaling, else 0 (the
    library's 1/sqrt(head_dim))"""
    qpas = getattr(getattr(config, "get_text_config", lambda: config)(), "query_pre_attn_scalar", None)
    if isinstance(qpas, (int, float)) and qpas > 0:
        return float(qpas) ** -0.5
    scaling = getattr(module, "scaling", None)
    return float(scaling) if isinstance(scaling, (int, float)) and scaling > 0 else 0.0


class _Layer(CacheLayerMixin):
    """One layer of a PQCacheHF: counts the tokens; the rows live in the pqcache caches."""

    is_sliding = False

    def __init__(self):
        super().__init__()
        self.seen = 0

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states   # the new tokens' rows: the attention function stores them

    def get_mask_sizes(self, query_length):
        return self.seen + query_length, 0

    def get_seq_length(self):
        return self.seen

    def get_max_length(self):
        return -1

    def reset(self):
        raise PQCacheError("pqcache backend: a cache cannot be reset; make a new one with cache_for(model)")

    def reorder_cache(self, beam_idx):
        raise PQCacheError("pqcache backend: beam search is not supported")


class PQCacheHF(_HFCache):
    """A transformers Cache whose full-attention layers keep their keys and values in
    pqcache caches, one per sequence of the batch (made at the prompt, when the batch size
    is known), over those layers only; sliding-window layers keep transformers' own
    sliding cache layers and attention. Made by cache_for()."""

    def __init__(self, config, runtime=None, **settings):
        self.shape = _model_shape(config)
        self.kinds, window = _layer_kinds(config)
        # model layer -> the pqcache caches' layer, for the full-attention layers
        self.pq_layer = {}
        for layer, kind in enumerate(self.kinds):
            if kind == "full":
                self.pq_layer[layer] = len(self.pq_layer)
        super().__init__(layers=[_Layer() if kind == "full" else DynamicSlidingWindowLayer(sliding_window=window)
                                 for kind in self.kinds])
        self.runtime = runtime
        self.model_config = config
        self.settings = dict(settings)
        self.caches = []           # pqcache.Cache per sequence
        self._sels = []
        self.recorder = None       # tests: a callable(kind, layer, b, arrays...) seeing every call
        self._modules = {}         # layer -> the attention module that ran it (one model per cache)
        # seconds of the decode steps' attention: in the library's calls (append, select,
        # fetch) and in this module around them (copies, the attention over the selection)
        self.seconds = {"library": 0.0, "backend": 0.0}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        _tls.cache = self
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _make(self, batch, hkv, hd, module=None):
        layers, hq, mkv, mhd = self.shape
        if (hkv, hd) != (mkv, mhd):
            raise PQCacheError("pqcache backend: keys of %d heads of %d, the cache was made for %d of %d "
                               "(a cache is for one model)" % (hkv, hd, mkv, mhd))
        if not self.caches:
            s = dict(n_layers=len(self.pq_layer), n_q_heads=hq, n_kv_heads=hkv, head_dim=hd, rope="half",
                     softmax_scale=_softmax_scale(self.model_config, module))
            s.update(self.settings)
            self.caches = [pqcache.Cache(self.runtime, **s) for _ in range(batch)]
            self._sels = [c.selection() for c in self.caches]
        elif len(self.caches) != batch:
            raise PQCacheError("pqcache backend: a batch of %d, the cache holds %d sequences" % (batch, len(self.caches)))

    def close(self):
        for c in self.caches:
            c.close()
        self.caches = []


def cache_for(model, runtime=None, **settings):
    """A PQCacheHF for model (its config's shape and RoPE layout), for generate(cache=...) (called
    past_key_values before transformers 5.24).
    settings: pqcache.Cache's (budget_ratio, n_sink, window, m, bits, ...); runtime: a pqcache.Runtime."""
    if getattr(model.config, "_attn_implementation", None) != NAME:
        raise PQCacheError("pqcache backend: the model runs attn_implementation=%r; load it with "
                           "attn_implementation=\"pqcache\" (pqcache_hf.from_pretrained does)"
                           % getattr(model.config, "_attn_implementation", None))
    if "budget_ratio" in settings and not (isinstance(settings["budget_ratio"], (int, float))
                                           and 0 < settings["budget_ratio"] <= 1e6):
        raise PQCacheError("pqcache backend: budget_ratio %r: a share of the tokens in (0, 1e6] (1 attends "
                           "to every token)" % (settings["budget_ratio"],))
    cache = PQCacheHF(model.config, runtime, **settings)
    cache.model_id = id(model)
    return cache


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


def _prompt(cache, c, layer, b, query, key, value, scale):
    """A prompt's tokens (one sequence): observed and stored; they attend densely to every
    token the cache holds and causally among themselves, as the model would. The first
    prompt fills the cache (prefill: its PQ build starts); a later one (the next turn of a
    conversation) joins it token by token as decode tokens do."""
    held = c.tokens(layer)
    T = query.shape[1]
    q = query.float()[None]
    k, v = key.float()[None], value.float()[None]
    if held == 0:
        k_rows, v_rows = _rows(key), _rows(value)
        n_obs = int(cache.settings.get("observe", 32) or 32)
        if int(cache.settings.get("observe", 32)) >= 0:
            c.observe(layer, _rows(query[:, T - min(T, n_obs):], f32=True))
        c.prefill(layer, k_rows, v_rows)
        if cache.recorder:
            cache.recorder("prefill", layer, b, _rows(query, f32=True), k_rows, v_rows)
        # torch's memory-efficient kernel: no T x T matrix at long prompts
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    past = [c.kv(layer, h) for h in range(key.shape[0])]
    pk = torch.from_numpy(np.stack([pqcache._to_f32(kh) for kh, _ in past]))[None]   # bfloat16 comes as uint16
    pv = torch.from_numpy(np.stack([pqcache._to_f32(vh) for _, vh in past]))[None]
    allowed = torch.arange(held + T)[None, :] <= held + torch.arange(T)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2),
                                                         attn_mask=allowed, scale=scale, enable_gqa=True)
    k32, v32 = _rows(key, f32=True), _rows(value, f32=True)
    for t in range(T):
        c.append(layer, k32[t], v32[t])
    if cache.recorder:
        cache.recorder("extend", layer, b, _rows(query, f32=True), k32, v32)
    return o[0].transpose(0, 1)


def pqcache_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as "pqcache": query (B, Hq, T, D) post-RoPE, key
    and value (B, Hkv, T, D) of the T new tokens; returns ((B, T, Hq, D), None)."""
    t_enter = time.perf_counter()
    cache = getattr(_tls, "cache", None)
    _tls.cache = None
    if not isinstance(cache, PQCacheHF):
        raise PQCacheError("pqcache backend: no pqcache cache for this forward pass; pass "
                           "cache=pqcache_hf.cache_for(model) to generate() or to the model")
    layer = int(module.layer_idx)
    if cache._modules.setdefault(layer, id(module)) != id(module):
        raise PQCacheError("pqcache backend: this cache holds another model's layer %d (a cache is for one model "
                           "and its conversation; make a new one with cache_for(model))" % layer)
    if layer not in cache.pq_layer:   # a sliding-window layer: transformers' own cache layer and attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = cache.pq_layer[layer]     # the pqcache caches' layer
    if attention_mask is not None and torch.is_tensor(attention_mask) and attention_mask.dtype == torch.bool \
            and not bool(attention_mask.all()):
        raise PQCacheError("pqcache backend: a padded batch is not supported (one sequence, or unpadded ones)")
    B, hq, T, D = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    scale = float(scaling) if scaling is not None else D ** -0.5
    cache._make(B, hkv, key.shape[3], module)
    out = torch.empty((B, T, hq, D), dtype=torch.float32)
    for b, c in enumerate(cache.caches):
        if T > 1 or c.tokens(layer) == 0:
            out[b] = _prompt(cache, c, layer, b, query[b], key[b], value[b], scale)
            continue
        t0 = time.perf_counter()
        k1, v1 = _rows(key[b], f32=True)[0], _rows(value[b], f32=True)[0]   # (Hkv, D): views at float32
        q1 = _rows(query[b], f32=True)[0]
        c.append(layer, k1, v1)
        sel = c.select(layer, q1, out=cache._sels[b])
        ks, vs = c.fetch(layer, sel)                             # (Hkv, S, D), rows in selection order
        cache.seconds["library"] += time.perf_counter() - t0
        if cache.recorder:
            cache.recorder("decode", layer, b, q1, k1, v1, sel.tolist())
        cn = np.asarray(sel.counts, dtype=np.int64)
        for h in np.nonzero(cn < vs.shape[1])[0]:
            vs[h, cn[h]:] = 0.0   # rows past a head's count are whatever the buffer held: 0 x NaN is NaN
        counts = torch.from_numpy(cn)
        kt, vt = torch.from_numpy(ks), torch.from_numpy(vs)
        qh = torch.from_numpy(q1).view(hkv, g, D)
        s = (qh @ kt.transpose(1, 2)) * scale                    # (Hkv, g, S)
        pad = torch.arange(kt.shape[1])[None, :] >= counts[:, None]
        s = s.masked_fill(pad[:, None, :], float("-inf"))
        out[b, 0] = (torch.softmax(s, dim=-1) @ vt).reshape(hq, D)
    if T == 1:
        cache.seconds["backend"] += time.perf_counter() - t_enter
    return out.to(query.dtype), None


def pqcache_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 **kwargs):
    """The mask function registered as "pqcache": none for the full-attention layers (the prompt attends
    causally and a decode step over its selection); a sliding-window layer's (transformers passes its
    window as local_size) is transformers' own SDPA mask. A padded batch is refused here, where the padding
    mask is still in sight."""
    if attention_mask is not None and torch.is_tensor(attention_mask) and not bool(attention_mask.bool().all()):
        raise PQCacheError("pqcache backend: a padded batch is not supported (one sequence, or unpadded ones "
                           "of equal length)")
    if kwargs.get("local_size") is not None:
        if mask_function is not None:
            kwargs["mask_function"] = mask_function
        return transformers.masking_utils.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                                    attention_mask=attention_mask, **kwargs)
    return None


def register():
    """Registers the "pqcache" attention and mask functions with transformers (idempotent)."""
    transformers.AttentionInterface.register(NAME, pqcache_attention)
    transformers.masking_utils.AttentionMaskInterface.register(NAME, pqcache_mask)


def from_pretrained(path, **kwargs):
    """AutoModelForCausalLM.from_pretrained(path, attn_implementation="pqcache", **kwargs)"""
    register()
    kwargs.setdefault("attn_implementation", NAME)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)


def from_config(config, **kwargs):
    """AutoModelForCausalLM.from_config(config, attn_implementation="pqcache", **kwargs), on a copy of
    config (transformers records the attention implementation in the config it is given)"""
    register()
    kwargs.setdefault("attn_implementation", NAME)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)
