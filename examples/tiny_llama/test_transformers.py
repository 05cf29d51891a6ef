"""Checkpoints written by Hugging Face transformers itself (pytest).

Without torch (run by make tiny_llama_test): config.json files written by transformers'
own config classes (save_pretrained, in whatever layout the installed version writes:
rope_parameters since version 5, top-level rope_theta and rope_scaling before; make
test-transformers runs this file under both) for every architecture and RoPE variant the engine
supports, with random weights from hf_model. The engine reads the RoPE settings that
transformers standardised (its config object), its logits agree with the NumPy forward
pass, and the variants it does not implement are refused with a message naming the key.

With torch (make test-transformers): random models built by transformers, saved by it
(bf16, fp16, fp32, sharded) and run by it: the engine's logits agree with transformers'
fp32 forward pass over the same saved weights, and its greedy tokens with transformers'.
Without torch these tests are skipped, unless PQC_REQUIRE_TORCH=1 makes that a failure
(make test-transformers sets it).

TINY_LLAMA (environment) names the binary, default build/tiny_llama.
"""
import json
import os
import re
import sys

import numpy as np
import pytest

import transformers  # noqa: E402 (installed by .ci/run, as tokenizers is)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import hf_model  # noqa: E402
from test_hf import prompt_ids, rel_err, run  # noqa: E402  (the engine's runner, TINY_LLAMA honoured)

CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}

# name: (architecture, config options, weights dtype, shards)
VARIANTS = {
    "llama-default": ("llama", dict(), "bf16", 1),
    "llama-theta-tied": ("llama", dict(rope_theta=500000.0, tie_word_embeddings=True), "fp32", 1),
    "llama-llama3-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                                        rope_scaling=LLAMA3), "bf16", 2),
    "llama-linear-headdim": ("llama", dict(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 4.0}),
                             "fp16", 1),
    "mistral-theta": ("mistral", dict(rope_theta=1e6, sliding_window=None), "bf16", 1),
    "qwen2-theta-bias": ("qwen2", dict(rope_theta=1e6), "bf16", 3),
    "qwen2-linear-tied": ("qwen2", dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear",
                                                                                "factor": 2.0}), "fp32", 1),
}


def gemma_rope(theta, local, scaling=None):
    """Gemma 3's two RoPE settings in the layout of the installed transformers"""
    if int(transformers.__version__.split(".")[0]) >= 5:
        full = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
        return dict(rope_parameters={"full_attention": full,
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local}})
    return dict(rope_theta=theta, rope_local_base_freq=local, rope_scaling=scaling)


S, F = "sliding_attention", "full_attention"

# Gemma 3 (torch only: the NumPy reference knows the Llama family): local and global
# layers with a window shorter than the prompt, head_dim unlike hidden / heads, a softmax
# scale unlike head_dim^-0.5, a local layer first and last
GEMMA_VARIANTS = {
    "gemma3-hybrid-tied": ("gemma3", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                                          layer_types=[S, S, F, S], **gemma_rope(1e6, 1e4)), "fp32", 1),
    "gemma3-linear-untied": ("gemma3", dict(num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                                            sliding_window=24, layer_types=[S, F, S], tie_word_embeddings=False,
                                            **gemma_rope(5e5, 2e3, {"rope_type": "linear", "factor": 4.0})),
                             "bf16", 2),
}


def make_config(arch, **opts):
    """a transformers config object of a small model"""
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, max_position_embeddings=512, rms_norm_eps=1e-5,
                initializer_range=0.1)
    if "layer_types" in opts:
        base["num_hidden_layers"] = len(opts["layer_types"])
    base.update(opts)
    cls = getattr(transformers, CLASSES[arch][0])
    cfg = cls(**base)
    cfg.architectures = [CLASSES[arch][1]]
    return cfg


