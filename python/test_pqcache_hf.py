"""Tests of pqcache as a transformers attention backend (pqcache_hf; make test-transformers,
which runs them with torch and transformers installed: tests/transformers_env.sh).

Random Llama, Mistral and Qwen2 models: at a budget that covers the sequence, greedy
generate() with pqcache gives transformers' own eager tokens and logits; at budget 0.1
the first layer's selections equal the C library's on the keys and queries transformers
itself computed; a batch of two equals the two sequences alone; a forked cache generates
what a fresh one does; the constructed passkey model, exported to the Hugging Face
layout, retrieves its passkey at 8K and 32K where window-only attention does not; misuse
raises."""
import copy
import os
import subprocess
import sys

import numpy as np
import pytest

try:
    import torch
    import transformers
except ImportError:
    if os.environ.get("PQC_REQUIRE_TORCH") == "1":
        raise
    pytest.skip("torch and transformers are not installed (make test-transformers)", allow_module_level=True)

import pqcache
import pqcache_hf

ARCHS = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=500000.0)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, num_key_value_heads=1)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6)),
    # hybrid models: sliding-window layers stay transformers' own, the full ones are pqcache's
    "gemma3": (transformers.Gemma3TextConfig, dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                                                   sliding_window=24, pad_token_id=None, eos_token_id=None,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention", "full_attention"])),
    "mistral-sliding": (transformers.MistralConfig, dict(sliding_window=32)),
    "qwen2-sliding": (transformers.Qwen2Config, dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=32,
                                                     max_window_layers=1)),
}


def make_models(arch, seed=0, **opts):
    """(eager model, pqcache model) with the same random weights"""
    cls, extra = ARCHS[arch]
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, max_position_embeddings=4096, initializer_range=0.2)
    base.update(extra)
    base.update(opts)
    cfg = cls(**base)
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    pq = pqcache_hf.from_config(cfg).eval()
    pq.load_state_dict(ref.state_dict())
    return ref, pq


def prompt(n, seed=1, batch=1):
    return torch.tensor(np.random.default_rng(seed).integers(0, 97, (batch, n)))


