"""tools/hf_tokens.py with a tokenizer trained here by `tokenizers` on local text, and a
whole run through tiny_llama on a small random model in the Hugging Face layout
(pytest; run by make tiny_llama_test)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "tiny_llama"))
import hf_model  # noqa: E402
import hf_tokens  # noqa: E402

TOOL = os.path.join(HERE, "hf_tokens.py")
BIN = os.environ.get("TINY_LLAMA", os.path.join(ROOT, "build", "tiny_llama"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """a byte-level BPE tokenizer trained on the repository's README and the filler
    text, saved as tokenizer.json next to a random model with its vocabulary size"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        corpus = f.read().split("\n")
    corpus += [hf_tokens.FILLER, hf_tokens.PASSKEY_INTRO, "The pass key is 12345."] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(d / "tokenizer.json"))
    hf_model.write_model(str(d), dtype="bf16", vocab=tok.get_vocab_size(), max_pos=2048,
                         arch="llama", tie=True)
    return str(d)


def tool(*args, stdin=None):
    p = subprocess.run([sys.executable, TOOL] + [str(a) for a in args], input=stdin,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


def test_encode_decode_round_trip(model_dir):
    text = "Product quantization selects the tokens: ünïcode, digits 0123 and\ttabs."
    ids = [int(t) for t in tool("encode", model_dir, "--text", text).stdout.split()]
    assert ids[0] == 0                     # <s> from the post-processor
    assert len(ids) > 5 and max(ids) < 400
    assert tool("decode", model_dir, "--ids", " ".join(map(str, ids))).stdout == text + "\n"
    assert tool("decode", model_dir, stdin=" ".join(map(str, ids))).stdout == text + "\n"
    bare = [int(t) for t in tool("encode", model_dir, "--text", text, "--no-special").stdout.split()]
    assert bare == ids[1:]


def test_encode_file(model_dir, tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text("line one\nline two\n", encoding="utf-8")
    ids = tool("encode", model_dir, "--file", f).stdout.split()
    assert tool("decode", model_dir, "--ids", " ".join(ids)).stdout == "line one\nline two\n\n"


@pytest.mark.parametrize("depth", [0, 25, 50, 100])
def test_passkey_prompt(model_dir, depth):
    tok = hf_tokens.load_tokenizer(model_dir)
    text, ids = hf_tokens.passkey_prompt(tok, 1000, depth, 54321)
    assert 900 <= len(ids) <= 1000
    assert text.count("54321") == 2 and text.endswith("The pass key is")
    body = text[len(hf_tokens.PASSKEY_INTRO):-len(hf_tokens.PASSKEY_QUESTION)]
    needle = body.index("\nThe pass key is 54321")
    filler = len(body) - len("\nThe pass key is 54321. Remember it. 54321 is the pass key.\n")
    k = body.count(hf_tokens.FILLER)    # the needle goes between two filler blocks
    assert k >= 10
    assert abs(needle / filler - depth / 100.0) <= 0.5 / k + 0.01
    p = tool("passkey", model_dir, "--tokens", 600, "--depth", depth, "--ids")
    assert 500 <= len(p.stdout.split()) <= 600
    assert "pass key" in p.stderr


def test_findline_prompt(model_dir):
    tok = hf_tokens.load_tokenizer(model_dir)
    text, ids, answer = hf_tokens.findline_prompt(tok, 40, seed=3)
    lines = [l for l in text.split("\n") if l.startswith("line ")]
    assert len(lines) == 40
    asked = text.rsplit("in line ", 1)[1].split(" ")[0]
    line = [l for l in lines if l.startswith("line %s:" % asked)]
    assert len(line) == 1 and line[0].endswith("<%s>" % answer)
    assert ids == hf_tokens.encode(tok, text)


def test_run_wraps_tiny_llama(model_dir):
    text = "The grass is green. The sky is"
    p = tool("run", model_dir, "--text", text, "--binary", BIN, "--", "-n", 6, "-t", 0, "-q")
    assert "-q" in p.stderr   # the ids are needed: run says it leaves -q out
    assert "prompt:" in p.stderr
    # the same run by hand: encode, tiny_llama on the ids, decode
    tok = hf_tokens.load_tokenizer(model_dir)
    ids = hf_tokens.encode(tok, text)
    direct = subprocess.run([BIN, model_dir, "-i", " ".join(map(str, ids)), "-n", "6", "-t", "0"],
                            capture_output=True, text=True, timeout=120)
    assert direct.returncode == 0, direct.stderr
    out = [int(t) for t in direct.stdout.split()][len(ids):]
    assert len(out) == 6
    assert p.stdout == hf_tokens.decode(tok, out) + "\n"
    p = tool("run", model_dir, "--passkey", 300, "--depth", 50, "--binary", BIN, "--",
             "-n", 4, "-t", 0, "-a", "pqcache", "-b", 0.5, "-S", 4)
    assert "answer: " in p.stderr and "expected answer" in p.stderr
