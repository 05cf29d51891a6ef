#!/usr/bin/env python3
"""pqcache on real models and real text, against full attention (make bench-real).

For each model (tools/models.py fetches and converts them):
  needles  a passkey hidden in real prose at several lengths and depths, retrieved or not
           by greedy decoding, per method; a cell is scored where full attention
           retrieves;
  nll      teacher-forced NLL of the last tokens of real text and top-1 agreement, per
           method, against full attention;
  mass     the attention mass a method's selection keeps of what exact top-k keeps at the
           same per-head counts, on the model's own decode queries and keys, per layer and
           KV head (the mean, and the worst head); and the most any selection of those
           counts keeps with the method's sinks always in it (its ceiling).

Every axis is split in two: the tuning half (haystack: the licenses Debian ships in
/usr/share/common-licenses; the chat form of the needle and question; passkeys A) and
the reported half (haystack: Python's own documentation, the docstrings of standard
modules as pydoc renders them; the completion form; passkeys B). Methods were chosen on
the tuning half; the reported half is the measure.

The prompt runs once per cell, through transformers with pqcache's backend at a budget
that covers it (dense attention over the prompt, as every method has it); its keys,
values and last queries are captured, and each method gets a cache of its own filled
from them (observe, prefill), then decodes greedily (needles) or teacher-forced (nll).

usage: bench_real.py [--model smollm2|gemma3] [--half tune|report|both] [--quick] [--out DIR]
       [--methods a,b,...] [--parts needles,nll,mass] [--lengths 2048,...] [--depths 0.1,...]
       [--keys N] [--nll-steps N]
"""
import argparse
import json
import os
import pydoc
import sys
import time

import numpy as np
import torch
import transformers
import transformers.masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
import pqcache  # noqa: E402
import pqcache_hf  # noqa: E402

MODELS = {
    "smollm2": dict(dir="smollm2-135m-instruct", lengths=[2048, 4096, 8192]),
    # hybrid: pqcache serves the 3 global layers, transformers the 15 sliding-window ones
    "gemma3": dict(dir="gemma3-270m", lengths=[8192, 16384, 32768]),
}

# name: (cache settings beyond the model's shape, observe the prompt's last queries)
BUDGET = 0.1
METHODS = {
    "full": (dict(budget_ratio=1e6), True),
    "default": (dict(budget_ratio=BUDGET), True),
    "oracle": (dict(budget_ratio=BUDGET, rerank=1e6), True),          # every coded token scored exactly
    "window": (dict(budget_ratio=BUDGET, recent_share=1.0, split="fixed"), True),  # sinks + window
    # the default before the matrices per band: m 2, 6 bits, half the budget for the window
    "previous": (dict(budget_ratio=BUDGET, m=2, bits=6, recent_share=0.5, split="fixed", n_sink=32, rerank=-1), True),
    # the default before 4 sinks and re-ranking: 32 sinks, the PQ top-k alone, the window competing
    "before": (dict(budget_ratio=BUDGET, n_sink=32, rerank=-1), True),
    "no-rerank": (dict(budget_ratio=BUDGET, rerank=-1), True),       # 4 sinks, the PQ top-k alone
    # re-ranking, the window not competing (the builds lower it)
    "adaptive": (dict(budget_ratio=BUDGET, split="adaptive"), True),
    "sinks32": (dict(budget_ratio=BUDGET, n_sink=32), True),         # re-ranking, 32 sinks
    "no-observe": (dict(budget_ratio=BUDGET, observe=-1), False),
    "rerank1.2": (dict(budget_ratio=BUDGET, rerank=1.2), True),
    "rerank1.3": (dict(budget_ratio=BUDGET, rerank=1.3), True),
    "rerank1.4": (dict(budget_ratio=BUDGET, rerank=1.4), True),
    "rerank2": (dict(budget_ratio=BUDGET, rerank=2.0), True),
    "rerank2.5": (dict(budget_ratio=BUDGET, rerank=2.5), True),
    "even-split": (dict(budget_ratio=BUDGET, split="fixed_compete"), True),
    "l2": (dict(budget_ratio=BUDGET, metric="l2"), True),
    "diag": (dict(budget_ratio=BUDGET, metric="query_diag"), True),  # weights per dim, not a matrix per band
    "even-l2": (dict(budget_ratio=BUDGET, split="fixed_compete", metric="l2"), True),
    "mfloor0.1": (dict(budget_ratio=BUDGET, metric_floor=0.1), True),   # flatter query weighting
    "mfloor1": (dict(budget_ratio=BUDGET, metric_floor=1.0), True),
    "m2": (dict(budget_ratio=BUDGET, m=2), True),     # 2 bytes (1/64 of a 64-wide fp16 key)
    "m4": (dict(budget_ratio=BUDGET, m=4), True),     # codes of 4 bytes whatever the key's width
    "m8": (dict(budget_ratio=BUDGET, m=8), True),     # 8 bytes (1/64 of a 256-wide fp16 key)
    "m16": (dict(budget_ratio=BUDGET, m=16), True),
    "m8-l2": (dict(budget_ratio=BUDGET, m=8, metric="l2"), True),
    "m8-resid0.15": (dict(budget_ratio=BUDGET, m=8, residual_weight=0.15), True),
    "m8-out64": (dict(budget_ratio=BUDGET, m=8, outliers=64), True),
    "m8-mfloor0.1": (dict(budget_ratio=BUDGET, m=8, metric_floor=0.1), True),
    "m8-mfloor10": (dict(budget_ratio=BUDGET, m=8, metric_floor=10.0), True),
    "m8-sum": (dict(budget_ratio=BUDGET, m=8, gqa="sum"), True),
}
# the methods each part runs unless --methods says otherwise (full attention always)
PART_METHODS = {"needles": ["default", "oracle", "window", "before"],
                "nll": ["default", "oracle", "window", "before", "rerank2.5"],
                "mass": ["default", "oracle", "window", "before", "rerank2.5"]}