def greedy(model, ids, steps, **kw):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_covering_budget_generates_what_eager_attention_does(arch):
    ref, pq = make_models(arch)
    ids = prompt(300)
    want, want_logits = greedy(ref, ids, 12)
    got, got_logits = greedy(pq, ids, 12, cache=pqcache_hf.cache_for(pq, budget_ratio=1.0))
    assert got.tolist() == want.tolist()
    err = float((got_logits - want_logits).abs().max() / want_logits.abs().max())
    print("%s: covering budget, largest logit difference %.2g of the largest logit" % (arch, err))
    assert err < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_second_turn_continues_the_conversation(arch):
    """generate() again on the same cache with the conversation so far and a new prompt:
    the new prompt attends to everything before it, its tokens join the cache, and the
    next decode steps select over them. At a covering budget: the tokens and logits of
    eager attention over the whole conversation at once."""
    ref, pq = make_models(arch, seed=11)
    turn1 = prompt(200, seed=12)
    cache = pqcache_hf.cache_for(pq, budget_ratio=1.0)
    first, _ = greedy(pq, turn1, 6, cache=cache)
    conv = torch.cat([turn1, first, prompt(40, seed=13)], 1)
    got, got_logits = greedy(pq, conv, 8, cache=cache)
    want, want_logits = greedy(ref, conv, 8)
    assert got.tolist() == want.tolist()
    err = float((got_logits - want_logits).abs().max() / want_logits.abs().max())
    print("%s: second turn, largest logit difference %.2g of the largest logit" % (arch, err))
    assert err < 1e-4
    for layer in range(2):                                   # every token is in the library's cache
        assert cache.caches[0].tokens(layer) == conv.shape[1] + 8 - 1
    # at budget 0.1 a second turn decodes from a real selection over both turns
    cache = pqcache_hf.cache_for(pq, budget_ratio=0.1, n_sink=4)
    picked = []
    with pqcache_hf._hooks.recording(lambda kind, layer, b, *a: picked.append((kind, a[-1])) if layer == 0 else None):
        first, _ = greedy(pq, turn1, 6, cache=cache)
        conv = torch.cat([turn1, first, prompt(40, seed=13)], 1)
        second, _ = greedy(pq, conv, 4, cache=cache, min_new_tokens=4)
    kinds = [k for k, _ in picked]
    assert kinds == ["prefill"] + ["decode"] * (first.shape[1] - 1) + ["extend"] + ["decode"] * 3
    last = picked[-1][1]                                     # the last step's selection, per KV head
    n = conv.shape[1] + 3
    for head in last:
        assert len(head) < 0.5 * n
        assert max(head) == n - 1                            # the newest token (the window)
        assert min(head) == 0                                # a sink


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_forked_cache_generates_what_a_fresh_one_does(arch):
    """The prompt run once, its cache forked, greedy generate() from the fork: at a budget
    that selects, the tokens (and logits) of generate() from the prompt on a fresh cache.
    A second fork, after the first has gone on, gives them again: the forked cache (its
    pqcache caches and, in Gemma 3, its sliding-window layers) is as it was."""
    _, pq = make_models(arch, seed=21)
    ids = prompt(300, seed=22)
    settings = dict(budget_ratio=0.1, n_sink=4)
    steps = 10
    want, want_logits = greedy(pq, ids, steps, cache=pqcache_hf.cache_for(pq, **settings), min_new_tokens=steps)
    cache = pqcache_hf.cache_for(pq, **settings)
    with torch.no_grad():
        first = pq(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert first.tolist() == want[:, :1].tolist()
    seq = torch.cat([ids, first], 1)
    for _ in range(2):
        fork = cache.fork()
        assert isinstance(fork, pqcache_hf.PQCache) and fork.caches[0] is not cache.caches[0]
        got, got_logits = greedy(pq, seq, steps - 1, cache=fork, min_new_tokens=steps - 1)
        assert got.tolist() == want[:, 1:].tolist()
        finite = torch.isfinite(want_logits[:, 1:])               # (min_new_tokens puts -inf at the end token)
        assert torch.equal(finite, torch.isfinite(got_logits))
        assert torch.equal(got_logits[finite], want_logits[:, 1:][finite])
        assert fork.caches[0].tokens(0) == 300 + steps - 1
        assert fork.get_seq_length() == 300 + steps - 1
        fork.close()
    for layer in range(cache.caches[0].n_layers):
        assert cache.caches[0].tokens(layer) == 300
    assert cache.get_seq_length() == 300


def test_rows_reach_the_library_without_copies():
    """The keys and values of a prompt pass to the library as views of torch's storage
    (tokens first, as transformers' projections lay them out), for float32, float16 and
    bfloat16 (as uint16)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(1, 50, 2, 16).to(dtype).transpose(1, 2)   # (B, H, T, D) as attention receives it
        rows = pqcache_hf._rows(x[0])
        assert rows.shape == (50, 2, 16)
        assert rows.__array_interface__["data"][0] == x.data_ptr(), dtype
        assert rows.dtype == {torch.float32: np.float32, torch.float16: np.float16,
                              torch.bfloat16: np.uint16}[dtype]
        back = torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 \
            else torch.from_numpy(rows)
        assert torch.equal(back, x[0].transpose(0, 1))
    q = torch.randn(1, 1, 4, 16).transpose(1, 2)                  # a decode step's query: a view too
    assert pqcache_hf._rows(q[0], f32=True).__array_interface__["data"][0] == q.data_ptr()


class _Recorder:
    """An attention function that records the queries and keys transformers hands it, then
    runs eager attention."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if module.layer_idx == 0:
            self.calls.append((query[0].float().clone(), key[0].float().clone(), value[0].float().clone()))
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kw)


