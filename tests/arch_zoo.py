"""Tiny Hugging Face models of every architecture family the sites know, built from transformers' config classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 64
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 48, "max_position_embeddings": 64}  # fmt: skip
GQA = {**COMMON, "num_key_value_heads": 2}


def _configs(hf: Any) -> dict[str, tuple[Any, Any]]:
    """name -> (config, model class): two blocks, 4 heads (2 key/value heads where the family has GQA)."""
    return {
        "gpt2": (hf.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB), hf.GPT2LMHeadModel),
        "gpt_neox": (hf.GPTNeoXConfig(**COMMON), hf.GPTNeoXForCausalLM),
        "opt": (hf.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32), hf.OPTForCausalLM),
        "llama": (hf.LlamaConfig(**GQA), hf.LlamaForCausalLM),
        "mistral": (hf.MistralConfig(**GQA), hf.MistralForCausalLM),
        "qwen2": (hf.Qwen2Config(**GQA), hf.Qwen2ForCausalLM),
        "qwen3": (hf.Qwen3Config(**GQA, head_dim=8), hf.Qwen3ForCausalLM),
        "gemma2": (hf.Gemma2Config(**GQA, head_dim=8), hf.Gemma2ForCausalLM),
        "gemma3": (hf.Gemma3TextConfig(**GQA, head_dim=8), hf.Gemma3ForCausalLM),
        "phi3": (hf.Phi3Config(**GQA, pad_token_id=0), hf.Phi3ForCausalLM),
        "mixtral": (hf.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2), hf.MixtralForCausalLM),
        "bert": (hf.BertConfig(**COMMON), hf.BertForMaskedLM),
        "t5": (hf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                           decoder_start_token_id=0), hf.T5ForConditionalGeneration),
        "vit": (hf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                             image_size=16, patch_size=8, num_labels=3), hf.ViTForImageClassification),
        "mamba": (hf.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4),
                  hf.MambaForCausalLM),
    }  # fmt: skip


FAMILIES = ("gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral",
            "bert", "t5", "vit", "mamba")  # fmt: skip


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny model ``name``, seeded, eager attention, in eval mode."""
    import transformers

    config, cls = _configs(transformers)[name]
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return cls(config).eval()


def save_all(root: Path) -> dict[str, Path]:
    """Every tiny model saved with save_pretrained under ``root/NAME``."""
    out = {}
    for name in FAMILIES:
        path = root / name
        build(name).save_pretrained(path)
        out[name] = path
    return out


def example(name: str) -> dict[str, torch.Tensor]:
    """A keyword batch the model ``name`` takes: token ids, or pixels for ViT, decoder ids for T5."""
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.rand(2, 3, 16, 16, generator=g)}
    ids = torch.randint(1, VOCAB, (2, 6), generator=g)
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(1, VOCAB, (2, 4), generator=g)}
    return {"input_ids": ids}