def expected_rope(cfg):
    """(theta, scaling dict or None) as transformers itself holds them (a hybrid model's:
    its global layers')"""
    rp = getattr(cfg, "rope_parameters", None)
    if rp is not None and F in rp:
        rp = rp[F]
    if rp is not None:   # version 5 and later
        kind = rp.get("rope_type", "default")
        return float(rp["rope_theta"]), (None if kind == "default" else dict(rp))
    rs = getattr(cfg, "rope_scaling", None)
    return float(cfg.rope_theta), (rs if rs and rs.get("rope_type", rs.get("type")) != "default" else None)


def engine_rope(stderr):
    """the engine's RoPE settings from its model lines"""
    m = re.search(r"^rope: theta (\S+?)(?:, (linear|llama3) factor (\S+))?"
                  r"(?: low_freq_factor (\S+) high_freq_factor (\S+) original (\d+))?$", stderr, re.M)
    assert m, stderr
    return m.groups()


def generate(d, tokens, steps, tmp_path, name, extra=()):
    ids = tmp_path / (name + ".ids")
    ids.write_text(" ".join(map(str, tokens)))
    out = tmp_path / (name + ".logits")
    p = run([d, "-I", ids, "-n", steps, "-t", 0, "-o", out, "-j", 2] + list(extra))
    gen = [int(t) for t in p.stdout.split()]
    assert len(gen) == steps
    return gen, np.fromfile(out, dtype=np.float32).reshape(steps, -1), p.stderr


def check_rope(stderr, cfg):
    theta, scaling = expected_rope(cfg)
    got = engine_rope(stderr)
    assert float(got[0]) == pytest.approx(theta, rel=1e-7), (got, theta)
    if scaling is None:
        assert got[1] is None, got
        return
    assert got[1] == scaling["rope_type"] and float(got[2]) == pytest.approx(scaling["factor"], rel=1e-7), got
    if scaling["rope_type"] == "llama3":
        assert float(got[3]) == pytest.approx(scaling["low_freq_factor"], rel=1e-7)
        assert float(got[4]) == pytest.approx(scaling["high_freq_factor"], rel=1e-7)
        assert int(got[5]) == scaling["original_max_position_embeddings"]


# ----- configs written by transformers, weights by hf_model --------------------------------

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_transformers_configs_are_read_as_transformers_reads_them(tmp_path, name):
    arch, opts, dtype, shards = VARIANTS[name]
    cfg = make_config(arch, **opts)
    d = tmp_path / name
    cfg.save_pretrained(str(d))
    c = json.loads((d / "config.json").read_text())
    if int(transformers.__version__.split(".")[0]) >= 5:   # the layout that was misread once
        assert "rope_parameters" in c and "rope_theta" not in c, c
    else:                                                    # version 4: the top-level keys
        assert "rope_theta" in c and "rope_parameters" not in c, c
    weights = hf_model.random_tensors(c, seed=len(name))
    values = hf_model.write_safetensors(str(d / "model.safetensors"), weights, dtype)
    prompt = prompt_ids(70, c["vocab_size"])
    gen, logits, err = generate(str(d), prompt, 5, tmp_path, name)
    check_rope(err, cfg)
    # the NumPy forward with the settings transformers holds (not the file's own reading)
    theta, scaling = expected_rope(cfg)
    ref_cfg = dict(c, rope_theta=theta, rope_scaling=scaling, rope_parameters=None)
    ref = hf_model.reference_logits(ref_cfg, values, prompt + gen[:-1])[len(prompt) - 1:]
    assert rel_err(logits.astype(np.float64), ref) < 1e-4
    assert gen == [int(np.argmax(r)) for r in ref]


UNSUPPORTED = [
    ("yarn", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256})),
    ("dynamic", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    ("longrope", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                    "original_max_position_embeddings": 256})),
]