@pytest.mark.parametrize("observe", [0, 8, -1])
def test_budget_selections_equal_the_c_librarys_on_transformers_keys(observe):
    """observe: the setting (0: the library's default, 32; -1: none) the backend reads back
    from the resolved configuration to observe the prompt's last queries"""
    ref, pq = make_models("llama", seed=3)
    ids = prompt(400, seed=5)
    steps = 10
    settings = dict(budget_ratio=0.1, n_sink=4, observe=observe)
    # pqcache: the first layer's selections of each decode step
    cache = pqcache_hf.cache_for(pq, **settings)
    picked = []
    with pqcache_hf._hooks.recording(lambda kind, layer, b, *a: picked.append(a[3]) if kind == "decode" and layer == 0
                                     else None):
        tokens, _ = greedy(pq, ids, steps, cache=cache)
    # transformers' own eager run of the same tokens (teacher-forced), recording layer 0
    rec = _Recorder()
    transformers.AttentionInterface.register("pqcache_test_record", rec)
    ref.config._attn_implementation = "pqcache_test_record"
    seq = torch.cat([ids, tokens], 1)
    with torch.no_grad():
        dyn = transformers.DynamicCache(config=ref.config)
        ref(seq[:, :400], cache=dyn)
        for t in range(400, 400 + steps - 1):
            ref(seq[:, t:t + 1], cache=dyn)
    # the C library (through the binding) on those queries and keys, with the settings cache_for used
    q0, k0, v0 = rec.calls[0]                                    # (Hq, T, D), (Hkv, T, D)
    c = pqcache.Cache(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=16, rope="half", **settings)
    if observe >= 0:
        c.observe(0, q0.transpose(0, 1)[-(observe or 32):].numpy())
    c.prefill(0, k0.transpose(0, 1).contiguous().numpy(), v0.transpose(0, 1).contiguous().numpy())
    same = 0
    for i, (q, k, v) in enumerate(rec.calls[1:]):
        c.append(0, k[:, -1].numpy(), v[:, -1].numpy())
        sel = c.select(0, q[:, 0].numpy()).tolist()
        assert sel == picked[i], "step %d" % i
        same += 1
    assert same == steps - 1
    assert len(picked[0][0]) < 0.5 * 401                         # a real selection, not every token


def test_the_caches_take_the_models_softmax_scale():
    """Gemma 3's query_pre_attn_scalar^-0.5 (here unlike head_dim^-0.5), another model's
    attention scaling, or the scale given to cache_for."""
    for arch, opts, want in (("gemma3", dict(query_pre_attn_scalar=64), 0.125), ("llama", {}, 0.25)):
        _, pq = make_models(arch, seed=2, **opts)
        cache = pqcache_hf.cache_for(pq, budget_ratio=0.1)
        greedy(pq, prompt(60), 2, cache=cache)
        assert cache.caches[0].config()["softmax_scale"] == want, arch
    cache = pqcache_hf.cache_for(pq, budget_ratio=0.1, softmax_scale=0.5)
    greedy(pq, prompt(60), 2, cache=cache)
    assert cache.caches[0].config()["softmax_scale"] == 0.5


def test_a_batch_of_two_is_two_sequences():
    _, pq = make_models("qwen2", seed=4)
    ids = torch.cat([prompt(200, seed=6), prompt(200, seed=7)], 0)
    both, both_logits = greedy(pq, ids, 8, cache=pqcache_hf.cache_for(pq, budget_ratio=0.1))
    for b in range(2):
        one, one_logits = greedy(pq, ids[b:b + 1], 8, cache=pqcache_hf.cache_for(pq, budget_ratio=0.1))
        assert one.tolist()[0] == both.tolist()[b]
        assert float((one_logits[0] - both_logits[b]).abs().max()) <= 1e-5 * float(one_logits.abs().max())


