"""Tests of the Python binding (make test-python): values against numpy references,
file round trips, bad input raising PQCacheError, and arrays handed over without copies."""

import os
import re
import threading

import numpy as np
import pytest

import pqcache as pqc

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def rt():
    with pqc.Runtime(threads=2) as runtime:
        yield runtime


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def softmax_sum(keys, queries):
    """numpy reference of PQC_GQA_SOFTMAX_SUM: per head softmax(q.k / sqrt(d)), summed."""
    s = keys.astype(np.float64) @ queries.astype(np.float64).T / np.sqrt(keys.shape[1])
    p = np.exp(s - s.max(axis=0))
    return (p / p.sum(axis=0)).sum(axis=1)


def np_topk(scores, k):
    return np.sort(np.argsort(-scores, kind="stable")[:k])


def attention(q, k, v):
    """One query head over (tokens, d) keys and values."""
    s = k.astype(np.float64) @ q / np.sqrt(k.shape[1])
    p = np.exp(s - s.max())
    return (p / p.sum()) @ v


def clustered_keys(rng, n, d, clusters=16):
    centres = rng.standard_normal((clusters, d)) * 2
    return (centres[rng.integers(0, clusters, n)] + rng.standard_normal((n, d))).astype(np.float32)


def make_cache(runtime, n=3000, layers=1, kv_heads=2, q_heads=4, d=32, seed=7, **settings):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, kv_heads, d), dtype=np.float32)
    v = rng.standard_normal((n, kv_heads, d), dtype=np.float32)
    opts = dict(n_layers=layers, n_kv_heads=kv_heads, n_q_heads=q_heads, head_dim=d, iters=4, seed=1)
    opts.update(settings)
    cache = pqc.Cache(runtime, **opts)
    for layer in range(layers):
        cache.prefill(layer, k, v)
    return cache, k, v


# ----- the binding itself -----------------------------------------------------------------


def test_structs_have_the_c_sizes():
    for struct in pqc.STRUCTS:
        assert pqc.sizeof(struct) == pqc.lib.pqcpy_sizeof(struct.__name__.encode()), struct.__name__


def test_version_and_runtime():
    assert re.fullmatch(r"\d+\.\d+\.\d+", pqc.version())
    with pqc.Runtime(threads=2, simd="scalar") as runtime:
        assert runtime.threads == 2
        assert runtime.simd == "scalar"
        assert runtime.backend == "cpu"
    assert runtime.closed
    runtime.close()  # twice is harmless
    with pytest.raises(pqc.BadStateError):
        runtime.threads
    inline = pqc.Runtime(threads=-1)
    assert inline.threads == 0
    assert pqc.Runtime().simd in ("scalar", "avx2", "avx512", "neon")


def test_runtime_bad_settings():
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Runtime(simd="sse9")
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Runtime(threads=2 ** 40)
    if not pqc.cuda_probe()["available"]:
        with pytest.raises(pqc.NoDeviceError):
            pqc.Runtime(backend="cuda")


def test_log_callback_gets_the_library_messages(rng):
    seen = []
    with pqc.Runtime(threads=1, log=lambda level, msg: seen.append((level, msg)), log_level="debug") as runtime:
        with pytest.raises(pqc.BadShapeError) as err:
            pqc.PQ.train(rng.standard_normal((100, 30)), m=4, runtime=runtime)
    assert "m = 4 does not divide d_h = 30" in err.value.message
    assert (0, err.value.message.split(": ", 1)[1]) in seen


# ----- the PQ core ------------------------------------------------------------------------


def test_exact_search_equals_numpy(rt, rng):
    keys = clustered_keys(rng, 3000, 64)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    want = np_topk(softmax_sum(keys, q), 300)
    got, scores = pqc.exact_search(keys, q, 300, return_scores=True, runtime=rt)
    assert np.all(np.diff(got.astype(np.int64)) > 0)
    assert pqc.recall(want, got) >= 0.99
    np.testing.assert_allclose(scores, softmax_sum(keys, q)[got], rtol=1e-4)
    np.testing.assert_allclose(pqc.exact_scores(keys, q, runtime=rt), softmax_sum(keys, q), rtol=1e-4)
    # the sum combination is the score of the summed query
    np.testing.assert_allclose(pqc.exact_scores(keys, q, gqa="sum", runtime=rt), keys @ q.sum(axis=0),
                               rtol=1e-4, atol=1e-3)


def test_pq_search_recall_against_numpy(rt, rng):
    n, d, k = 4000, 64, 400
    keys = clustered_keys(rng, n, d)
    u = rng.standard_normal(d).astype(np.float32)
    u /= np.linalg.norm(u)
    keys[2500] = 14 * u  # a needle
    pq = pqc.PQ.train(keys, m=8, bits=8, seed=3, runtime=rt)
    codes = pq.encode(keys, runtime=rt)
    recalls = []
    for trial in range(4):
        q = rng.standard_normal((4, d)).astype(np.float32)
        if trial == 0:
            q = np.tile(6 * u, (4, 1)) + 0.1 * q
        idx = pq.search(codes, q, k, runtime=rt)
        assert idx.shape == (k,) and np.all(np.diff(idx.astype(np.int64)) > 0)
        recalls.append(pqc.recall(np_topk(softmax_sum(keys, q), k), idx))
        if trial == 0:
            assert 2500 in idx
    assert min(recalls) >= 0.5, recalls
    # re-ranking with the exact keys gets closer to the exact top-k
    q = rng.standard_normal((4, d)).astype(np.float32)
    plain = pqc.recall(np_topk(softmax_sum(keys, q), k), pq.search(codes, q, k, runtime=rt))
    reranked = pqc.recall(np_topk(softmax_sum(keys, q), k), pq.search(codes, q, k, rerank=3, keys=keys, runtime=rt))
    assert reranked > plain and reranked >= 0.9