HALVES = {
    "tune": dict(haystack="licenses", form="chat", passkeys=[71432, 58209, 90317]),
    "report": dict(haystack="pydoc", form="completion", passkeys=[36854, 24791, 83560]),
}
DEPTHS = [0.1, 0.3, 0.5, 0.7, 0.9]
DEPTHS_ARG = []
KEYS_ARG = []
PYDOC_MODULES = ["argparse", "collections", "subprocess", "threading", "logging", "json", "re", "os", "pathlib",
                 "asyncio", "functools", "itertools", "socket", "datetime", "decimal", "email", "unittest",
                 "tarfile", "zipfile", "http.client", "urllib.request", "sqlite3", "csv", "random", "statistics"]


# ----- text -------------------------------------------------------------------------------

def haystack(name):
    """a long piece of real English prose this machine carries"""
    if name == "licenses":
        d = "/usr/share/common-licenses"
        parts = []
        for f in sorted(os.listdir(d)):
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, errors="replace") as fh:
                    parts.append(fh.read())
        return "\n\n".join(parts)
    if name == "pydoc":
        import importlib
        parts = []
        for m in PYDOC_MODULES:
            mod = importlib.import_module(m)
            parts.append(pydoc.render_doc(mod, renderer=pydoc.plaintext))
        return "\n\n".join(parts)
    raise ValueError(name)


def needle_text(form, key):
    if form == "chat":
        return " The pass key is %d. Remember it. %d is the pass key. " % (key, key)
    return "\n\nImportant: the secret number is %d. Remember the secret number %d.\n\n" % (key, key)


def frame(tok, form):
    """(prefix ids, suffix ids) around the haystack: the question and the start of the answer"""
    if form == "chat":
        mark = "\x00HAY\x00"
        msgs = [{"role": "user", "content": "Read this document and answer the question at its end.\n\n" + mark +
                 "\n\nWhat is the pass key in the document?"}]
        if tok.chat_template:
            s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            special = False
        else:   # a base model without a template: its family's turns where its vocabulary has them
            turns = "<start_of_turn>" in tok.get_vocab()
            s = ("<start_of_turn>user\n%s<end_of_turn>\n<start_of_turn>model\n" if turns else "User: %s\nAssistant: ") % \
                msgs[0]["content"]
            special = True   # (its BOS)
        a, b = (s + "The pass key is").split(mark)
        return tok(a, add_special_tokens=special)["input_ids"], tok(b, add_special_tokens=False)["input_ids"]
    a = "Here is a document.\n\n"
    b = "\n\nQuestion: What is the secret number in the document?\nAnswer: The secret number is"
    return tok(a)["input_ids"], tok(b, add_special_tokens=False)["input_ids"]


