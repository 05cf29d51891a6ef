#!/usr/bin/env python3
"""hf_tokens.py - text <-> token ids for tiny_llama's Hugging Face models, through the
model directory's own tokenizer.json (the `tokenizers` package: pip install tokenizers).

  hf_tokens.py encode MODEL_DIR (--text T | --file F)       ids on stdout
  hf_tokens.py decode MODEL_DIR [--ids "1 2 3"]             text (ids from stdin by default)
  hf_tokens.py passkey MODEL_DIR --tokens N [--depth 50]    a passkey buried in filler text
  hf_tokens.py findline MODEL_DIR --lines N                 "find the line" retrieval prompt
  hf_tokens.py run MODEL_DIR PROMPT [-- TINY_LLAMA OPTIONS] a whole run: encode, tiny_llama, decode

PROMPT for run is one of --text T, --file F, --passkey N [--depth D], --findline N.
passkey, findline and run print the prompt's token count and, for the retrieval
prompts, the expected answer on stderr; run then says whether the generated text
holds it. Options after -- go to tiny_llama (e.g. -n 16 -t 0 -a pqcache -b 0.1 -c -j 2);
--binary names the tiny_llama binary (default build/tiny_llama next to this tool).

--ids writes ids instead of text for passkey and findline; --no-special leaves out the
special tokens (BOS) the tokenizer's post-processor adds.
"""
import argparse
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of "
                 "irrelevant text. Find it and memorize it. I will quiz you about it.\n")
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def load_tokenizer(model_dir):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("hf_tokens.py: the tokenizers package is missing (python3 -m pip install tokenizers)")
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit("hf_tokens.py: %s not found" % path)
    return Tokenizer.from_file(path)


def encode(tok, text, special=True):
    return tok.encode(text, add_special_tokens=special).ids


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def passkey_prompt(tok, n_tokens, depth, key, special=True):
    """(text, ids): filler around 'The pass key is KEY.' at depth percent, about n_tokens long"""
    needle = "\nThe pass key is %d. Remember it. %d is the pass key.\n" % (key, key)
    fixed = len(encode(tok, PASSKEY_INTRO + needle + PASSKEY_QUESTION, special))
    per = max(1, len(encode(tok, FILLER * 8, False)) / 8.0)
    n = max(0, int((n_tokens - fixed) / per))

    def build(k):
        before = int(round(k * depth / 100.0))
        return PASSKEY_INTRO + FILLER * before + needle + FILLER * (k - before) + PASSKEY_QUESTION

    ids = encode(tok, build(n), special)
    while len(ids) > n_tokens and n > 0:   # trim to the budget
        n -= 1
        ids = encode(tok, build(n), special)
    return build(n), ids


def findline_prompt(tok, n_lines, seed, special=True):
    """(text, ids, answer): n_lines 'line NAME: REGISTER_CONTENT is <number>' lines and a
    question about one of them"""
    rng = random.Random(seed)
    words = ["amber", "basil", "cedar", "delta", "ember", "fjord", "grove", "haven", "iris",
             "juniper", "karma", "lotus", "maple", "nova", "onyx", "pearl", "quartz", "raven",
             "sage", "tulip", "umber", "vivid", "willow", "xenon", "yarrow", "zephyr"]
    names, seen = [], set()
    while len(names) < n_lines:
        nm = "%s-%s" % (rng.choice(words), rng.choice(words))
        if nm not in seen:
            seen.add(nm)
            names.append(nm)
    values = [rng.randint(10000, 99999) for _ in names]
    target = rng.randrange(n_lines)
    lines = ["line %s: REGISTER_CONTENT is <%d>" % (nm, v) for nm, v in zip(names, values)]
    text = ("Below is a record of lines I want you to remember. Each line begins with "
            "'line <line index>' and contains a '<REGISTER_CONTENT>' at the end of the line as a "
            "numerical value. For each line index, memorize its corresponding "
            "<REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve the "
            "corresponding <REGISTER_CONTENT> of a certain line index.\n" + "\n".join(lines) +
            "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line %s? "
            "The <REGISTER_CONTENT> in line %s is <" % (names[target], names[target]))
    return text, encode(tok, text, special), str(values[target])


