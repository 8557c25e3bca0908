"""A small, randomly initialised Llama written to disk (config, safetensors weights, a
word-level tokenizer over ``w3 … w511``): what vLLM needs to serve a model without downloading
one. Used by the vLLM end-to-end tests and the PD benchmark. Needs torch, safetensors and
tokenizers (all come with vLLM)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 512


@dataclass(frozen=True, slots=True)
class Shape:
    """The model's dimensions; head_dim is ``hidden // heads`` (vLLM's CPU attention needs at
    least 64)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    intermediate: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V of every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 4


def write_tiny_llama(
    path: Path,
    *,
    shape: Shape | None = None,
    weights: bool = True,
    seed: int = 0,
    sliding_window: int | None = None,
) -> Path:
    """Write the model into ``path`` (created); ``weights=False`` writes only the config and
    tokenizer (enough for vLLM's scheduler). ``sliding_window`` (tokens) makes it hybrid like
    Gemma 3: every other layer (the odd ones) attends within that window, so vLLM's hybrid
    allocator gives it a full-attention and a sliding-window KV-cache group."""
    shape = shape or Shape()
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
        config["layer_types"] = [
            "sliding_attention" if layer % 2 else "full_attention" for layer in range(shape.layers)
        ]
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _write_tokenizer(path)
    if weights:
        _write_weights(path, shape, seed)
    return path


def prompt(seed: int, words: int) -> str:
    """A deterministic prompt of ``words`` tokens for this tokenizer."""
    return " ".join(f"w{3 + (seed * 31 + i * 7) % (VOCAB - 3)}" for i in range(words))


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # noqa: S106 (a word)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": 16384,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(settings))


def _write_weights(path: Path, shape: Shape, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)

    def rand(*dims: int) -> Any:
        return torch.randn(*dims, generator=generator) * 0.05

    q, kv, hidden = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    tensors = {
        "model.embed_tokens.weight": rand(VOCAB, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(VOCAB, hidden),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(q, hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q),
            p + "mlp.gate_proj.weight": rand(shape.intermediate, hidden),
            p + "mlp.up_proj.weight": rand(shape.intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, shape.intermediate),
        }
    save_file(tensors, str(path / "model.safetensors"))