def needle_prompt(tok, hay_ids, form, key, length, depth, where=None):
    """the prompt's ids; where (a list), when given, gets the positions of the needle's
    tokens that spell the passkey"""
    pre, suf = frame(tok, form)
    nd = tok(needle_text(form, key), add_special_tokens=False)["input_ids"]
    fill = length - len(pre) - len(suf) - len(nd)
    if fill > len(hay_ids):
        raise ValueError("haystack too short: %d tokens for %d" % (len(hay_ids), fill))
    at = int(depth * fill)
    if where is not None:
        digits = set(str(key))
        where += [len(pre) + at + i for i, t in enumerate(nd) if tok.decode([t]).strip() and
                  set(tok.decode([t]).strip()) <= digits]
    return pre + hay_ids[:at] + nd + hay_ids[at:fill] + suf


# ----- the model and its caches -------------------------------------------------------------

class Model:
    def __init__(self, path, threads):
        torch.set_num_threads(threads)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.model = pqcache_hf.from_pretrained(path, dtype=torch.float32).eval()
        self.runtime = pqcache.Runtime(threads=threads)
        self.shape = pqcache_hf._model_shape(self.model.config)
        kinds, _ = pqcache_hf._layer_kinds(self.model.config)
        self.full = [l for l, k in enumerate(kinds) if k == "full"]   # pqcache layer i is model layer full[i]

    def cache(self, settings):
        return pqcache_hf.cache_for(self.model, runtime=self.runtime, **settings)

    def prompt(self, ids, n_obs=32):
        """runs the prompt densely (transformers' SDPA attention, causal); returns (last
        logits, per layer (K, V, last queries)), keys and queries after RoPE"""
        cap = {}

        def capture(module, query, key, value, attention_mask, **kw):
            layer = int(module.layer_idx)
            cap[layer] = (key[0].transpose(0, 1).float().numpy().copy(), value[0].transpose(0, 1).float().numpy().copy(),
                          query[0, :, -n_obs:].transpose(0, 1).float().numpy().copy())
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        transformers.AttentionInterface.register("pqc_capture", capture)
        # transformers' own SDPA masks (sliding-window layers get theirs)
        transformers.masking_utils.AttentionMaskInterface.register("pqc_capture", transformers.masking_utils.sdpa_mask)
        self.model.set_attn_implementation("pqc_capture")
        try:
            with torch.no_grad():
                out = self.model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        finally:
            self.model.set_attn_implementation(pqcache_hf.NAME)
        return out.logits[0, -1].double().numpy(), [cap[l] for l in range(self.shape[0])]

    def filled(self, captured, settings, observe):
        """a backend cache holding the captured prompt, as its own prefill would have made it"""
        c = self.cache(settings)
        k0 = captured[0][0]
        c._make(1, k0.shape[1], k0.shape[2])
        pc = c.caches[0]
        for l, (k, v, q) in enumerate(captured):
            if l in c.pq_layer:
                if observe:
                    pc.observe(c.pq_layer[l], q)
                pc.prefill(c.pq_layer[l], k, v)
                layer = c.layers[l]
                layer.seen = k0.shape[0]
                layer.is_initialized = True
                layer.dtype, layer.device = torch.float32, torch.device("cpu")
            else:   # a sliding-window layer: transformers' own cache layer keeps its window
                c.layers[l].update(torch.from_numpy(k).transpose(0, 1)[None], torch.from_numpy(v).transpose(0, 1)[None])
        return c

    def step(self, c, token):
        with torch.no_grad():
            return self.model(torch.tensor([[token]]), past_key_values=c, use_cache=True).logits[0, -1].double().numpy()


def settings_of(name):
    s, obs = METHODS[name]
    return dict(s), obs


# ----- the parts ------------------------------------------------------------------------------

