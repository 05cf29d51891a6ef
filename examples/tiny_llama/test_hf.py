"""Hugging Face checkpoints in tiny_llama (pytest; run by make tiny_llama_test).

Small random models in the Hugging Face layout (hf_model.py) for every
supported variant: the engine's logits agree with an independent NumPy
forward pass, pqcache at a budget of the whole sequence gives the logits of
full attention to the bit, and damaged directories are refused with a
message, never a crash.

TINY_LLAMA (environment) names the binary, default build/tiny_llama; the
sanitizer build runs the refusal tests (make test-example-san).
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import hf_model  # noqa: E402

BIN = os.environ.get("TINY_LLAMA", os.path.join(ROOT, "build", "tiny_llama"))


def run(args, check=True):
    p = subprocess.run([BIN] + [str(a) for a in args], capture_output=True, text=True, timeout=600)
    assert p.returncode < 128 and p.returncode >= 0, "crashed (%d): %s" % (p.returncode, p.stderr)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def prompt_ids(n, vocab, seed=1):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def generate(model_dir, tokens, steps, tmp_path, name, extra=()):
    """greedy run; returns (generated ids, logits per step)"""
    ids = tmp_path / (name + ".ids")
    ids.write_text(" ".join(map(str, tokens)))
    out = tmp_path / (name + ".logits")
    p = run([model_dir, "-I", ids, "-n", steps, "-t", 0, "-o", out] + list(extra))
    gen = [int(t) for t in p.stdout.split()]
    logits = np.fromfile(out, dtype=np.float32)
    assert len(gen) == steps
    return gen, logits.reshape(steps, -1), out.read_bytes()


VARIANTS = {
    # name: (dtype, shards, config options)
    "llama-bf16-tied-gqa2": ("bf16", 1, dict(arch="llama", tie=True, heads=4, kv_heads=2)),
    "llama-fp32-sharded-gqa1": ("fp32", 3, dict(arch="llama", heads=4, kv_heads=4)),
    "llama-fp16-linear-gqa4": ("fp16", 1, dict(arch="llama", heads=8, kv_heads=2,
                                               rope_scaling={"type": "linear", "factor": 4.0})),
    "llama-bf16-llama3-headdim": ("bf16", 2, dict(
        arch="llama", heads=4, kv_heads=1, head_dim=32, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral-bf16-gqa4": ("bf16", 1, dict(arch="mistral", heads=8, kv_heads=2)),
    "qwen2-bf16-bias-tied": ("bf16", 1, dict(arch="qwen2", tie=True, heads=4, kv_heads=2, eps=1e-6)),
    "qwen2-fp16-bias-gqa1": ("fp16", 2, dict(arch="qwen2", heads=2, kv_heads=2, dim=48, hidden=80)),
    # the layout transformers writes since version 5: one rope_parameters object
    "llama-bf16-llama3-v5": ("bf16", 1, dict(
        arch="llama", heads=4, kv_heads=2, rope_theta=500000.0, layout="v5",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral-fp32-linear-v5": ("fp32", 1, dict(arch="mistral", heads=8, kv_heads=2, rope_theta=1e6,
                                               layout="v5", rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-bf16-theta-v5": ("bf16", 1, dict(arch="qwen2", heads=4, kv_heads=2, rope_theta=1e6, layout="v5")),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}
    for i, (name, (dtype, shards, opts)) in enumerate(sorted(VARIANTS.items())):
        d = tmp_path_factory.mktemp(name)
        c, w = hf_model.write_model(str(d), dtype=dtype, shards=shards, seed=i, **opts)
        made[name] = (str(d), c, w)
    return made


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_agree_with_numpy_reference(models, tmp_path, name):
    d, c, w = models[name]
    prompt = prompt_ids(70, c["vocab_size"])   # more than one 64-token prefill block
    steps = 6
    gen, logits, _ = generate(d, prompt, steps, tmp_path, "full", ["-j", 2])
    ref = hf_model.reference_logits(c, w, prompt + gen[:-1])[len(prompt) - 1:]
    assert ref.shape == logits.shape
    err = rel_err(logits.astype(np.float64), ref)
    assert err < 1e-4, "%s: relative error %.3g" % (name, err)
    # greedy: each generated token is the argmax of the step's reference logits
    assert gen == [int(np.argmax(r)) for r in ref]


@pytest.mark.parametrize("name", ["llama-bf16-tied-gqa2", "qwen2-bf16-bias-tied",
                                  "llama-bf16-llama3-headdim", "llama-fp16-linear-gqa4"])
def test_pqcache_whole_budget_is_full_attention_to_the_bit(models, tmp_path, name):
    d, c, _ = models[name]
    prompt = prompt_ids(300, c["vocab_size"], seed=2)   # several prefill chunks
    _, full, full_bytes = generate(d, prompt, 8, tmp_path, "full", ["-j", 2])
    _, pq, pq_bytes = generate(d, prompt, 8, tmp_path, "pq", ["-a", "pqcache", "-b", 1, "-S", 4,
                                                             "-j", 2])
    assert full_bytes == pq_bytes, "max difference %g" % float(np.max(np.abs(full - pq)))
    # one thread and two give the same logits too
    _, _, one = generate(d, prompt, 8, tmp_path, "one", ["-j", 1])
    assert one == full_bytes


def test_modes_report_agreement(models, tmp_path):
    d, c, _ = models["llama-bf16-tied-gqa2"]
    ids = tmp_path / "p.ids"
    ids.write_text(" ".join(map(str, prompt_ids(200, c["vocab_size"], seed=3))))
    for mode in ("full", "window", "oracle", "pqcache"):
        p = run([d, "-I", ids, "-n", 12, "-t", 0, "-a", mode, "-b", 0.5, "-S", 4, "-c", "-q"])
        assert "compare: next-token agreement" in p.stderr
        assert "model: LlamaForCausalLM, 2 layers, dim 64, 4 heads (2 KV) of 16" in p.stderr
        if mode == "full":
            assert "agreement 100.00% (11/11), mean KL(full || full) 0.000000" in p.stderr
        if mode == "pqcache":  # what the library resolved: its defaults where no flag is given
            assert "pqcache: m=4 bits=8 T=adaptive" in p.stderr and ", 32 blocks of 128 (LFU)" in p.stderr
    p = run([d, "-I", ids, "-n", 4, "-t", 0, "-a", "pqcache", "-b", 0.5, "-S", 4, "-C", 0, "-m", 2, "-B", 6])
    assert "pqcache: m=2 bits=6 T=adaptive" in p.stderr and ", 0 blocks of 128" in p.stderr


def test_ids_from_stdin(models):
    d, c, _ = models["mistral-bf16-gqa4"]
    p = subprocess.run([BIN, d, "-I", "-", "-n", "3", "-t", "0"],
                       input="5 6 7 8\n", capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.split()) == 3


# ----- refusals ------------------------------------------------------------------------

def good_model(tmp_path, **kw):
    d = tmp_path / "m"
    hf_model.write_model(str(d), dtype=kw.pop("dtype", "bf16"), shards=kw.pop("shards", 1), **kw)
    return d


def expect_error(d, *words):
    p = run([d, "-i", "1 2 3", "-n", 2, "-q"], check=False)
    assert p.returncode == 1, p.stderr
    assert "error:" in p.stderr
    for wd in words:
        assert wd in p.stderr, p.stderr


def read_st(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_st(path, header, body, pad=True):
    h = json.dumps(header).encode()
    if pad:   # the data then starts 8-byte aligned, as safetensors writers keep it
        h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)


def test_refuses_truncated_file(tmp_path):
    d = good_model(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    for cut in (0, 5, 8, 20, len(data) // 2, len(data) - 1):
        f.write_bytes(data[:cut])
        expect_error(d)


def test_refuses_bad_header_length(tmp_path):
    d = good_model(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    for n in (0, 1, len(data), 1 << 40, (1 << 64) - 1):
        f.write_bytes(struct.pack("<Q", n) + data[8:])
        expect_error(d, "header")


def test_refuses_bad_header_json(tmp_path):
    d = good_model(tmp_path)
    f = d / "model.safetensors"
    header, body = read_st(f)
    text = json.dumps(header)
    for bad in (text[:-1], text + "x", text.replace(":", ";", 1), "[1, 2]", '{"a": tru}',
                "{" * 100 + "}" * 100, text.replace('"', "'", 1)):
        b = bad.encode()
        f.write_bytes(struct.pack("<Q", len(b)) + b + body)
        expect_error(d)


def test_refuses_offsets_outside_overlapping_or_wrong_size(tmp_path):
    d = good_model(tmp_path)
    f = d / "model.safetensors"
    header, body = read_st(f)
    name = "model.layers.0.self_attn.k_proj.weight"
    b0, e0 = header[name]["data_offsets"]
    cases = [
        ([b0, len(body) + 2], "outside"),
        ([len(body) + 10, len(body) + 10 + (e0 - b0)], "outside"),
        ([e0, b0], "outside"),
        ([b0 + 2, e0 + 2], "overlap"),
        ([b0, e0 - 2], "bytes for"),
    ]
    for offs, word in cases:
        h = json.loads(json.dumps(header))
        h[name]["data_offsets"] = offs
        write_st(f, h, body)
        expect_error(d, word)
    for bad_dtype, word in (("F99", "unknown dtype"), ("I16", "dtype")):
        h = json.loads(json.dumps(header))
        h[name]["dtype"] = bad_dtype
        write_st(f, h, body)
        expect_error(d, word)
    h = json.loads(json.dumps(header))
    h[name]["shape"] = [-1, 64]
    write_st(f, h, body)
    expect_error(d, "shape")
    h = json.loads(json.dumps(header))
    h["__metadata__"]["x"] = "y" * ((len(json.dumps(h)) % 8 == 0) + 2)   # data start not 8-aligned
    if len(json.dumps(h)) % 2 == 0:
        h["__metadata__"]["x"] += "z"
    write_st(f, h, body, pad=False)
    expect_error(d, "aligned")


def test_refuses_missing_tensor_and_wrong_shape(tmp_path):
    d = good_model(tmp_path)
    f = d / "model.safetensors"
    header, body = read_st(f)
    for name in ("model.layers.1.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"):
        h = dict(header)
        del h[name]
        write_st(f, h, body)
        expect_error(d, name, "missing")
    h = json.loads(json.dumps(header))
    name = "model.layers.0.self_attn.q_proj.weight"
    h[name]["shape"] = [32, 128]     # the same bytes, another shape
    write_st(f, h, body)
    expect_error(d, name, "shape")


DROP = object()   # a key the case removes
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# the RoPE settings, in either layout (top-level rope_theta / rope_scaling, or transformers'
# rope_parameters since version 5): what the engine does not implement is refused by name;
# both layouts at once must agree
ROPE_CASES = [
    (dict(rope_parameters={"rope_type": t, "rope_theta": 1e4, "factor": 2.0}), "rope_parameters.rope_type '%s'" % t)
    for t in ("yarn", "dynamic", "longrope", "proportional")
] + [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 1.0}),
     "rope_parameters.attention_factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2]}),
     "rope_parameters.mrope_section"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}), "rope_type is default"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "needs a factor"),
    (dict(rope_parameters=dict(LLAMA3, rope_theta=5e5, original_max_position_embeddings=0)),
     "original_max_position_embeddings"),
    (dict(rope_parameters={"rope_theta": -1.0}), "rope_parameters.rope_theta"),
    (dict(rope_parameters=[1, 2]), "rope_parameters must be an object"),
    (dict(rope_parameters={"rope_type": 3}), "rope_type must be a string"),
    (dict(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), "disagree"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
          rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}), "disagree"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
          rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "disagree"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types[1]"),
    (dict(layer_types="full_attention"), "layer_types must be a list"),
    # accepted: both layouts agreeing, rope_parameters alone, a null rope_parameters
    (dict(rope_theta=500000.0, rope_scaling=LLAMA3, rope_parameters=dict(LLAMA3, rope_theta=500000.0)), None),
    (dict(rope_theta=DROP, rope_scaling=DROP, rope_parameters=dict(LLAMA3, rope_theta=500000.0)), None),
    (dict(rope_parameters=None, layer_types=["full_attention", "full_attention"]), None),
]


def test_refuses_bad_config(tmp_path):
    d = good_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cases = [
        (dict(architectures=["GPT2LMHeadModel"]), "not supported"),
        (dict(hidden_size=-64), "hidden_size"),
        (dict(num_key_value_heads=3), "multiple"),
        (dict(hidden_size=65), "multiple"),
        (dict(hidden_size=128), "shape"),
        (dict(vocab_size=98), "shape"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "original_max_position"),
        (dict(hidden_act="gelu"), "silu"),
        (dict(rms_norm_eps="small"), "rms_norm_eps"),
        (dict(tie_word_embeddings=True, vocab_size=97), None),   # accepted: lm_head unused
    ]
    for change, word in cases + ROPE_CASES:
        c = dict(cfg)
        c.update(change)
        c = {k: v for k, v in c.items() if v is not DROP}
        (d / "config.json").write_text(json.dumps(c))
        if word is None:
            run([d, "-i", "1 2", "-n", 2, "-q"])
        else:
            expect_error(d, word)
    for text in ("", "{", '{"architectures": ["LlamaForCausalLM"],}', "[]", "nul"):
        (d / "config.json").write_text(text)
        expect_error(d, "config.json")
    (d / "config.json").unlink()
    expect_error(d, "config.json")


def test_refuses_bad_index(tmp_path):
    d = good_model(tmp_path, shards=2)
    idx = d / "model.safetensors.index.json"
    good = json.loads(idx.read_text())
    run([d, "-i", "1 2", "-n", 2, "-q"])
    m = json.loads(json.dumps(good))
    m["weight_map"]["model.norm.weight"] = "../model-00001-of-00002.safetensors"
    idx.write_text(json.dumps(m))
    expect_error(d, "file name")
    m = json.loads(json.dumps(good))
    m["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    idx.write_text(json.dumps(m))
    expect_error(d, "cannot open")
    idx.write_text(json.dumps(good))
    (d / "model-00002-of-00002.safetensors").unlink()
    expect_error(d, "cannot open")
    # a tensor in two shards
    d2 = good_model(tmp_path / "two", shards=2)
    f1, f2 = d2 / "model-00001-of-00002.safetensors", d2 / "model-00002-of-00002.safetensors"
    h1, b1 = read_st(f1)
    name = next(n for n in h1 if n != "__metadata__")
    h2, b2 = read_st(f2)
    h2[name] = dict(h1[name])
    h2[name]["data_offsets"] = [len(b2), len(b2) + (h1[name]["data_offsets"][1] - h1[name]["data_offsets"][0])]
    write_st(f2, h2, b2 + b1[h1[name]["data_offsets"][0]:h1[name]["data_offsets"][1]])
    expect_error(d2, "two files")