def test_misuse_raises_clear_errors():
    ref, pq = make_models("llama")
    ids = prompt(50)
    with pytest.raises(pqcache_hf.PQCacheError, match="attn_implementation"):
        pqcache_hf.cache_for(ref)
    with pytest.raises(pqcache_hf.PQCacheError, match="budget_ratio"):
        pqcache_hf.cache_for(pq, budget_ratio=0)
    with pytest.raises(pqcache_hf.PQCacheError, match="cache="):
        with torch.no_grad():
            pq(ids)                                             # no pqcache cache
    cache = pqcache_hf.cache_for(pq)
    greedy(pq, ids, 2, cache=cache)
    _, other = make_models("llama", seed=9)
    with pytest.raises(pqcache_hf.PQCacheError, match="one model"):
        greedy(other, ids, 2, cache=cache)                       # a cache reused across models
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[1, :5] = 0
    with pytest.raises(pqcache_hf.PQCacheError, match="padded"):
        greedy(pq, ids.repeat(2, 1), 2, attention_mask=mask, cache=pqcache_hf.cache_for(pq))
    chunked = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    chunked.layer_types = ["full_attention", "chunked_attention"]   # (Llama 4's): not supported
    with pytest.raises(pqcache_hf.PQCacheError, match="chunked_attention"):
        pqcache_hf.PQCache(chunked)
    with pytest.raises(pqcache_hf.PQCacheError, match="budget_ratio"):
        pqcache_hf.cache_for(pq, budget_ratio=2e6)               # the library's range
    with pytest.raises(pqcache_hf.PQCacheError, match="unknown cache setting"):
        pqcache_hf.cache_for(pq, budget=0.1)


def test_previous_names_are_aliases():
    assert pqcache_hf.PQCacheHF is pqcache_hf.PQCache
    assert pqcache_hf.pqcache_attention is pqcache_hf.pqcache_attention_forward
    assert transformers.AttentionInterface()[pqcache_hf.NAME] is pqcache_hf.pqcache_attention_forward


def test_readme_example_runs(tmp_path):
    """The "pqcache in transformers" example of docs/python.md, run as written there on a saved random model."""
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "python.md")).read()
    section = text.split("\n## pqcache in transformers\n", 1)[1].split("\n## ", 1)[0]
    lines = [l[4:] for l in section.splitlines() if l.startswith("    ")]
    example = "\n".join(lines)
    assert "pqcache_hf.from_pretrained" in example and "cache_for" in example
    ref, _ = make_models("llama", seed=2, eos_token_id=None)   # (every one of the 32 tokens generated)
    ref.save_pretrained(str(tmp_path))
    scope = {"path": str(tmp_path), "ids": prompt(120)}
    exec(compile(example, "docs/python.md", "exec"), scope)
    assert scope["out"].shape == (1, 120 + 32)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF4 = os.path.join(ROOT, "build", "hf4")   # transformers 4.x, apart (tests/transformers_env.sh)

_SAVE_WITH_4 = """
import sys, numpy as np, torch, transformers
assert transformers.__version__.startswith("4."), transformers.__version__
shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=4096, initializer_range=0.2)
for arch, out in zip(sys.argv[1::2], sys.argv[2::2]):
    if arch == "llama3":
        cfg = transformers.LlamaConfig(rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64), **shape)
    else:
        cfg = transformers.Qwen2Config(rope_theta=1e6, rope_scaling=dict(rope_type="linear", factor=4.0), **shape)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model.to(torch.bfloat16).save_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    ids = torch.tensor(np.random.default_rng(1).integers(0, 97, (1, 300)))
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=8, do_sample=False, output_scores=True,
                           return_dict_in_generate=True)
    np.savez(out + "/want.npz", tokens=g.sequences[0, 300:].numpy(), logits=torch.stack(g.scores, 1)[0].numpy())
"""
HF4_ARCHS = ["llama3", "qwen2-linear"]


