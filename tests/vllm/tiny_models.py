"""Tiny random Llama target/draft pair, built offline at test time.

Model: a 2-layer Llama (hidden 64, 2 heads of 32, the smallest head size the
vLLM CPU attention backend takes) over a word-level vocabulary of
`VOCAB_SIZE` tokens, random weights from a fixed seed, saved in float32.
The lm_head is scaled so that the next-token distribution is peaked but
not degenerate (top token about `TARGET_TOP_PROB` on average), which makes
a biased sampler visible in a few thousand samples.

Draft: the same architecture and weights plus Gaussian noise (relative
to each tensor's spread), so its distributions are close to the target's
but not equal: draft acceptance is neither 0 nor 1.

EAGLE head (`build_eagle_draft`): one random decoder layer over the
target's hidden states, for tests of the EAGLE drafter's path. DSpark and
DFlash heads (`build_dspark_draft`, `build_dflash_draft`) and a target
with its own MTP layer (`build_mtp_target`), for V2's other speculators.

Tokenizer: a `tokenizers` WordLevel model whose vocabulary is the special
tokens plus made-up words; saved as tokenizer.json + tokenizer_config.json
so that vLLM (and transformers) load it with no download. Tests feed token
ids directly, so the words only matter for detokenisation.

`target_next_token_probs` computes the target's exact next-token
distribution with transformers on the CPU in float32, from the same
checkpoint vLLM loads: the reference for the distribution tests.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

import torch

VOCAB_SIZE = 64
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
HIDDEN_SIZE = 64
NUM_HEADS = 2  # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ...
NUM_LAYERS = 2
MAX_POSITIONS = 256
SEED = 1234
# Average top-token probability we scale the lm_head to: peaked (so a
# biased sampler shows up quickly) but far from one-hot (so temperature-1
# sampling has several live tokens at every position).
TARGET_TOP_PROB = 0.4
# Draft = target + noise * std(tensor). 0.2 gives acceptance about 0.6
# (argmax agreement about one half): neither 0 nor 1.
DRAFT_NOISE = 0.2


@dataclass(frozen=True)
class TinyModels:
    target: pathlib.Path
    draft: pathlib.Path
    vocab_size: int = VOCAB_SIZE
    eos_token_id: int = EOS_ID


def _words(n: int) -> list[str]:
    # Pronounceable made-up words: "ba", "be", ..., distinct and space-free.
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words = [c + v for c in consonants for v in vowels]
    words += [c + v + c2 for c in consonants for v in vowels for c2 in "nrs"]
    assert len(words) >= n
    return words[:n]


def build_tokenizer(out_dir: pathlib.Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = SPECIAL_TOKENS + _words(vocab_size - len(SPECIAL_TOKENS))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordLevel has no decoder of its own; join words with spaces.
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _llama_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        dtype="float32",
    )


def _probe_contexts(vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    # [16, 12] random contexts used to calibrate the lm_head scale.
    return torch.randint(len(SPECIAL_TOKENS), vocab_size, (16, 12), generator=gen)


@torch.no_grad()
def _mean_top_prob(model, contexts: torch.Tensor) -> float:
    probs = model(contexts).logits.float().softmax(-1)
    return probs.max(-1).values.mean().item()


@torch.no_grad()
def _calibrate_lm_head(model, contexts: torch.Tensor, target: float) -> float:
    """Scale lm_head in place so the mean top-token probability is `target`."""
    base = model.lm_head.weight.detach().clone()
    lo, hi = 0.01, 100.0
    for _ in range(25):  # bisection on log-scale; 25 halvings: ~1e-6 relative
        mid = math.sqrt(lo * hi)
        model.lm_head.weight.copy_(base * mid)
        if _mean_top_prob(model, contexts) < target:
            lo = mid
        else:
            hi = mid
    scale = math.sqrt(lo * hi)
    model.lm_head.weight.copy_(base * scale)
    return scale


@torch.no_grad()
def build_tiny_models(
    out_dir: pathlib.Path | str,
    vocab_size: int = VOCAB_SIZE,
    draft_noise: float = DRAFT_NOISE,
    seed: int = SEED,
) -> TinyModels:
    """Build target/ and draft/ under `out_dir` (idempotent); return paths."""
    from transformers import LlamaForCausalLM

    out_dir = pathlib.Path(out_dir)
    target_dir, draft_dir = out_dir / "target", out_dir / "draft"
    done = out_dir / "BUILT"
    if done.exists():
        return TinyModels(target_dir, draft_dir, vocab_size)

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(vocab_size)).float().eval()
    # transformers' init is std 0.02 everywhere: logits would be near uniform.
    # Re-draw every matrix with a fan-in scale so the signal survives 2 layers.
    for name, param in model.named_parameters():
        if param.ndim == 2:
            fan_in = param.shape[1] if "embed" not in name else 1
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
    _calibrate_lm_head(model, _probe_contexts(vocab_size, gen), TARGET_TOP_PROB)

    for path in (target_dir, draft_dir):
        path.mkdir(parents=True, exist_ok=True)
        build_tokenizer(path, vocab_size)
    model.save_pretrained(target_dir, safe_serialization=True)

    for name, param in model.named_parameters():
        if param.ndim == 2:
            param.add_(torch.randn(param.shape, generator=gen) * param.std() * draft_noise)
    model.save_pretrained(draft_dir, safe_serialization=True)
    done.write_text("ok\n")
    return TinyModels(target_dir, draft_dir, vocab_size)


def build_draft_with_head_size(models: TinyModels, head_size: int, seed: int = SEED) -> TinyModels:
    """A random-weight draft whose attention head size differs from the
    target's (one head of `head_size`), as Qwen2.5-Coder 0.5B's (64) does
    from 1.5B's (128): vLLM then keeps both models' layers in one KV cache
    group of mixed page sizes. Same tokenizer; returns the pair with it."""
    from transformers import LlamaForCausalLM

    draft_dir = models.draft.parent / f"draft_head{head_size}"
    if not (draft_dir / "config.json").exists():
        config = _llama_config(models.vocab_size)
        config.num_attention_heads = config.num_key_value_heads = 1
        config.head_dim = head_size
        torch.manual_seed(seed)
        draft_dir.mkdir(parents=True, exist_ok=True)
        build_tokenizer(draft_dir, models.vocab_size)
        LlamaForCausalLM(config).float().save_pretrained(draft_dir, safe_serialization=True)
    return TinyModels(models.target, draft_dir, models.vocab_size)


def build_eagle_draft(models: TinyModels, seed: int = SEED) -> TinyModels:
    """A random-weight EAGLE head for the tiny target, in the layout vLLM's
    `EagleLlamaForCausalLM` loads: `fc` (the token's embedding and the
    target's hidden state, concatenated, to the hidden size) and one Llama
    decoder layer; the embedding and the lm_head are the target's (vLLM
    shares them where the head has none). Random, so its drafts are
    accepted about as often as a random token would be: what it exercises
    is the drafter's path through our AV, not its quality."""
    from safetensors.torch import save_file

    eagle_dir = models.draft.parent / "eagle"
    if not (eagle_dir / "model.safetensors").exists():
        config = _llama_config(models.vocab_size)
        config.num_hidden_layers = 1
        config.architectures = ["LlamaForCausalLM"]
        eagle_dir.mkdir(parents=True, exist_ok=True)
        build_tokenizer(eagle_dir, models.vocab_size)
        config.save_pretrained(eagle_dir)
        gen = torch.Generator().manual_seed(seed + 1)
        H, inner = config.hidden_size, config.intermediate_size
        shapes = {"fc": (H, 2 * H), "layers.0.self_attn.q_proj": (H, H),
                  "layers.0.self_attn.k_proj": (H, H), "layers.0.self_attn.v_proj": (H, H),
                  "layers.0.self_attn.o_proj": (H, H), "layers.0.mlp.gate_proj": (inner, H),
                  "layers.0.mlp.up_proj": (inner, H), "layers.0.mlp.down_proj": (H, inner)}
        weights = {f"{name}.weight": torch.randn(shape, generator=gen) / math.sqrt(shape[1])
                   for name, shape in shapes.items()}
        # EAGLE's first layer has no input norm; the one after attention stays.
        weights["layers.0.post_attention_layernorm.weight"] = torch.ones(H)
        save_file(weights, str(eagle_dir / "model.safetensors"))
    return TinyModels(models.target, eagle_dir, models.vocab_size)


