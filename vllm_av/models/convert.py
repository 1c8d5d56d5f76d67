"""Convert a GGUF checkpoint into a bf16 Hugging Face folder that vLLM loads.

Why convert at all: vLLM's GGUF path runs multi-token verification steps
through slow dequantizing kernels (and crashed with a GGUF draft under Model
Runner V2), so benchmarks use plain bf16 weights. transformers dequantizes
the GGUF blocks on the CPU (``GgufConfig(dequantize=True)``, needs the
``gguf`` and ``accelerate`` packages); we then write the state dict with
safetensors directly, because ``save_pretrained`` refuses a model loaded
through the GGUF quantizer.

Output folder: model.safetensors, config.json (no quantization_config),
generation_config.json, tokenizer.json, tokenizer_config.json and
chat_template.jinja. torch and transformers are imported inside the
functions, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path
from typing import Callable

Log = Callable[[str], None]

# Config keys that describe where the model came from or how it was quantized;
# vLLM would try to honour a leftover quantization_config and load GGUF kernels.
_DROP_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path",
                     "_commit_hash", "gguf_file")


def _load_dequantized(gguf: Path):
    """The GGUF model as a dense bf16 transformers model on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig
    from transformers.utils import logging as hf_logging

    # Hides transformers' weight-loading bar; the per-tensor GGUF dequantization bar
    # (plain tqdm inside transformers) stays and is the progress of this slow step.
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True))


def _weights(model) -> tuple[dict, bool]:
    """bf16 tensors to save, and whether lm_head is tied to embed_tokens.

    Both our GGUF files carry a separate output.weight quantized differently
    from the embeddings, so after dequantization the two differ and both are
    saved (tie_word_embeddings=False). We tie only when they are equal, as a
    GGUF without output.weight would give.
    """
    import torch

    sd = model.state_dict()
    packed = [k for k, v in sd.items() if not v.is_floating_point()]
    if packed:
        raise RuntimeError(f"weights still GGUF-packed after loading: {packed[:3]}")
    emb, head = sd.get("model.embed_tokens.weight"), sd.get("lm_head.weight")
    tied = head is None or (emb is not None and torch.equal(head, emb))
    out = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()
           if not (tied and k == "lm_head.weight")}
    return out, tied


def _config(model, tied: bool) -> dict:
    """config.json contents: the loaded config minus GGUF/quantization traces."""
    import transformers

    cfg = model.config.to_dict()
    for key in _DROP_CONFIG_KEYS:
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]  # GGUF loading leaves it None
    cfg["dtype"] = "bfloat16"
    cfg["tie_word_embeddings"] = tied
    cfg["transformers_version"] = transformers.__version__
    return cfg


def _generation_config(model, tokenizer) -> dict:
    """generation_config.json: token ids only, no sampling defaults.

    vLLM's default ``generation_config="auto"`` turns sampling fields found
    here into request defaults; leaving them out keeps benchmark sampling
    exactly what each request asks for. eos lists both <|im_end|> (end of a
    chat turn, the GGUF's eos) and <|endoftext|> (end of a raw completion such
    as a HumanEval prompt), as the upstream Qwen2.5 instruct config does.
    """
    eos = [model.generation_config.eos_token_id]
    for tok in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid not in eos:
            eos.append(tid)
    return {"bos_token_id": model.generation_config.bos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": eos}


def read_safetensors_header(path: Path) -> dict:
    """{name: {dtype, shape, data_offsets}} of a safetensors file, read without torch."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def convert_gguf(gguf: Path, dest: Path, *, log: Log = print) -> dict:
    """Write the bf16 checkpoint of ``gguf`` to ``dest``; return a summary.

    Built in a sibling ``.partial`` folder and renamed at the end, so an
    interrupted conversion never leaves a folder that looks complete.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    gguf, dest = Path(gguf), Path(dest)
    work = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    t0 = time.monotonic()
    log(f"{dest.name}: dequantizing {gguf.name} to bf16 (CPU)")
    model = _load_dequantized(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log(f"{dest.name}: loaded in {time.monotonic() - t0:.0f} s")

    t1 = time.monotonic()
    weights, tied = _weights(model)
    save_file(weights, str(work / "model.safetensors"), metadata={"format": "pt"})
    (work / "config.json").write_text(json.dumps(_config(model, tied), indent=2, sort_keys=True))
    (work / "generation_config.json").write_text(
        json.dumps(_generation_config(model, tokenizer), indent=2))
    tokenizer.save_pretrained(work)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    del model, weights
    log(f"{dest.name}: wrote safetensors, config and tokenizer in {time.monotonic() - t1:.0f} s")

    header = read_safetensors_header(work / "model.safetensors")
    dtypes = sorted({v["dtype"] for v in header.values()})
    if dtypes != ["BF16"]:
        raise RuntimeError(f"{dest.name}: expected only BF16 tensors, found {dtypes}")
    if not (work / "chat_template.jinja").is_file():
        raise RuntimeError(f"{dest.name}: tokenizer has no chat template; MT-Bench prompts need it")
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)
    num_params = sum(_numel(v["shape"]) for v in header.values())
    summary = {"tensors": len(header), "params": num_params, "tied": tied,
               "safetensors_bytes": (dest / "model.safetensors").stat().st_size,
               "seconds": round(time.monotonic() - t0, 1)}
    log(f"{dest.name}: {len(header)} tensors, {num_params / 1e6:.0f}M params, tied={tied}, "
        f"{summary['safetensors_bytes'] / 2**30:.2f} GiB, {summary['seconds']:.0f} s")
    return summary


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
