#!/usr/bin/env python3
"""Writes a llama2.c checkpoint (version 1, fp32; the pqcache extension's rope_theta at
byte 40) as a Hugging Face Llama directory: config.json and model.safetensors (fp32).

llama2.c rotates interleaved pairs (dims 2i, 2i+1 of a head), Hugging Face the halves
(i, i + head_size/2): the rows of wq and wk are reordered within each head so that the
same pairs turn together (q.k is unchanged, since both are reordered alike).

usage: python3 examples/tiny_llama/export_hf.py MODEL.bin OUT_DIR
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_model  # noqa: E402


def read_llama2c(path):
    data = open(path, "rb").read()
    magic, version, dim, hidden, layers, heads, kv_heads, vocab, seq = struct.unpack_from("<Ii7i", data, 0)
    if magic != 0x616B3432 or version != 1:
        raise SystemExit("%s: not a llama2.c version 1 checkpoint" % path)
    shared = data[36]
    theta = struct.unpack_from("<f", data, 40)[0] or 10000.0
    f = np.frombuffer(data, dtype="<f4", offset=256)
    hs = dim // heads
    at = [0]

    def take(*shape):
        n = int(np.prod(shape))
        a = f[at[0]:at[0] + n].reshape(shape).astype(np.float64)
        at[0] += n
        return a

    w = dict(rms_att=take(layers, dim), rms_ffn=take(layers, dim), rms_final=take(dim),
             emb=take(vocab, dim), wq=take(layers, dim, dim), wk=take(layers, kv_heads * hs, dim),
             wv=take(layers, kv_heads * hs, dim), wo=take(layers, dim, dim), w1=take(layers, hidden, dim),
             w2=take(layers, dim, hidden), w3=take(layers, hidden, dim))
    w["wcls"] = w["emb"] if shared else take(vocab, dim)
    cfg = dict(dim=dim, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, seq=seq,
               theta=float(theta), shared=bool(shared))
    return cfg, w


def half_split(m, n_heads):
    """rows of a (n_heads * hs, in) matrix from interleaved pairs to halves, per head"""
    hs = m.shape[0] // n_heads
    return m.reshape(n_heads, hs // 2, 2, m.shape[1]).transpose(0, 2, 1, 3).reshape(m.shape)


def export(src, out):
    c, w = read_llama2c(src)
    os.makedirs(out, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["dim"],
        "intermediate_size": c["hidden"], "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"], "max_position_embeddings": c["seq"],
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": c["shared"],
        "rope_parameters": {"rope_type": "default", "rope_theta": c["theta"]}, "torch_dtype": "float32",
    }
    t = {"model.embed_tokens.weight": w["emb"], "model.norm.weight": w["rms_final"]}
    if not c["shared"]:
        t["lm_head.weight"] = w["wcls"]
    for i in range(c["layers"]):
        p = "model.layers.%d." % i
        t[p + "input_layernorm.weight"] = w["rms_att"][i]
        t[p + "post_attention_layernorm.weight"] = w["rms_ffn"][i]
        t[p + "self_attn.q_proj.weight"] = half_split(w["wq"][i], c["heads"])
        t[p + "self_attn.k_proj.weight"] = half_split(w["wk"][i], c["kv_heads"])
        t[p + "self_attn.v_proj.weight"] = w["wv"][i]
        t[p + "self_attn.o_proj.weight"] = w["wo"][i]
        t[p + "mlp.gate_proj.weight"] = w["w1"][i]
        t[p + "mlp.down_proj.weight"] = w["w2"][i]
        t[p + "mlp.up_proj.weight"] = w["w3"][i]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    hf_model.write_safetensors(os.path.join(out, "model.safetensors"), t, "fp32")
    return config


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    export(sys.argv[1], sys.argv[2])