def read_ids(s):
    return [int(t) for t in s.replace(",", " ").split()]


def prompt_from(args, tok):
    """(ids, expected answer or None)"""
    special = not args.no_special
    if getattr(args, "passkey", None):
        key = random.Random(args.seed).randint(10000, 99999)
        _, ids = passkey_prompt(tok, args.passkey, args.depth, key, special)
        return ids, str(key)
    if getattr(args, "findline", None):
        _, ids, answer = findline_prompt(tok, args.findline, args.seed, special)
        return ids, answer
    if args.text is not None:
        return encode(tok, args.text, special), None
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            return encode(tok, f.read(), special), None
    sys.exit("hf_tokens.py: give --text or --file")


def cmd_run(args, rest):
    tok = load_tokenizer(args.model)
    ids, answer = prompt_from(args, tok)
    binary = args.binary or os.path.join(ROOT, "build", "tiny_llama")
    if "-q" in rest:   # tiny_llama -q prints no ids, and the ids are what run decodes
        sys.stderr.write("hf_tokens.py run: leaving out -q (the generated ids are needed)\n")
        rest = [a for a in rest if a != "-q"]
    sys.stderr.write("prompt: %d tokens%s\n" % (len(ids), (", expected answer " + answer) if answer else ""))
    with tempfile.NamedTemporaryFile("w", suffix=".ids", delete=False) as f:
        f.write(" ".join(map(str, ids)))
        path = f.name
    try:
        p = subprocess.run([binary, args.model, "-I", path] + rest, stdout=subprocess.PIPE)
    finally:
        os.unlink(path)
    if p.returncode != 0:
        return p.returncode
    out = read_ids(p.stdout.decode())
    text = decode(tok, out)
    sys.stdout.write(text + "\n")
    if answer is not None:
        sys.stderr.write("answer: %s\n" % ("found" if answer in text else "not found"))
    return 0


def main(argv):
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, prompt=True):
        p.add_argument("model", help="model directory holding tokenizer.json")
        p.add_argument("--no-special", action="store_true", help="no special tokens (BOS)")
        if prompt:
            p.add_argument("--text")
            p.add_argument("--file")

    common(sub.add_parser("encode", help="text to ids"))
    p = sub.add_parser("decode", help="ids to text")
    common(p, prompt=False)
    p.add_argument("--ids", help="ids (default: standard input)")
    for name in ("passkey", "findline"):
        p = sub.add_parser(name, help="a long-context retrieval prompt")
        common(p, prompt=False)
        if name == "passkey":
            p.add_argument("--tokens", type=int, required=True, help="prompt length in tokens")
            p.add_argument("--depth", type=float, default=50.0, help="needle depth in percent")
        else:
            p.add_argument("--lines", type=int, required=True)
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--ids", action="store_true", help="print ids, not text")
    p = sub.add_parser("run", help="encode, run tiny_llama, decode")
    common(p)
    p.add_argument("--passkey", type=int, metavar="TOKENS", help="a passkey prompt of this length")
    p.add_argument("--depth", type=float, default=50.0)
    p.add_argument("--findline", type=int, metavar="LINES", help="a find-the-line prompt")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--binary", help="the tiny_llama binary")
    args = ap.parse_args(argv)

    if args.cmd == "run":
        return cmd_run(args, rest)
    if rest:
        ap.error("options after -- are for run only")
    tok = load_tokenizer(args.model)
    special = not args.no_special
    if args.cmd == "encode":
        ids, _ = prompt_from(args, tok)
        print(" ".join(map(str, ids)))
    elif args.cmd == "decode":
        print(decode(tok, read_ids(args.ids if args.ids is not None else sys.stdin.read())))
    elif args.cmd == "passkey":
        key = random.Random(args.seed).randint(10000, 99999)
        text, ids = passkey_prompt(tok, args.tokens, args.depth, key, special)
        print(" ".join(map(str, ids)) if args.ids else text)
        sys.stderr.write("prompt: %d tokens, pass key %d\n" % (len(ids), key))
    else:
        text, ids, answer = findline_prompt(tok, args.lines, args.seed, special)
        print(" ".join(map(str, ids)) if args.ids else text)
        sys.stderr.write("prompt: %d tokens, answer %s\n" % (len(ids), answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
