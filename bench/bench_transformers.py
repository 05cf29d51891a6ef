#!/usr/bin/env python3
"""pqcache in transformers on the CPU: decode steps of a 1B-shaped Llama (Llama-3.2-1B's
shape, random weights, fp32) after a prompt of --ctx tokens, with transformers' own
eager attention (DynamicCache) and with the pqcache backend (budget 0.1), side by side;
medians over the steps. Reports where the pqcache step's attention time goes: the
library's calls (append, select, fetch: the selection done in C) and the backend's own
Python and torch code around them (copies, the attention over the selected rows).

usage: make bench-transformers [BENCH_TF_ARGS="--ctx 4096 --steps 16"]
(PQCACHE_LIB and PYTHONPATH=python are set by the make target)"""
import argparse
import statistics
import time

import torch
import transformers

import pqcache_hf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=a.layers,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                   max_position_embeddings=131072, tie_word_embeddings=True,
                                   rope_theta=500000.0)
    torch.manual_seed(0)
    t = time.time()
    eager = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    pq = pqcache_hf.from_config(cfg).eval()
    pq.load_state_dict(eager.state_dict())
    print("model: Llama-3.2-1B shape, %d layers, %.2fB parameters, fp32 (made in %.0f s); torch %d threads"
          % (a.layers, sum(p.numel() for p in eager.parameters()) / 1e9, time.time() - t, torch.get_num_threads()))
    ids = torch.randint(0, cfg.vocab_size, (1, a.ctx))
    res = {}
    seconds = None
    for name, model, cache in (("eager", eager, transformers.DynamicCache(config=cfg)),
                               ("pqcache", pq, pqcache_hf.cache_for(pq, budget_ratio=0.1))):
        with torch.no_grad():
            t = time.time()
            out = model(ids, cache=cache, use_cache=True)
            prefill = time.time() - t
            tok = out.logits[:, -1:].argmax(-1)
            if name == "pqcache":
                seconds = pqcache_hf._hooks.timing()   # the decode steps' attention time, from here
            steps = []
            for _ in range(a.steps):
                t = time.perf_counter()
                out = model(tok, cache=cache, use_cache=True)
                steps.append(time.perf_counter() - t)
                tok = out.logits[:, -1:].argmax(-1)
        res[name] = statistics.median(steps)
        line = "%-8s prefill %.1f s; decode step median %.1f ms (min %.1f, max %.1f) at %d tokens" % (
            name, prefill, 1e3 * res[name], 1e3 * min(steps), 1e3 * max(steps), a.ctx)
        if name == "pqcache":
            lib_s = seconds["library"] / a.steps
            glue = (seconds["backend"] - seconds["library"]) / a.steps
            line += ("\n         per step: library (append, select, fetch) %.2f ms, the backend around it %.2f ms "
                     "(%.1f%% of the step)" % (1e3 * lib_s, 1e3 * glue, 100 * glue / res[name]))
        print(line)
    print("pqcache step / eager step: %.3f" % (res["pqcache"] / res["eager"]))


if __name__ == "__main__":
    main()