# --------------------------------------------------------------- DSpark / DFlash
# Parallel drafters of vLLM 0.32's Model Runner V2 (DSpark: Qwen3DSparkForCausalLM,
# vllm/model_executor/models/qwen3_dspark.py; DFlash: DFlashQwen3ForCausalLM,
# qwen3_dflash.py): a DFlash Qwen3 backbone over the target's aux hidden
# states (`fc` over the outputs of target layers TARGET_LAYER_IDS, plus one,
# concatenated; `hidden_norm`; non-causal Qwen3 decoder layers with q/k norms;
# `norm`), masked query slots filled with MASK_ID. DSpark adds the Markov
# head (markov_w1 [V, r], markov_w2 [V, r]) and, with `confidence_head`, the
# confidence head (proj [1, H + r] with bias); V2's DSpark speculator then
# writes the head's sigmoid into `draft_token_confidence_probs` and builds no
# acceptance estimator. The embedding and lm_head are the target's (vLLM
# shares them where the checkpoint has none). Random, like the EAGLE head:
# what they exercise is the drafters' path through our AV.

MASK_ID = UNK_ID
MARKOV_RANK = 8
# The target's layers whose outputs the head reads (zero-based, DFlash's
# convention: aux layer ids are these plus one).
TARGET_LAYER_IDS = [0, 1]


