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
target's hidden states, for tests of the EAGLE drafter's path.

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


_MODEL_CACHE: dict[str, object] = {}


def _load(model_dir: pathlib.Path | str, dtype=torch.float32):
    from transformers import LlamaForCausalLM

    key = (str(model_dir), dtype)
    if key not in _MODEL_CACHE:
        model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
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