@pytest.mark.parametrize("kind,opts", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_rope_types_the_engine_lacks_are_refused_by_name(tmp_path, kind, opts):
    cfg = make_config("llama", **opts)
    d = tmp_path / kind
    cfg.save_pretrained(str(d))
    c = json.loads((d / "config.json").read_text())
    hf_model.write_safetensors(str(d / "model.safetensors"), hf_model.random_tensors(c), "bf16")
    p = run([d, "-i", "1 2 3", "-n", 2, "-q"], check=False)
    assert p.returncode == 1 and "error:" in p.stderr, p.stderr
    assert re.search(r"rope_(parameters|scaling)\.rope_type '%s' is not supported" % kind, p.stderr), p.stderr


def test_qwen2_sliding_window_is_refused(tmp_path):
    cfg = make_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    d = tmp_path / "q"
    cfg.save_pretrained(str(d))
    c = json.loads((d / "config.json").read_text())
    hf_model.write_safetensors(str(d / "model.safetensors"), hf_model.random_tensors(c), "bf16")
    p = run([d, "-i", "1 2 3", "-n", 2, "-q"], check=False)
    assert p.returncode == 1 and ("use_sliding_window" in p.stderr or "layer_types" in p.stderr), p.stderr


# ----- models built, saved and run by transformers (torch) --------------------------------

def need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        if os.environ.get("PQC_REQUIRE_TORCH") == "1":
            pytest.fail("PQC_REQUIRE_TORCH=1 but torch cannot be imported")
        pytest.skip("torch is not installed (make test-transformers installs it)")
    import torch
    return torch


TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def check_layers(stderr, cfg):
    """a hybrid model's layer kinds and local RoPE as the engine reports them"""
    types = getattr(cfg, "layer_types", None)
    if not types or all(t == F for t in types):
        assert "layers:" not in stderr
        return
    rp = getattr(cfg, "rope_parameters", None)
    local = rp[S]["rope_theta"] if rp is not None and S in rp else cfg.rope_local_base_freq
    m = re.search(r"^layers: (\d+) local \(window (\d+), rope theta (\S+)\), (\d+) global:([ \d]*)$", stderr, re.M)
    assert m, stderr
    assert int(m.group(1)) == types.count(S) and int(m.group(2)) == cfg.sliding_window
    assert float(m.group(3)) == pytest.approx(local, rel=1e-7)
    assert [int(x) for x in m.group(5).split()] == [i for i, t in enumerate(types) if t == F]


@pytest.mark.parametrize("name", sorted(VARIANTS) + sorted(GEMMA_VARIANTS))
def test_logits_agree_with_transformers_forward(tmp_path, name):
    torch = need_torch()
    arch, opts, dtype, shards = VARIANTS[name] if name in VARIANTS else GEMMA_VARIANTS[name]
    cfg = make_config(arch, **opts)
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():   # weights well away from zero, so the logits are not all alike
        for p in model.parameters():
            p.normal_(0.0, 0.02 if p.dim() == 2 and p.shape[0] == cfg.vocab_size else 0.2)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.uniform_(0.8, 1.2)
    d = tmp_path / name
    model.to(getattr(torch, TORCH_DTYPES[dtype]))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(str(d), max_shard_size=(size // shards + 1) if shards > 1 else "5GB")
    if shards > 1:
        assert (d / "model.safetensors.index.json").exists()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    prompt = prompt_ids(70, cfg.vocab_size, seed=3)
    gen, logits, err = generate(str(d), prompt, 6, tmp_path, name)
    check_rope(err, cfg)
    check_layers(err, cfg)
    with torch.no_grad():
        want = ref(torch.tensor([prompt + gen[:-1]])).logits[0, len(prompt) - 1:].double().numpy()
    e = rel_err(logits.astype(np.float64), want)
    print("%s: %s weights, %d shard(s): largest logit difference %.2g of the largest logit" % (name, dtype, shards, e))
    assert e < 1e-4, "%s: relative error %.3g of the largest logit" % (name, e)
    assert gen == [int(np.argmax(r)) for r in want]
    if name in GEMMA_VARIANTS:   # pqcache over the global layers, every token selected: the same bits
        gen_pq, logits_pq, _ = generate(str(d), prompt, 6, tmp_path, name + "-pq", ["-a", "pqcache", "-b", 1])
        assert gen_pq == gen and np.array_equal(logits_pq, logits)