@pytest.fixture(scope="module")
def hf4_checkpoints(tmp_path_factory):
    """each of HF4_ARCHS saved and run by transformers 4 (one process for all of them)"""
    if not os.path.isdir(os.path.join(HF4, "transformers")):
        if os.environ.get("PQC_REQUIRE_TORCH") == "1":
            pytest.fail("build/hf4 (transformers 4) is missing: run sh tests/transformers_env.sh")
        pytest.skip("build/hf4 (transformers 4) is missing")
    dirs = {a: tmp_path_factory.mktemp(a) for a in HF4_ARCHS}
    env = dict(os.environ, PYTHONPATH=HF4)
    args = [x for a in HF4_ARCHS for x in (a, str(dirs[a]))]
    subprocess.run([sys.executable, "-c", _SAVE_WITH_4] + args, env=env, check=True)
    return dirs


@pytest.mark.parametrize("arch", HF4_ARCHS)
def test_checkpoints_transformers_4_wrote_decode_as_transformers_4_does(hf4_checkpoints, arch):
    """A checkpoint saved by transformers 4 (the older config layout: top-level rope_theta and
    rope_scaling) with its own greedy tokens and logits, loaded here by transformers 5 with the
    pqcache backend at a covering budget: the same tokens, logits within 1e-4."""
    tmp_path = hf4_checkpoints[arch]
    import json
    c = json.load(open(tmp_path / "config.json"))
    assert c["transformers_version"].startswith("4.") and "rope_parameters" not in c, c
    assert c["rope_scaling"]["rope_type"] == ("llama3" if arch == "llama3" else "linear"), c
    want = np.load(tmp_path / "want.npz")
    pq = pqcache_hf.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    got, got_logits = greedy(pq, prompt(300), 8, cache=pqcache_hf.cache_for(pq, budget_ratio=1.0))
    assert got[0].tolist() == want["tokens"].tolist()
    err = float(np.abs(got_logits[0].numpy() - want["logits"]).max() / np.abs(want["logits"]).max())
    print("%s saved and run by transformers 4, pqcache in transformers 5: largest logit difference %.2g" % (arch, err))
    assert err < 1e-4


@pytest.fixture(scope="module")
def passkey_model(tmp_path_factory):
    """the constructed passkey model (make_passkey), exported to the Hugging Face layout"""
    d = tmp_path_factory.mktemp("passkey")
    subprocess.run([os.path.join(ROOT, "build", "make_passkey"), str(d / "passkey.bin")], check=True)
    sys.path.insert(0, os.path.join(ROOT, "examples", "tiny_llama"))
    import export_hf
    export_hf.export(str(d / "passkey.bin"), str(d / "hf"))
    return pqcache_hf.from_pretrained(str(d / "hf"), dtype=torch.float32).eval()


# 32K tokens only in the full scenarios (make test-long: PQC_TEST_SIZE=full), 8K always
@pytest.mark.parametrize("length", [8192, 32768] if os.environ.get("PQC_TEST_SIZE") == "full" else [8192])
def test_passkey_is_retrieved_through_transformers(passkey_model, length):
    lines = subprocess.run([os.path.join(ROOT, "build", "make_passkey"), "--prompt", str(length), "50", "3"],
                           capture_output=True, text=True, check=True).stdout.split("\n")
    ids = torch.tensor([[int(x) for x in lines[0].split()[2:]] + [int(lines[1].split()[1])]])
    answer = [int(x) for x in lines[2].split()[2:]]
    got = {}
    for name, settings in (("pqcache", dict(budget_ratio=0.1)),
                           ("window", dict(budget_tokens=256, recent_share=1.0, split="fixed"))):  # window only
        with torch.no_grad():
            out = passkey_model.generate(ids, max_new_tokens=len(answer), do_sample=False,
                                         cache=pqcache_hf.cache_for(passkey_model, **settings))
        got[name] = out[0, ids.shape[1]:].tolist()
    print("passkey at %d: answer %s, pqcache %s, window only %s" % (length, answer, got["pqcache"], got["window"]))
    assert got["pqcache"] == answer
    assert got["window"] != answer