def _qwen3_draft_config(models: TinyModels, architecture: str, num_layers: int) -> dict:
    """config.json of a Qwen3 DFlash-style head over the tiny target."""
    from transformers import Qwen3Config

    llama = _llama_config(models.vocab_size)
    config = Qwen3Config(
        vocab_size=models.vocab_size, hidden_size=llama.hidden_size,
        intermediate_size=llama.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_HEADS,
        head_dim=llama.hidden_size // NUM_HEADS,
        max_position_embeddings=llama.max_position_embeddings, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=llama.bos_token_id,
        eos_token_id=llama.eos_token_id, dtype="float32",
    ).to_dict()
    config["architectures"] = [architecture]
    # All layers full attention: non-causal over the query block.
    config["layer_types"] = ["full_attention"] * num_layers
    config["target_hidden_size"] = llama.hidden_size
    config["dflash_config"] = {"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS}
    return config


def _backbone_weights(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights of the DFlash Qwen3 backbone, named as the checkpoint
    (vLLM prefixes `model.` and stacks q/k/v and gate/up itself)."""
    H, inner = config["hidden_size"], config["intermediate_size"]
    n_aux = len(TARGET_LAYER_IDS)
    shapes = {"fc": (H, n_aux * H)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}"
        shapes.update({f"{p}.self_attn.q_proj": (H, H), f"{p}.self_attn.k_proj": (H, H),
                       f"{p}.self_attn.v_proj": (H, H), f"{p}.self_attn.o_proj": (H, H),
                       f"{p}.mlp.gate_proj": (inner, H), f"{p}.mlp.up_proj": (inner, H),
                       f"{p}.mlp.down_proj": (H, inner)})
    weights = {f"{name}.weight": torch.randn(shape, generator=gen) / math.sqrt(shape[1])
               for name, shape in shapes.items()}
    head_dim = config["head_dim"]
    for name in ["hidden_norm", "norm"]:
        weights[f"{name}.weight"] = torch.ones(H)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}"
        weights[f"{p}.input_layernorm.weight"] = torch.ones(H)
        weights[f"{p}.post_attention_layernorm.weight"] = torch.ones(H)
        weights[f"{p}.self_attn.q_norm.weight"] = torch.ones(head_dim)
        weights[f"{p}.self_attn.k_norm.weight"] = torch.ones(head_dim)
    return weights


def _write(out_dir: pathlib.Path, models: TinyModels, config: dict,
           weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, models.vocab_size)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous().float() for k, v in weights.items()},
              str(out_dir / "model.safetensors"))


def build_dspark_draft(models: TinyModels, confidence_head: bool = True,
                       confidence_head_with_markov: bool = True, num_layers: int = 1,
                       markov_rank: int = MARKOV_RANK, seed: int = SEED) -> TinyModels:
    """A random-weight Qwen3 DSpark head for the tiny target, in the layout
    vLLM's `Qwen3DSparkForCausalLM` loads (see the module docstring)."""
    name = "dspark" + ("_conf" if confidence_head else "")
    out_dir = models.draft.parent / name
    if not (out_dir / "model.safetensors").exists():
        config = _qwen3_draft_config(models, "Qwen3DSparkModel", num_layers)
        config.update({
            "markov_rank": markov_rank,
            "enable_confidence_head": confidence_head,
            "confidence_head_with_markov": confidence_head_with_markov,
            # K query slots per request, the first at the last accepted token;
            # each slot drafts the token after it.
            "sample_from_anchor": True,
            "block_size": 4,
        })
        gen = torch.Generator().manual_seed(seed + 2)
        weights = _backbone_weights(config, gen)
        V, H, r = models.vocab_size, config["hidden_size"], markov_rank
        weights["markov_head.markov_w1.weight"] = torch.randn(V, r, generator=gen)
        weights["markov_head.markov_w2.weight"] = torch.randn(V, r, generator=gen) / math.sqrt(r)
        if confidence_head:
            d_in = H + (r if confidence_head_with_markov else 0)
            weights["confidence_head.proj.weight"] = torch.randn(1, d_in, generator=gen) / math.sqrt(d_in)
            weights["confidence_head.proj.bias"] = torch.zeros(1)
        _write(out_dir, models, config, weights)
    return TinyModels(models.target, out_dir, models.vocab_size)


def build_dflash_draft(models: TinyModels, num_layers: int = 1, seed: int = SEED) -> TinyModels:
    """A random-weight DFlash head (`DFlashQwen3ForCausalLM`) for the tiny
    target: the backbone of `build_dspark_draft`, no Markov/confidence head."""
    out_dir = models.draft.parent / "dflash"
    if not (out_dir / "model.safetensors").exists():
        config = _qwen3_draft_config(models, "DFlashDraftModel", num_layers)
        config["block_size"] = 5  # 1 anchor + 4 masks (informational; vLLM reads K)
        gen = torch.Generator().manual_seed(seed + 3)
        _write(out_dir, models, config, _backbone_weights(config, gen))
    return TinyModels(models.target, out_dir, models.vocab_size)


# --------------------------------------------------------------- MTP (MiMo)
# A target that carries its own MTP layer: vLLM loads the checkpoint as
# `MiMoForCausalLM` (a Qwen2 model that ignores `model.mtp_layers.*`) and,
# with speculative method "mtp" and no draft named, as its drafter
# `MiMoMTPModel` (the MTP layer alone; V2's MTPSpeculator, a
# TargetDependentARSpeculator that reuses the one layer for all K steps).
# model_type stays "qwen2", so transformers' Qwen2ForCausalLM loads the
# same file for the exact distribution (the MTP tensors are dropped).
# One MTP layer: with more, vLLM switches to its multi-module speculator.


def _mtp_layer_weights(gen: torch.Generator, passthrough: bool) -> dict[str, torch.Tensor]:
    """One MTP layer in MiMo's checkpoint names. `passthrough`: its input
    projection keeps the token embedding and its block is near-identity,
    so its drafts follow the target's head over the next token (accepted
    well above random, with no training)."""
    H, inner, p = HIDDEN_SIZE, 2 * HIDDEN_SIZE, "model.mtp_layers.0."
    mats = {"input_proj": (H, 2 * H), "self_attn.q_proj": (H, H), "self_attn.k_proj": (H, H),
            "self_attn.v_proj": (H, H), "self_attn.o_proj": (H, H),
            "mlp.gate_proj": (inner, H), "mlp.up_proj": (inner, H), "mlp.down_proj": (H, inner)}
    out = {f"{p}{n}.weight": torch.randn(shape, generator=gen) / math.sqrt(shape[1])
           for n, shape in mats.items()}
    for n in ("q_proj", "k_proj", "v_proj"):
        out[f"{p}self_attn.{n}.bias"] = torch.randn(H, generator=gen) * 0.02
    for n in ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_layernorm",
              "post_attention_layernorm"):
        out[f"{p}{n}.weight"] = torch.ones(H)
    if passthrough:
        out[f"{p}input_proj.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], 1)
        out[f"{p}self_attn.o_proj.weight"] *= 0.05
        out[f"{p}mlp.down_proj.weight"] *= 0.05
    return out


@torch.no_grad()
def build_mtp_target(out_dir: pathlib.Path | str, passthrough: bool = True,
                     seed: int = SEED) -> TinyModels:
    """A tiny MiMo target with one MTP layer under `out_dir/mimo` (idempotent);
    target and draft are the same directory."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out_dir = pathlib.Path(out_dir) / ("mimo" if passthrough else "mimo_random")
    if (out_dir / "BUILT").exists():
        return TinyModels(out_dir, out_dir)
    gen = torch.Generator().manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS, max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5, tie_word_embeddings=False, use_sliding_window=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype="float32")
    model = Qwen2ForCausalLM(config).float().eval()
    for name, param in model.named_parameters():
        if param.ndim == 2:
            fan_in = 1 if "embed" in name else param.shape[1]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
        elif name.endswith(".bias"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    _calibrate_lm_head(model, _probe_contexts(VOCAB_SIZE, gen), TARGET_TOP_PROB)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    weights = load_file(str(out_dir / "model.safetensors"))
    weights.update(_mtp_layer_weights(gen, passthrough))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / "BUILT").write_text("ok\n")
    return TinyModels(out_dir, out_dir)


_MODEL_CACHE: dict[str, object] = {}


def _load(model_dir: pathlib.Path | str, dtype=torch.float32):
    # By the config's model_type: Llama for the pair, Qwen2 for the MTP
    # target (whose MTP tensors transformers drops).
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), dtype)
    if key not in _MODEL_CACHE:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        _MODEL_CACHE[key] = model.eval()
    return _MODEL_CACHE[key]


@torch.no_grad()
def next_token_probs(
    model_dir: pathlib.Path | str,
    token_ids: list[int] | list[list[int]],
    temperature: float = 1.0,
    dtype=torch.float32,
) -> torch.Tensor:
    """Exact next-token distribution(s) of the model in `model_dir`, float64.

    `token_ids`: one context (list of ints) -> [V]; a batch of contexts of
    equal length -> [B, V]. Computed with transformers in `dtype` (float32
    unless asked otherwise).
    """
    single = bool(token_ids) and isinstance(token_ids[0], int)
    ids = torch.tensor([token_ids] if single else token_ids, dtype=torch.long)
    logits = _load(model_dir, dtype)(ids).logits[:, -1].double()
    probs = (logits / temperature).softmax(-1)
    return probs[0] if single else probs


def target_next_token_probs(models: TinyModels, token_ids, temperature=1.0):
    """The target's exact next-token distribution (see next_token_probs)."""
    return next_token_probs(models.target, token_ids, temperature)


def first_tokens_distribution(
    model_dir: pathlib.Path | str, prompt: list[int], num_tokens: int = 2,
    dtype=torch.float32,
) -> torch.Tensor:
    """Exact joint distribution of the first `num_tokens` generated tokens.

    Returns a float64 tensor of shape [V] * num_tokens (temperature 1).
    """
    joint = next_token_probs(model_dir, prompt, dtype=dtype)  # [V]
    vocab = joint.shape[0]
    for depth in range(1, num_tokens):
        # Every prefix of length `depth`, in row-major order of `joint`.
        prefixes = torch.cartesian_prod(*[torch.arange(vocab)] * depth)
        prefixes = prefixes.reshape(-1, depth)
        contexts = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
        cond = next_token_probs(model_dir, contexts.tolist(), dtype=dtype)  # [V**depth, V]
        joint = (joint.reshape(-1, 1) * cond).reshape([vocab] * (depth + 1))
    return joint
