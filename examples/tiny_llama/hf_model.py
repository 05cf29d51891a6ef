"""hf_model.py - small random models in the Hugging Face layout, and a NumPy
reference forward pass, for tiny_llama's tests (no downloads).

write_model(directory, **options) writes config.json and model.safetensors
(or sharded model-0000i-of-0000n.safetensors files with
model.safetensors.index.json) for LlamaForCausalLM, MistralForCausalLM or
Qwen2ForCausalLM, with bf16, fp16 or fp32 weights, and returns the weights as
float64 arrays (the values the files hold, after conversion).

reference_logits(config, weights, tokens) runs the model the way the Hugging
Face modeling code defines it (RMSNorm, rotate_half rotary embeddings with the
config's rope_scaling, grouped-query causal attention, SiLU-gated MLP) and
returns the logits of every position. It is written from the architecture's
definition in float64, independently of the C engine.

write_safetensors(path, tensors, dtype) writes one safetensors file; it is
also what the tests use to build damaged files.

Command line: python3 hf_model.py DIR [--arch llama|mistral|qwen2]
[--dtype bf16|fp16|fp32] [--shards N] [--tie] writes a model.
"""
import json
import os
import struct
import sys

import numpy as np

DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def to_bf16_bits(a):
    """float32 -> bf16 bit patterns (round to nearest even)"""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def quantize(a, dtype):
    """(bytes as stored, the float64 values they hold)"""
    if dtype == "fp32":
        s = np.ascontiguousarray(a, dtype=np.float32)
        return s.tobytes(), s.astype(np.float64)
    if dtype == "fp16":
        s = np.ascontiguousarray(a, dtype=np.float16)
        return s.tobytes(), s.astype(np.float64)
    bits = to_bf16_bits(a)
    return bits.tobytes(), from_bf16_bits(bits).astype(np.float64)


def safetensors_bytes(items):
    """items: list of (name, dtype tag, shape, raw bytes) -> file bytes"""
    header, off, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, tag, shape, raw in items:
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def write_safetensors(path, tensors, dtype):
    """tensors: dict name -> float array; returns name -> float64 values stored"""
    items, values = [], {}
    for name, a in tensors.items():
        raw, v = quantize(a, dtype)
        items.append((name, DTYPES[dtype], a.shape, raw))
        values[name] = v.reshape(a.shape)
    with open(path, "wb") as f:
        f.write(safetensors_bytes(items))
    return values


ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def make_config(arch="llama", dim=64, hidden=96, layers=2, heads=4, kv_heads=2, vocab=97,
                head_dim=None, tie=False, rope_scaling=None, max_pos=512, rope_theta=10000.0,
                eps=1e-5, layout="v4"):
    """layout "v4": top-level rope_theta and rope_scaling; "v5": one rope_parameters
    object holding both, as transformers writes it since version 5."""
    c = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "hidden_size": dim,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": tie,
        "rope_scaling": rope_scaling,
        "torch_dtype": "bfloat16",
    }
    if layout == "v5":
        rp = {"rope_type": "default"}
        for k, v in (rope_scaling or {}).items():
            rp["rope_type" if k == "type" else k] = v
        rp["rope_theta"] = rope_theta
        del c["rope_theta"], c["rope_scaling"]
        c["rope_parameters"] = rp
    if head_dim is not None:
        c["head_dim"] = head_dim
    if arch == "mistral":
        c["sliding_window"] = None
    return c


def random_tensors(c, seed=0):
    rng = np.random.default_rng(seed)
    dim, hid, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or dim // nh
    V = c["vocab_size"]
    qwen = c["architectures"][0] == "Qwen2ForCausalLM"

    def mat(r, k):
        return rng.standard_normal((r, k)) / np.sqrt(k)

    t = {"model.embed_tokens.weight": rng.standard_normal((V, dim)),
         "model.norm.weight": 1.0 + 0.1 * rng.standard_normal(dim)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = mat(V, dim)
    for i in range(L):
        p = "model.layers.%d." % i
        t[p + "input_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(dim)
        t[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * rng.standard_normal(dim)
        t[p + "self_attn.q_proj.weight"] = mat(nh * hd, dim)
        t[p + "self_attn.k_proj.weight"] = mat(nkv * hd, dim)
        t[p + "self_attn.v_proj.weight"] = mat(nkv * hd, dim)
        t[p + "self_attn.o_proj.weight"] = mat(dim, nh * hd)
        t[p + "mlp.gate_proj.weight"] = mat(hid, dim)
        t[p + "mlp.up_proj.weight"] = mat(hid, dim)
        t[p + "mlp.down_proj.weight"] = mat(dim, hid)
        if qwen:
            t[p + "self_attn.q_proj.bias"] = 0.1 * rng.standard_normal(nh * hd)
            t[p + "self_attn.k_proj.bias"] = 0.1 * rng.standard_normal(nkv * hd)
            t[p + "self_attn.v_proj.bias"] = 0.1 * rng.standard_normal(nkv * hd)
    return t


def write_model(directory, dtype="bf16", shards=1, seed=0, **config_options):
    """Writes a random model; returns (config, weights as float64)."""
    os.makedirs(directory, exist_ok=True)
    c = make_config(**config_options)
    tensors = random_tensors(c, seed)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    values = {}
    if shards == 1:
        values = write_safetensors(os.path.join(directory, "model.safetensors"), tensors, dtype)
    else:
        names = list(tensors)
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = "model-%05d-of-%05d.safetensors" % (s + 1, shards)
            values.update(write_safetensors(os.path.join(directory, fname),
                                            {n: tensors[n] for n in part}, dtype))
            weight_map.update({n: fname for n in part})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)
    return c, values


# ----- the reference forward pass ------------------------------------------------------

def rope_settings(c):
    """(theta, scaling dict or None) of a config in either layout"""
    rp = c.get("rope_parameters")
    if rp:
        scaling = None if rp.get("rope_type", "default") == "default" else rp
        return float(rp.get("rope_theta", c.get("rope_theta", 10000.0))), scaling
    return float(c.get("rope_theta", 10000.0)), c.get("rope_scaling")


def inv_frequencies(c, hd):
    base, rs = rope_settings(c)
    inv = 1.0 / base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        low_wl, high_wl = old / lo, old / hi
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(medium, blended, scaled)
    return inv


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def reference_logits(c, w, tokens):
    dim, L = c["hidden_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or dim // nh
    eps = c["rms_norm_eps"]
    T = len(tokens)
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    inv = inv_frequencies(c, hd)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        p = "model.layers.%d." % i
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = h @ w[p + "self_attn.q_proj.weight"].T
        k = h @ w[p + "self_attn.k_proj.weight"].T
        v = h @ w[p + "self_attn.v_proj.weight"].T
        if p + "self_attn.q_proj.bias" in w:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description="write a small random model in the Hugging Face layout")
    ap.add_argument("dir")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--vocab", type=int, default=97)
    ap.add_argument("--max-pos", type=int, default=512)
    a = ap.parse_args(argv)
    write_model(a.dir, dtype=a.dtype, shards=a.shards, arch=a.arch, tie=a.tie, vocab=a.vocab,
                max_pos=a.max_pos)


if __name__ == "__main__":
    main(sys.argv[1:])