class DecodeKeys:
    """Each pqcache layer's keys so far, (tokens, Hkv, D): the captured prompt's, then each
    decode step's as a recorder sees it; and the attention a KV head's query heads pay
    them."""

    def __init__(self, M, cap):
        layers, hq, hkv, d = M.shape
        self.g, self.hkv, self.scale = hq // hkv, hkv, d ** -0.5
        self.keys = [cap[l][0] for l in M.full]

    def add(self, layer, k):
        self.keys[layer] = np.concatenate([self.keys[layer], np.asarray(k)[None]])

    def mass(self, layer, q, hd):
        """softmax over every key of each query head of KV head hd, summed over the group"""
        g = self.g
        sc = (q[hd * g:(hd + 1) * g] @ self.keys[layer][:, hd].T) * self.scale
        p = np.exp(sc - sc.max(1, keepdims=True))
        return (p / p.sum(1, keepdims=True)).sum(0)


class NeedleRecall:
    """A recorder of decode steps: of the needle's passkey tokens that exact top-k (at each
    head's count of this step) would select, the share the method's selection holds,
    over every layer, KV head and step; and where it missed: (layer, head, step)."""

    def __init__(self, M, cap, where):
        self.keys = DecodeKeys(M, cap)
        self.where = np.array(where, dtype=np.int64)
        self.want = self.got = 0
        self.missed = []
        self.steps = [0] * len(M.full)

    def __call__(self, kind, layer, b, q, k, v, sel=None):
        if kind != "decode":
            return
        self.keys.add(layer, k)
        for hd in range(self.keys.hkv):
            pm = self.keys.mass(layer, q, hd)
            chosen = np.asarray(sel[hd], dtype=np.int64)
            top = np.argpartition(-pm, len(chosen) - 1)[:len(chosen)] if len(chosen) < len(pm) else np.arange(len(pm))
            want = np.intersect1d(self.where, top)
            got = np.intersect1d(want, chosen)
            self.want += len(want)
            self.got += len(got)
            if len(got) < len(want):
                self.missed.append((layer, hd, self.steps[layer]))
        self.steps[layer] += 1

    def value(self):
        return self.got / self.want if self.want else 1.0


def needles(M, half, methods, lengths, out, quick):
    h = HALVES[half]
    hay = M.tok(haystack(h["haystack"]), add_special_tokens=False)["input_ids"]
    keys = h["passkeys"][:1] if quick else h["passkeys"][:KEYS_ARG[0]] if KEYS_ARG else h["passkeys"]
    depths = [0.3, 0.7] if quick else (DEPTHS_ARG or DEPTHS)
    rows = []
    for length in lengths:
        for depth in depths:
            for key in keys:
                where = []
                ids = needle_prompt(M.tok, hay, h["form"], key, length, depth, where)
                t0 = time.time()
                last, cap = M.prompt(ids)
                t_prompt = time.time() - t0
                first = int(np.argmax(last))
                for name in methods:
                    s, obs = settings_of(name)
                    c = M.filled(cap, s, obs)
                    recall = NeedleRecall(M, cap, where) if name != "full" else None
                    gen = [first]
                    with pqcache_hf._hooks.recording(recall):
                        for _ in range(7):
                            gen.append(int(np.argmax(M.step(c, gen[-1]))))
                    c.close()
                    text = M.tok.decode(gen)
                    row = dict(part="needle", half=half, length=length, depth=depth, key=key, method=name,
                               answer=text, retrieved=str(key) in text.replace(" ", ""),
                               needle_recall=recall.value() if recall else 1.0,
                               needle_missed=recall.missed if recall else [])
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                out.flush()
                got = {r["method"]: r["retrieved"] for r in rows if r["length"] == length and r["depth"] == depth
                       and r["key"] == key}
                rec = {r["method"]: r["needle_recall"] for r in rows if r["length"] == length and r["depth"] == depth
                       and r["key"] == key}
                print("  %s %5d tokens depth %.1f key %d (prompt %.1f s): %s" % (
                    half, length, depth, key, t_prompt, " ".join("%s=%d/%.2f" % (m, got[m], rec[m]) for m in methods)),
                    flush=True)
    return rows