def test_codes_are_the_nearest_centroids(rt, rng):
    keys = clustered_keys(rng, 1500, 32)
    pq = pqc.PQ.train(keys, m=4, bits=5, runtime=rt)
    assert (pq.dim, pq.m, pq.bits, pq.ksub, pq.dsub) == (32, 4, 5, 32, 8)
    codes = pq.encode(keys, runtime=rt)
    cent = pq.centroids
    got = codes.to_array()
    for j in range(4):
        sub = keys[:, j * 8:(j + 1) * 8].astype(np.float64)
        dist = ((sub[:, None, :] - cent[j][None, :, :]) ** 2).sum(axis=2)
        best = dist.argmin(axis=1)
        # ties and rounding may differ only where two centroids are equally near
        near = dist[np.arange(len(sub)), got[:, j]] <= dist[np.arange(len(sub)), best] + 1e-4
        assert near.all()
        assert np.mean(got[:, j] == best) > 0.999
    assert codes.get(17, 2) == got[17, 2]
    assert codes.nbytes == 4 * ((1500 * 5 + 7) // 8)
    rebuilt = np.concatenate([cent[j][got[9, j]] for j in range(4)])
    np.testing.assert_array_equal(pq.decode(codes, 9), rebuilt)
    assert abs(pq.mse(keys, runtime=rt) - ((keys - np.stack([pq.decode(codes, t) for t in range(1500)])) ** 2)
               .sum(axis=1).mean()) < 1e-3
    # the approximate scores are the table lookups
    q = rng.standard_normal((2, 32)).astype(np.float32)
    lut = pq.lut(q.sum(axis=0, keepdims=True))
    want = sum(lut[0, j, got[:, j]] for j in range(4))
    np.testing.assert_allclose(pq.scores(codes, q, gqa="sum"), want, rtol=1e-5, atol=1e-4)


def test_training_objective_never_increases(rt, rng):
    pq = pqc.PQ.train(clustered_keys(rng, 2000, 16), m=2, bits=4, iters=8, objective=True, runtime=rt)
    assert pq.objective.shape == (2, 9)
    assert np.all(np.diff(pq.objective, axis=1) <= 1e-9)


def test_topk_recall_and_rerank_match_numpy(rt, rng):
    s = rng.standard_normal(5000).astype(np.float32)
    idx, vals = pqc.topk(s, 50, runtime=rt)
    np.testing.assert_array_equal(idx, np_topk(s, 50))
    np.testing.assert_array_equal(vals, s[idx])
    assert pqc.recall([1, 2, 3, 4], [4, 3, 9]) == 0.5
    keys = rng.standard_normal((500, 16)).astype(np.float32)
    q = rng.standard_normal((2, 16)).astype(np.float32)
    cand = np.arange(0, 500, 3)
    got = pqc.rerank(keys, q, cand, 10, runtime=rt)
    want = cand[np_topk(softmax_sum(keys[cand], q), 10)]
    np.testing.assert_array_equal(got, want)


def test_pq_save_load_round_trip(rt, rng, tmp_path):
    keys = clustered_keys(rng, 2000, 32)
    pq = pqc.PQ.train(keys, m=4, bits=6, runtime=rt)
    path = tmp_path / "head.pqc"
    pq.save(path)
    back = pqc.PQ.load(path, runtime=rt)
    np.testing.assert_array_equal(back.centroids, pq.centroids)
    c1, c2 = pq.encode(keys), back.encode(keys)
    np.testing.assert_array_equal(c1.to_array(), c2.to_array())
    q = rng.standard_normal((4, 32)).astype(np.float32)
    np.testing.assert_array_equal(pq.search(c1, q, 100), back.search(c2, q, 100))
    # damage, truncation, a missing file, a directory
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    (tmp_path / "flipped.pqc").write_bytes(bytes(data))
    (tmp_path / "short.pqc").write_bytes(path.read_bytes()[:-9])
    for name in ("flipped.pqc", "short.pqc"):
        with pytest.raises(pqc.BadFileError):
            pqc.PQ.load(tmp_path / name)
    with pytest.raises(pqc.FileIOError):
        pqc.PQ.load(tmp_path / "missing.pqc")
    with pytest.raises(pqc.FileIOError):
        pqc.PQ.load(tmp_path)
    back.close()
    with pytest.raises(pqc.BadStateError):
        back.save(path)


def test_pq_metric_blocks(rt, rng, tmp_path):
    """codes nearest under each sub-space's block, kept through a file; bad blocks raise"""
    keys = clustered_keys(rng, 1500, 16)
    a = rng.standard_normal((4, 4, 4))
    blocks = (a @ a.transpose(0, 2, 1) + 0.1 * np.eye(4)).astype(np.float32)
    pq = pqc.PQ.train(keys, bits=4, metric_blocks=blocks, runtime=rt)   # m from the blocks
    assert pq.m == 4 and pq.metric is None
    np.testing.assert_array_equal(pq.metric_blocks, blocks)
    codes = pq.encode(keys).to_array()
    cent = pq.centroids
    for j in range(4):
        r = keys[:, None, j * 4:(j + 1) * 4].astype(np.float64) - cent[j][None]        # (n, K, 4)
        dist = np.einsum("nka,ab,nkb->nk", r, blocks[j].astype(np.float64), r)
        best = dist.min(1)
        got = dist[np.arange(len(keys)), codes[:, j]]
        assert np.all(got <= best + 1e-4 * (1 + best))
    path = tmp_path / "blocks.pqc"
    pq.save(path)
    back = pqc.PQ.load(path, runtime=rt)
    np.testing.assert_array_equal(back.metric_blocks, blocks)
    np.testing.assert_array_equal(back.encode(keys).to_array(), codes)
    with pytest.raises(pqc.BadShapeError):
        pqc.PQ.train(keys, m=2, metric_blocks=blocks)          # 4 blocks of 4 for 2 sub-spaces of 8
    with pytest.raises(pqc.OutOfRangeError):
        pqc.PQ.train(keys, metric_blocks=-blocks)              # not positive definite
    with pytest.raises(pqc.InvalidArgumentError):
        pqc.PQ.train(keys, metric=np.ones(16), metric_blocks=blocks)


def test_pq_bad_input_raises(rt, rng):
    keys = rng.standard_normal((300, 64)).astype(np.float32)
    with pytest.raises(pqc.BadShapeError):
        pqc.PQ.train(keys, m=5)  # does not divide d_h
    with pytest.raises(pqc.OutOfRangeError):
        pqc.PQ.train(keys, bits=9)
    with pytest.raises(pqc.OutOfRangeError):
        pqc.PQ.train(keys, m=2 ** 33)  # would wrap to 2 in a C int
    bad = keys.copy()
    bad[7, 3] = np.nan
    with pytest.raises(pqc.NonFiniteError):
        pqc.PQ.train(bad)
    with pytest.raises(pqc.EmptyError):
        pqc.PQ.train(np.zeros((0, 64), np.float32))
    with pytest.raises(pqc.InvalidArgumentError):
        pqc.PQ.train(keys.astype(np.complex64))
    with pytest.raises(pqc.InvalidArgumentError):
        pqc.PQ.train([["a", "b"]])
    with pytest.raises(TypeError):
        pqc.PQ()
    pq = pqc.PQ.train(keys, m=4, bits=4, runtime=rt)
    codes = pq.encode(keys)
    q = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(pqc.OutOfRangeError):
        pq.search(codes, q, 301)  # k > n
    with pytest.raises(pqc.OutOfRangeError):
        pq.search(codes, q, 0)
    with pytest.raises(pqc.OutOfRangeError):
        pq.search(codes, q, -1)
    with pytest.raises(pqc.BadShapeError):
        pq.search(codes, q[:, :32], 10)
    with pytest.raises(pqc.NonFiniteError):
        pq.search(codes, np.full((2, 64), np.inf, np.float32), 10)
    with pytest.raises(pqc.BadShapeError):
        pq.encode(keys[:, :32])
    other = pqc.PQ.train(keys, m=8, bits=4)
    with pytest.raises(pqc.BadShapeError):
        other.search(codes, q, 10)
    with pytest.raises(pqc.OutOfRangeError):
        pqc.exact_search(keys, q, 301)
    with pytest.raises(pqc.NonFiniteError):
        pqc.topk([1.0, np.nan, 2.0], 1)
    with pytest.raises(pqc.OutOfRangeError):
        codes.get(300, 0)


# ----- the sequence cache -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_full_budget_selects_everything(rt, dtype):
    cache, k, v = make_cache(rt, n=700, kv_heads=2, q_heads=2, d=16, budget_ratio=1.0, kv_dtype=dtype)
    cache.append(0, k[0], v[0])
    q = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    sel = cache.select(0, q)
    ks, vs = cache.fetch(0, sel)
    allk = np.concatenate([k, k[:1]])
    allv = np.concatenate([v, v[:1]])
    store = np.float32 if dtype == "f32" else np.float16
    for h in range(2):
        np.testing.assert_array_equal(sel[h], np.arange(701))
        np.testing.assert_array_equal(ks[h, :701], allk[:, h].astype(store).astype(np.float32))
        np.testing.assert_array_equal(vs[h, :701], allv[:, h].astype(store).astype(np.float32))
        np.testing.assert_array_equal(cache.kv(0, h)[0], allk[:, h].astype(store))


def test_sinks_window_and_budget(rt):
    cache, k, v = make_cache(rt, n=500, layers=2, kv_heads=2, q_heads=4, d=16, n_sink=4, window=8,
                             budget_tokens=20)
    rng = np.random.default_rng(5)
    assert cache.window == 8
    assert cache.layer_window(0) == cache.layer_window(1) == 8  # a window in the settings is fixed
    with pytest.raises(pqc.OutOfRangeError):
        cache.layer_window(2)
    for step in range(3):
        q = rng.standard_normal((4, 16)).astype(np.float32)
        for layer in range(2):
            sel = cache.select(layer, q)
            n = cache.tokens(layer)
            for h in range(2):
                idx = sel[h]
                assert len(idx) == 4 + 12 + 8
                assert np.all(np.diff(idx.astype(np.int64)) > 0)
                assert set(range(4)) <= set(idx.tolist())
                assert set(range(n - 8, n)) <= set(idx.tolist())
            cache.append(layer, k[step], v[step])
    assert cache.tokens(1) == 503


def test_attention_over_selection_matches_exact(rt):
    """Sinks + top-k + window, fetched, against exact attention over every token."""
    rng = np.random.default_rng(11)
    n, kv_heads, q_heads, d = 6000, 2, 4, 64
    g = q_heads // kv_heads
    k = rng.standard_normal((n, kv_heads, d), dtype=np.float32)
    v = rng.standard_normal((n, kv_heads, d), dtype=np.float32)
    u = rng.standard_normal((kv_heads, d)).astype(np.float32)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    needles = [1500, 4100]
    for h in range(kv_heads):
        k[needles[h], h] = 16 * u[h]
    with pqc.Cache(rt, n_layers=1, n_kv_heads=kv_heads, n_q_heads=q_heads, head_dim=d, budget_ratio=0.05) as cache:
        cache.prefill(0, k, v)
        allk, allv = k, v
        for step in range(5):  # a few decode steps
            nk = rng.standard_normal((kv_heads, d), dtype=np.float32)
            nv = rng.standard_normal((kv_heads, d), dtype=np.float32)
            cache.append(0, nk, nv)
            allk, allv = np.concatenate([allk, nk[None]]), np.concatenate([allv, nv[None]])
        q = np.repeat(8 * u, g, axis=0) + 0.05 * rng.standard_normal((q_heads, d)).astype(np.float32)
        sel = cache.select(0, q)
        ks, vs = cache.fetch(0, sel)
        assert cache.stats(0)["tokens_selected"] == sel.counts.sum()
    window = 150
    for i in range(q_heads):
        h = i // g
        cnt = sel.counts[h]
        assert cnt < 0.1 * n
        assert needles[h] in sel[h]
        exact = attention(q[i], allk[:, h], allv[:, h])
        approx = attention(q[i], ks[h, :cnt], vs[h, :cnt])
        recent = attention(q[i], allk[-window:, h], allv[-window:, h])
        assert np.abs(approx - exact).max() < 0.01
        assert np.abs(recent - exact).max() > 0.5  # the needle matters


def test_readme_example_runs():
    """The example of docs/python.md, run as it is written there."""
    text = open(os.path.join(HERE, os.pardir, "docs", "python.md")).read()
    section = text.split("\n## ", 1)[0]
    blocks, block = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("    ") or (block and not line.strip()):
            block.append(line[4:])
        elif block:
            blocks.append("\n".join(block).strip())
            block = []
    example = [b for b in blocks if "import pqcache" in b]
    assert len(example) == 1
    exec(compile(example[0], "docs/python.md", "exec"), {"__name__": "readme_example"})


def test_save_load_gives_identical_selections(rt, tmp_path):
    settings = dict(n_layers=2, n_kv_heads=2, n_q_heads=4, head_dim=32, budget_ratio=0.05, iters=4, seed=1)
    rng = np.random.default_rng(3)
    cache = pqc.Cache(rt, **settings)
    for layer in range(2):
        cache.observe(layer, rng.standard_normal((8, 4, 32)).astype(np.float32))
        cache.prefill(layer, rng.standard_normal((4000, 2, 32)).astype(np.float32),
                      rng.standard_normal((4000, 2, 32)).astype(np.float32))
    for step in range(3):
        for layer in range(2):
            cache.append(layer, rng.standard_normal((2, 32)), rng.standard_normal((2, 32)))
    path = tmp_path / "seq.pqcc"
    cache.save(path)
    back = pqc.Cache.load(path, rt, **settings)
    assert back.tokens(1) == cache.tokens(1) == 4003
    assert back.window == cache.window
    assert [back.layer_window(l) for l in range(2)] == [cache.layer_window(l) for l in range(2)]
    for step in range(3):
        q = rng.standard_normal((4, 32)).astype(np.float32)
        for layer in range(2):
            a, b = cache.select(layer, q), back.select(layer, q)
            assert a.tolist() == b.tolist()
            ka, va = cache.fetch(layer, a)
            kb, vb = back.fetch(layer, b)
            for h in range(2):
                rows = a.counts[h]
                np.testing.assert_array_equal(ka[h, :rows], kb[h, :rows])
                np.testing.assert_array_equal(va[h, :rows], vb[h, :rows])
        nk, nv = rng.standard_normal((2, 32)), rng.standard_normal((2, 32))
        for c in (cache, back):
            for layer in range(2):
                c.append(layer, nk, nv)
    # other settings, damage, a missing file
    with pytest.raises(pqc.BadShapeError):
        pqc.Cache.load(path, rt, **dict(settings, head_dim=16))
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 1
    (tmp_path / "bad.pqcc").write_bytes(bytes(data))
    with pytest.raises(pqc.BadFileError):
        pqc.Cache.load(tmp_path / "bad.pqcc", rt, **settings)
    with pytest.raises(pqc.FileIOError):
        pqc.Cache.load(tmp_path / "none.pqcc", rt, **settings)


@pytest.mark.skipif(not hasattr(pqc.lib, "pqc_cache_fork"), reason="the loaded library has no pqc_cache_fork")
def test_fork_shares_the_prefix_and_then_diverges(rt):
    cache, k, v = make_cache(rt, n=3000, layers=2, budget_ratio=0.05)
    rng = np.random.default_rng(9)
    q = rng.standard_normal((4, 32)).astype(np.float32)
    own_before, shared_before = cache.host_memory()
    child = cache.fork()
    assert shared_before == 0
    shared = cache.host_memory()[1]
    assert shared > 0 and child.host_memory()[1] == shared
    assert child.host_memory()[0] < shared  # the K/V rows are shared, not copied
    for layer in range(2):
        assert child.tokens(layer) == cache.tokens(layer) == 3000
        a, b = cache.select(layer, q), child.select(layer, q)
        assert a.tolist() == b.tolist()
        np.testing.assert_array_equal(cache.fetch(layer, a)[0], child.fetch(layer, b)[0])
    # they continue apart
    nk = rng.standard_normal((2, 32)).astype(np.float32)
    for layer in range(2):
        child.append(layer, nk, nk)
    assert child.tokens(0) == 3001 and cache.tokens(0) == 3000
    np.testing.assert_array_equal(child.kv(0, 1)[0][-1], nk[1])
    # the child outlives its parent
    cache.close()
    sel = child.select(1, q)
    ks, _ = child.fetch(1, sel)
    for h in range(2):
        rows = sel[h]
        old = rows[rows < 3000]
        np.testing.assert_array_equal(ks[h, :len(old)], k[old, h])
    np.testing.assert_array_equal(child.kv(1, 0)[0][:3000], k[:, 0])


def test_batches_match_single_calls(rt):
    caches = [make_cache(rt, n=1500 + 500 * i, seed=i, budget_ratio=0.05)[0] for i in range(3)]
    rng = np.random.default_rng(12)
    qs = [rng.standard_normal((4, 32)).astype(np.float32) for _ in caches]
    sels = pqc.batch_select(caches, 0, qs)
    for c, q, sel in zip(caches, qs, sels):
        assert c.select(0, q).tolist() == sel.tolist()
    for c, sel, (k, v) in zip(caches, sels, pqc.batch_fetch(caches, 0, sels)):
        k1, v1 = c.fetch(0, sel)
        for h in range(2):
            rows = sel.counts[h]
            np.testing.assert_array_equal(k[h, :rows], k1[h, :rows])
            np.testing.assert_array_equal(v[h, :rows], v1[h, :rows])
    with pytest.raises(pqc.InvalidArgumentError):
        pqc.batch_select([caches[0], caches[0]], 0, qs[:2])
    with pytest.raises(pqc.BadShapeError):
        pqc.batch_select(caches, 0, qs[:2])
    with pytest.raises(pqc.EmptyError):
        pqc.batch_fetch([], 0, [])


def test_cache_bad_input_raises_and_leaves_it_as_it_was(rt):
    cache, k, v = make_cache(rt, n=600, layers=2, kv_heads=2, q_heads=4, d=16)
    q = np.ones((4, 16), np.float32)
    before = cache.select(0, q).tolist()
    bad = k.copy()
    bad[10, 1, 3] = np.nan
    with pytest.raises(pqc.NonFiniteError):
        cache.prefill(0, bad, v)
    with pytest.raises(pqc.BadShapeError):
        cache.prefill(0, k[:, :, :8], v[:, :, :8])
    with pytest.raises(pqc.BadShapeError):
        cache.prefill(0, k, v[:10])  # rows differ
    with pytest.raises(pqc.BadShapeError):
        cache.append(0, k[0, :, :8], v[0, :, :8])
    with pytest.raises(pqc.BadShapeError):
        cache.append(0, k[0].T, v[0].T)  # (16, 2) is not (2, 16)
    with pytest.raises(pqc.NonFiniteError):
        cache.append(0, np.full((2, 16), np.inf), v[0])
    with pytest.raises(pqc.BadShapeError):
        cache.select(0, q[:2])
    with pytest.raises(pqc.NonFiniteError):
        cache.select(0, np.full((4, 16), np.nan, np.float32))
    with pytest.raises(pqc.InvalidArgumentError):
        cache.select(0, q.astype(np.complex64))
    for layer in (2, -1, 2 ** 40):
        with pytest.raises(pqc.OutOfRangeError):
            cache.select(layer, q)
    with pytest.raises(pqc.OutOfRangeError):
        cache.kv(0, 2)
    assert cache.tokens(0) == 600
    assert cache.select(0, q).tolist() == before
    # a selection of another shape, unsorted or out-of-range indices, a bad output buffer
    other, _, _ = make_cache(rt, n=100, kv_heads=1, q_heads=1, d=16)
    with pytest.raises(pqc.BadShapeError):
        cache.fetch(0, other.select(0, np.ones((1, 16), np.float32)))
    with pytest.raises(pqc.OutOfRangeError):
        cache.fetch(0, pqc.Selection.from_indices(cache, [[3, 1], [0]]))
    with pytest.raises(pqc.OutOfRangeError):
        cache.fetch(0, pqc.Selection.from_indices(cache, [[0, 600], [0]]))
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Selection.from_indices(cache, [[-1], [0]])
    sel = cache.select(0, q)
    with pytest.raises(pqc.BadShapeError):
        cache.fetch(0, sel, out=(np.empty((2, 10, 8), np.float32), np.empty((2, 10, 8), np.float32)))
    with pytest.raises(pqc.CapacityError):
        cache.fetch(0, sel, out=(np.empty((2, 10, 16), np.float32), np.empty((2, 10, 16), np.float32)))
    ro = np.empty((2, 600, 16), np.float32)
    ro.flags.writeable = False
    with pytest.raises(pqc.BadShapeError):
        cache.fetch(0, sel, out=(ro, ro))
    with pytest.raises(pqc.InvalidArgumentError):
        cache.save("bad\0name")
    # unaligned input is copied, then read as usual
    raw = np.frombuffer(b"x" + k[:5].tobytes(), np.float32, offset=1).reshape(5, 2, 16)
    assert not raw.flags.aligned
    cache.prefill(1, raw, raw)
    np.testing.assert_array_equal(cache.kv(1, 1)[0][-5:], k[:5, 1])
    # a chosen selection fetches exactly those rows
    ks, vs = cache.fetch(0, pqc.Selection.from_indices(cache, [[1, 5, 9], [2]]))
    np.testing.assert_array_equal(ks[0, :3], k[[1, 5, 9], 0])
    np.testing.assert_array_equal(vs[1, :1], v[[2], 1])


def test_cache_bad_settings_raise(rt):
    base = dict(n_layers=1, n_kv_heads=2, head_dim=16)
    with pytest.raises(TypeError):
        pqc.Cache(rt, **base, n_heads=2)
    with pytest.raises(pqc.BadShapeError):
        pqc.Cache(rt, **dict(base, n_q_heads=3))
    with pytest.raises(pqc.BadShapeError):
        pqc.Cache(rt, **base, m=3)
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Cache(rt, **base, bits=9)
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Cache(rt, **base, max_tokens=-1)
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Cache(rt, **dict(base, n_layers=2 ** 32 + 1))
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Cache(rt, **base, policy="fifo")
    with pytest.raises(pqc.InvalidArgumentError):
        pqc.Cache(rt, **base, kv_dtype=np.int8)
    with pytest.raises(pqc.BadShapeError):
        pqc.Cache(rt, n_layers=0, n_kv_heads=2, head_dim=16)
    small = pqc.Cache(rt, **base, max_tokens=100)
    with pytest.raises(pqc.CapacityError):
        small.prefill(0, np.zeros((101, 2, 16), np.float32), np.zeros((101, 2, 16), np.float32))
    with pytest.raises(pqc.BadStateError):
        small.append(0, np.zeros((2, 16)), np.zeros((2, 16)))  # before any prefill
    with pytest.raises(pqc.BadStateError):
        small.select(0, np.zeros((2, 16), np.float32))
    half = pqc.Cache(rt, **base, kv_dtype="f16")
    with pytest.raises(pqc.NonFiniteError):
        half.prefill(0, np.full((4, 2, 16), 1e6, np.float32), np.zeros((4, 2, 16), np.float32))


def test_zero_copy_on_the_way_in(rt):
    rng = np.random.default_rng(2)
    seen = pqc._pass_hook = []
    try:
        for dtype, store in ((np.float32, "f32"), (np.float16, "f16"), (np.uint16, "bf16")):
            cache = pqc.Cache(rt, n_layers=1, n_kv_heads=2, n_q_heads=4, head_dim=32, kv_dtype=store)
            if dtype is np.uint16:
                k = (rng.standard_normal((600, 2, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            else:
                k = rng.standard_normal((600, 2, 32)).astype(dtype)
            v = k[::-1].copy()
            del seen[:]
            cache.prefill(0, k, v)
            assert seen == [("K", k.ctypes.data), ("V", v.ctypes.data)]
            np.testing.assert_array_equal(cache.kv(0, 1)[0], k[:, 1])  # the C side read that buffer
            np.testing.assert_array_equal(cache.kv(0, 0)[1], v[:, 0])
        # strided rows travel as they are (row_stride), other dtypes are converted once
        cache = pqc.Cache(rt, n_layers=1, n_kv_heads=2, n_q_heads=4, head_dim=32)
        big = rng.standard_normal((1200, 2, 32)).astype(np.float32)
        del seen[:]
        cache.prefill(0, big[::2], big[1::2])
        assert seen == [("K", big.ctypes.data), ("V", big[1::2].ctypes.data)]
        np.testing.assert_array_equal(cache.kv(0, 0)[0], big[::2, 0])
        del seen[:]
        k64 = rng.standard_normal((10, 2, 32))
        cache.prefill(0, k64, k64)
        assert seen[0][1] != k64.ctypes.data
        np.testing.assert_array_equal(cache.kv(0, 1)[0][-10:], k64[:, 1].astype(np.float32))
        # decode-time arrays
        nk, nv = big[0].copy(), big[1].copy()
        q = rng.standard_normal((4, 32)).astype(np.float32)
        sel = cache.selection()
        del seen[:]
        cache.append(0, nk, nv)
        cache.select(0, q, out=sel)
        assert seen == [("K", nk.ctypes.data), ("V", nv.ctypes.data), ("queries", q.ctypes.data)]
        keys16 = rng.standard_normal((500, 32)).astype(np.float16)
        del seen[:]
        pqc.PQ.train(keys16, m=2, bits=4)
        assert seen == [("keys", keys16.ctypes.data)]
    finally:
        pqc._pass_hook = None


def test_bfloat16_storage_keeps_the_bits(rt):
    rng = np.random.default_rng(4)
    f = rng.standard_normal((50, 1, 16)).astype(np.float32)
    cache = pqc.Cache(rt, n_layers=1, n_kv_heads=1, head_dim=16, kv_dtype="bf16")
    cache.prefill(0, f, f)
    want = np.array([pqc.lib.pqc_f32_to_bf16(float(x)) for x in f[:, 0].ravel()], np.uint16).reshape(50, 16)
    np.testing.assert_array_equal(cache.kv(0, 0)[0], want)
    sel = cache.select(0, np.ones((1, 16), np.float32))
    ks, _ = cache.fetch(0, sel)
    np.testing.assert_array_equal(ks[0, :sel.counts[0]], (want[sel[0]].astype(np.uint32) << 16).view(np.float32))


def test_selections_stay_valid(rt):
    cache, k, v = make_cache(rt, n=800, kv_heads=2, q_heads=4, d=16, budget_ratio=0.2)
    rng = np.random.default_rng(8)
    q1, q2 = (rng.standard_normal((4, 16)).astype(np.float32) for _ in range(2))
    first = cache.select(0, q1)
    held = first[0]
    kept = held.copy()
    for _ in range(400):  # the sequence grows well past the selection's first capacity
        cache.append(0, k[0], v[0])
    second = cache.select(0, q2)
    np.testing.assert_array_equal(held, kept)
    assert cache.select(0, q2, out=first) is first
    assert first.tolist() == second.tolist()
    assert len(first) == 2 and [len(a) for a in first] == list(first.counts)


def test_stats_memory_and_blocks(rt):
    cache, k, v = make_cache(rt, n=2000, layers=2, kv_heads=2, q_heads=2, d=16, block_tokens=64)
    q = np.ones((2, 16), np.float32)
    sel = cache.select(1, q)
    cache.fetch(1, sel)
    cache.sync()
    st = cache.stats(1)
    assert st["selects"] == 1 and st["fetches"] == 1 and st["builds"] == 1
    assert st["tokens_selected"] == sel.counts.sum()
    assert cache.stats(0)["selects"] == 0
    device, full = cache.memory()
    assert full == 2 * 2 * 2000 * 16 * 4 * 2  # layers x heads x tokens x d x fp32 x (K and V)
    assert device > 0
    assert not cache.on_device
    blocks = cache.cached_blocks(1, 0)
    assert blocks.size > 0 and np.all(np.diff(blocks) > 0) and blocks.max() < 2000 // 64 + 1
    with pytest.raises(pqc.BadStateError):
        cache.observed_mass(0, 0)  # no observations


def test_observations_measure_attention(rt):
    rng = np.random.default_rng(6)
    cache = pqc.Cache(rt, n_layers=1, n_kv_heads=2, n_q_heads=4, head_dim=16)
    cache.observe(0, rng.standard_normal((8, 4, 16)).astype(np.float32))
    cache.prefill(0, rng.standard_normal((3000, 2, 16)), rng.standard_normal((3000, 2, 16)))
    cache.sync()
    sinks, window = cache.observed_mass(0, 1)
    assert 0 <= sinks <= 1 and 0 <= window <= 1 and sinks + window > 0
    with pytest.raises(pqc.BadShapeError):
        cache.observe(0, rng.standard_normal((8, 2, 16)))


def test_head_plan_shows_what_a_select_ranks_by(rt):
    cache, k, v = make_cache(rt, n=2000, split="fixed", n_sink=4, rerank=-1)  # the PQ top-k alone
    q = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    plan, scores = cache.head_plan(0, q, 1)
    assert plan["tokens"] == 2000 and plan["sinks"] == 4
    assert plan["coded"] == 2000 - 4 - plan["window"] == len(scores)
    sel = cache.select(0, q)
    coded = [t for t in sel[1] if 4 <= t < 4 + plan["coded"]]
    assert len(coded) == plan["take"] == plan["candidates"]
    # the coded tokens taken are the best by those scores
    assert min(scores[np.array(coded) - 4]) >= np.sort(scores)[::-1][plan["take"] - 1]
    with pytest.raises(pqc.PQCacheError):
        cache.head_plan(0, q, 2)


def test_time_select_times_the_c_call(rt):
    cache, _, _ = make_cache(rt, n=1000)
    sel = cache.selection()
    assert cache.time_select(0, np.ones((4, 32), np.float32), sel, 10) > 0
    assert cache.stats(0)["selects"] == 10


def test_threads_may_share_a_cache(rt):
    cache, k, v = make_cache(rt, n=2000, layers=2, budget_ratio=0.05)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for step in range(40):
                layer = step % 2
                sel = cache.select(layer, rng.standard_normal((4, 32)).astype(np.float32))
                cache.fetch(layer, sel)
                cache.append(layer, k[step], v[step])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert cache.tokens(0) == cache.tokens(1) == 2000 + 4 * 20


# ----- scheduler and object lifetimes -----------------------------------------------------


def test_scheduler_fits_save_and_load(rt, tmp_path):
    s = pqc.Scheduler(t_min=2, t_max=50)
    for tokens in (1000, 4000, 16000):
        for iters in (2, 5, 10):
            s.add_kmeans(tokens, iters, 1e-3 + 2e-8 * tokens * iters)
        s.add_compute(tokens, 5e-3 + 1e-6 * tokens + 1e-10 * tokens ** 2)
    fit = s.get_fit()
    assert fit["n1"] == 9 and fit["n2"] == 3
    assert abs(fit["b1"] - 2e-8) < 1e-10 and abs(fit["a1"] - 1e-3) < 1e-5
    assert abs(fit["g2"] - 1e-10) < 1e-12
    for tokens in (1000, 100000):
        assert 2 <= s.iters(tokens, jobs=8) <= 50
    path = tmp_path / "calib.txt"
    s.save(path)
    t = pqc.Scheduler()
    t.load(path)
    assert t.get_fit() == pytest.approx(fit)
    path.write_text(path.read_text().replace("1", "7", 1))
    with pytest.raises(pqc.BadFileError):
        t.load(path)
    assert t.get_fit() == pytest.approx(fit)
    with pytest.raises(pqc.FileIOError):
        t.load(tmp_path / "missing.txt")
    t.set_fit(a1=0.0, b1=1e-8, a2=0.0, b2=1e-6, g2=0.0, n1=2, n2=3)
    assert t.get_fit()["b2"] == 1e-6 and t.get_fit()["n2"] == 3
    with pytest.raises(TypeError):
        t.set_fit(c3=1.0)
    with pytest.raises(pqc.OutOfRangeError):
        pqc.Scheduler(t_max=200000)


def test_a_cache_keeps_its_scheduler_and_runtime_alive():
    runtime = pqc.Runtime(threads=1)
    sched = pqc.Scheduler(t_min=1, t_max=8, t_default=3)
    cache = pqc.Cache(runtime, scheduler=sched, n_layers=1, n_kv_heads=1, head_dim=16)
    del runtime, sched  # the cache holds them
    rng = np.random.default_rng(0)
    cache.prefill(0, rng.standard_normal((2000, 1, 16)), rng.standard_normal((2000, 1, 16)))
    cache.report_compute(0, 2000, 0.01)
    cache.sync()
    assert 1 <= cache.stats(0)["last_iters"] <= 8
    cache.select(0, np.ones((1, 16), np.float32))


def test_closing_a_runtime_closes_its_caches():
    runtime = pqc.Runtime(threads=2)
    cache, _, _ = make_cache(runtime, n=2000)
    sched = pqc.Scheduler()
    other = pqc.Cache(runtime, scheduler=sched, n_layers=1, n_kv_heads=1, head_dim=16)
    sched.close()
    assert other.closed and not cache.closed
    runtime.close()
    assert cache.closed
    with pytest.raises(pqc.BadStateError):
        cache.select(0, np.ones((4, 32), np.float32))
    with pytest.raises(pqc.BadStateError):
        pqc.Cache(runtime, n_layers=1, n_kv_heads=1, head_dim=16)
    cache.close()


def test_softmax_scale_passes_through(rt, rng, tmp_path):
    """softmax_scale reaches the library: resolved and refused there, the exact search's
    softmax at it, and a cache at scale 1 (head_dim 16) selecting what one at the default
    1/4 selects on keys times 4, its file keeping the scale."""
    base = dict(n_layers=1, n_kv_heads=2, n_q_heads=4, head_dim=16)
    assert pqc.resolve(**base)["softmax_scale"] == 0.25
    assert pqc.resolve(softmax_scale=1.5, **base)["softmax_scale"] == 1.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(pqc.OutOfRangeError, match="softmax_scale"):
            pqc.resolve(softmax_scale=bad, **base)
    keys = clustered_keys(rng, 500, 16)
    q = rng.standard_normal((2, 16)).astype(np.float32)
    s = keys.astype(np.float64) @ q.astype(np.float64).T * 2.0
    p = np.exp(s - s.max(axis=0))
    want = (p / p.sum(axis=0)).sum(axis=1)
    got, scores = pqc.exact_search(keys, q, 20, return_scores=True, runtime=rt, softmax_scale=2.0)
    assert got.tolist() == np_topk(want, 20).tolist()
    np.testing.assert_allclose(scores, want[got], rtol=1e-4)
    k = rng.standard_normal((600, 2, 16), dtype=np.float32)
    v = rng.standard_normal((600, 2, 16), dtype=np.float32)
    obs = rng.standard_normal((8, 4, 16), dtype=np.float32)
    opts = dict(base, budget_ratio=0.1, n_sink=4, iters=4, seed=1, rerank=2)
    caches = [pqc.Cache(rt, softmax_scale=1.0, **opts), pqc.Cache(rt, **opts), pqc.Cache(rt, **opts)]
    for c, kk in zip(caches, (k, k * 4, k)):
        c.observe(0, obs)
        c.prefill(0, kk, v)
    assert [c.config()["softmax_scale"] for c in caches] == [1.0, 0.25, 0.25]
    differ = 0
    for step in range(10):
        qq = rng.standard_normal((4, 16)).astype(np.float32)
        a, b, d = (c.select(0, qq).tolist() for c in caches)
        assert a == b
        differ += a != d
    assert differ > 0
    path = tmp_path / "scaled.pqcc"
    caches[0].save(path)
    back = pqc.Cache.load(path, rt, **opts)
    assert back.config()["softmax_scale"] == 1.0
    qq = rng.standard_normal((4, 16)).astype(np.float32)
    assert back.select(0, qq).tolist() == caches[0].select(0, qq).tolist()
    for c in caches + [back]:
        c.close()


def test_resolved_configuration_is_the_librarys(rng):
    """resolve() and Cache.config() give every default as the library fills it in."""
    got = pqc.resolve(n_layers=2, n_kv_heads=2, n_q_heads=4, head_dim=16)
    assert got["n_sink"] == 4 and got["budget_ratio"] == 0.1 and got["recent_share"] == 0.15
    assert got["rerank"] == 1.5  # re-ranking the PQ top 1.5k by default
    assert got["rerank_max"] == 6.0  # or up to 6k per head, where observed queries show the need
    assert got["max_tokens"] == 1 << 20 and got["cache_blocks"] == 32 and got["block_tokens"] == 128
    assert got["admit_blocks"] == 32 and got["observe"] == 32 and got["rebuild_share"] == 0.5
    assert got["metric"] == "query" and got["split"] == "compete" and got["kv_dtype"] == "f32"
    assert got["window"] == 0 and got["iters"] == 10 and got["m"] == 4 and got["bits"] == 8
    assert got["subspaces"] == "contiguous"  # no RoPE layout stated
    none = pqc.resolve(n_layers=1, n_kv_heads=1, head_dim=8, n_sink=-1, cache_blocks=-1, rebuild_share=-1, rerank=-1,
                       rerank_max=-1)
    assert none["n_sink"] == -1 and none["cache_blocks"] == -1 and none["rebuild_share"] == -1
    assert none["rerank"] == -1 and none["rerank_max"] == -1
    assert pqc.resolve(**none) == none  # a resolved configuration resolves to itself
    with pytest.raises(pqc.OutOfRangeError, match="recent_share"):
        pqc.resolve(n_layers=1, n_kv_heads=1, head_dim=8, recent_share=2.0)
    assert pqc.resolve(n_layers=1, n_kv_heads=1, head_dim=8, split="adaptive")["split"] == "adaptive"
    assert pqc.resolve(n_layers=1, n_kv_heads=1, head_dim=8, split="fixed_compete")["split"] == "fixed_compete"
    with pqc.Cache(n_layers=1, n_kv_heads=2, n_q_heads=4, head_dim=16, rope="half") as c:
        cfg = c.config()
        assert cfg == pqc.resolve(n_layers=1, n_kv_heads=2, n_q_heads=4, head_dim=16, rope="half")
        assert cfg["rope"] == "half" and cfg["subspaces"] == "rope_bands"  # the default with a layout
        k = rng.standard_normal((300, 2, 16), dtype=np.float32)
        c.prefill(0, k, k)
        assert c.config()["window"] == c.window > 0


def test_cache_metric_blocks_from_observed_queries(rng, tmp_path):
    """The default metric ("query"): each head's build gets a matrix per rope band from the
    observed queries; a saved cache loads and selects the same, and a fork selects the same.
    Its floor is at least 0.01; the diagonal metric ("query_diag") takes smaller ones."""
    opts = dict(n_layers=1, n_kv_heads=1, n_q_heads=2, head_dim=16, rope="half", iters=4, budget_ratio=0.2)
    assert pqc.resolve(**opts)["metric"] == "query"
    with pytest.raises(pqc.OutOfRangeError, match="metric_floor"):
        pqc.resolve(**dict(opts, metric_floor=0.001))
    assert pqc.resolve(**dict(opts, metric_floor=0.001, metric="query_diag"))["metric"] == "query_diag"
    q = rng.standard_normal((8, 2 * 16)).astype(np.float32)
    q[:, 0] *= 6.0  # the queries look along dims 0 and 8 (one band, a rotation pair)
    q[:, 8] = 0.5 * q[:, 0] + 0.1 * q[:, 8]
    k = rng.standard_normal((600, 1, 16), dtype=np.float32)
    with pqc.Cache(**opts) as c:
        c.observe(0, q)
        c.prefill(0, k, k)
        c.sync()
        qq = q[:1].reshape(2, 16)
        want = c.select(0, qq).tolist()
        path = str(tmp_path / "bands.pqc")
        c.save(path)
        with pqc.Cache.load(path, **opts) as back:
            assert back.select(0, qq).tolist() == want
        with c.fork() as f:
            assert f.select(0, qq).tolist() == want