def nll(M, half, methods, lengths, out, quick, steps=64):
    """teacher-forced NLL of the last `steps` tokens of `length` tokens of the half's haystack"""
    h = HALVES[half]
    hay = M.tok(haystack(h["haystack"]), add_special_tokens=False)["input_ids"]
    rows = []
    steps = 16 if quick else steps
    for length in lengths:
        ids = hay[:length]
        if len(ids) < length:
            raise ValueError("haystack too short")
        last, cap = M.prompt(ids[:length - steps])
        res = {}
        for name in methods:
            s, obs = settings_of(name)
            c = M.filled(cap, s, obs)
            logits = [last]
            for t in ids[length - steps:length - 1]:
                logits.append(M.step(c, t))
            c.close()
            lg = np.array(logits)
            lp = lg - np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1, keepdims=True)) - lg.max(1, keepdims=True)
            tgt = np.array(ids[length - steps:length])
            res[name] = (float(-lp[np.arange(steps), tgt].mean()), lg.argmax(1))
        for name in methods:
            row = dict(part="nll", half=half, length=length, method=name, nll=res[name][0],
                       nll_vs_full=res[name][0] - res["full"][0],
                       top1_agree=float(np.mean(res[name][1] == res["full"][1])))
            rows.append(row)
            out.write(json.dumps(row) + "\n")
        out.flush()
        print("  %s nll %5d tokens: %s" % (half, length, " ".join(
            "%s=%+.4f/%.2f" % (m, res[m][0] - res["full"][0], np.mean(res[m][1] == res["full"][1])) for m in methods)),
            flush=True)
    return rows


def mass(M, half, methods, lengths, out, quick, steps=16):
    """each method's selections on teacher-forced decode steps: attention mass kept over
    what exact top-k keeps at the same per-head counts (softmax over every token, summed
    over the query heads of each KV head)"""
    h = HALVES[half]
    hay = M.tok(haystack(h["haystack"]), add_special_tokens=False)["input_ids"]
    hkv = M.shape[2]
    rows = []
    steps = 4 if quick else steps
    for length in lengths:
        ids = hay[:length]
        last, cap = M.prompt(ids[:length - steps])
        for name in methods:
            if name == "full":
                continue
            s, obs = settings_of(name)
            c = M.filled(cap, s, obs)
            keys = DecodeKeys(M, cap)
            ratio = np.zeros((len(M.full), hkv))
            ceiling = np.zeros((len(M.full), hkv))
            n = 0
            n_sink = max(c.caches[0].config()["n_sink"], 0)

            def rec(kind, layer, b, q, k, v, sel):
                keys.add(layer, k)
                for hd in range(hkv):
                    pm = keys.mass(layer, q, hd)               # mass per token over the group's heads
                    chosen = np.asarray(sel[hd], dtype=np.int64)
                    kept = pm[chosen].sum()
                    best = np.sort(pm)[::-1][:len(chosen)].sum()
                    ratio[layer, hd] += kept / best
                    # the most any selection of this count keeps with the sinks always in it
                    sk = min(n_sink, len(pm), len(chosen))
                    rest = np.sort(pm[sk:])[::-1][:len(chosen) - sk].sum()
                    ceiling[layer, hd] += (pm[:sk].sum() + rest) / best
            with pqcache_hf._hooks.recording(rec):
                for t in ids[length - steps:length]:
                    M.step(c, t)
                    n += 1
            c.close()
            ratio /= n
            ceiling /= n
            row = dict(part="mass", half=half, length=length, method=name, mean=float(ratio.mean()),
                       worst=float(ratio.min()), sink_ceiling=float(ceiling.mean()),
                       worst_at=[M.full[int(ratio.argmin()) // hkv], int(ratio.argmin()) % hkv])   # model layer, head
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print("  %s mass %5d tokens %-10s mean %.4f worst %.4f (layer %d head %d); with its %d sinks at most %.4f" % (
                half, length, name, row["mean"], row["worst"], row["worst_at"][0], row["worst_at"][1], n_sink,
                row["sink_ceiling"]), flush=True)
    return rows


def summary(rows, methods):
    lines = []
    for half in HALVES:
        nr = [r for r in rows if r["part"] == "needle" and r["half"] == half]
        if nr:
            cells = {(r["length"], r["depth"], r["key"]) for r in nr}
            scored = [cl for cl in cells if any(r["retrieved"] for r in nr if r["method"] == "full" and
                                                (r["length"], r["depth"], r["key"]) == cl)]
            lines.append("needles, %s half: %d cells, %d scored (full attention retrieves)" % (half, len(cells), len(scored)))
            for m in [m for m in methods if any(r["method"] == m for r in nr)]:
                got = sum(1 for r in nr if r["method"] == m and r["retrieved"] and (r["length"], r["depth"], r["key"]) in scored)
                missed = sorted((r["length"], r["depth"]) for r in nr if r["method"] == m and not r["retrieved"] and
                                (r["length"], r["depth"], r["key"]) in scored)
                rec = [r.get("needle_recall", 1.0) for r in nr if r["method"] == m and
                       (r["length"], r["depth"], r["key"]) in scored]
                lines.append("  %-11s %3d / %d  needle tokens kept %.3f (worst cell %.3f)%s" % (
                    m, got, len(scored), np.mean(rec) if rec else 1.0, min(rec) if rec else 1.0,
                    ("   missed: " + ", ".join("%d@%.1f" % x for x in missed[:8])) if missed and m != "window" else ""))
        for part, fmt in (("nll", "  %-11s %5d tokens: NLL %+.4f nats vs full, top-1 agreement %.3f"),
                          ("mass", "  %-11s %5d tokens: mass kept %.4f of exact top-k's (worst head %.4f; "
                                   "at most %.4f with its sinks)")):
            pr = [r for r in rows if r["part"] == part and r["half"] == half]
            if pr:
                lines.append("%s, %s half:" % (part, half))
                for r in pr:
                    if part == "nll":
                        lines.append(fmt % (r["method"], r["length"], r["nll_vs_full"], r["top1_agree"]))
                    else:
                        lines.append(fmt % (r["method"], r["length"], r["mean"], r["worst"], r["sink_ceiling"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--models-dir", default=os.path.join(ROOT, "build", "models"))
    ap.add_argument("--half", default="both", choices=["tune", "report", "both"])
    ap.add_argument("--parts", default="needles,nll,mass")
    ap.add_argument("--methods", default="", help="methods (default: each part's, PART_METHODS): %s" %
                    ", ".join(METHODS))
    ap.add_argument("--lengths", default="")
    ap.add_argument("--depths", default="")
    ap.add_argument("--keys", type=int, default=0, help="the first N of the half's passkeys (default: all 3)")
    ap.add_argument("--nll-steps", type=int, default=64, help="teacher-forced tokens of the nll part (default 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a few cells of each part (a smoke run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench_real"))
    a = ap.parse_args()
    spec = MODELS[a.model]
    DEPTHS_ARG[:] = [float(x) for x in a.depths.split(",")] if a.depths else []
    KEYS_ARG[:] = [a.keys] if a.keys > 0 else []
    chosen = [m for m in a.methods.split(",") if m]
    for m in chosen:
        if m not in METHODS:
            raise SystemExit("bench_real: unknown method %r (known: %s)" % (m, ", ".join(METHODS)))
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else spec["lengths"]
    M = Model(os.path.join(a.models_dir, spec["dir"]), a.threads)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "%s.jsonl" % a.model)
    rows = []
    every = ["full"]
    with open(path, "w") as out:
        for half in (["tune", "report"] if a.half == "both" else [a.half]):
            for part in a.parts.split(","):
                methods = ["full"] + [m for m in (chosen or PART_METHODS[part]) if m != "full"]
                every += [m for m in methods if m not in every]
                kw = dict(steps=a.nll_steps) if part == "nll" else {}
                rows += {"needles": needles, "nll": nll, "mass": mass}[part](M, half, methods, lengths, out, a.quick, **kw)
    text = summary(rows, every)
    print("=== %s, budget %.2f, library defaults, RoPE layout stated (half), prompt's last 32 queries observed" % (
        a.model, BUDGET))
    print(text)
    with open(os.path.join(a.out, "%s.txt" % a.model), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
