"""Tiny Hugging Face transformers built from a config with random weights: ``gpt2_tiny``, ``bert_tiny``.

Hydra ``_target_`` factories for recipes over real transformer module trees
(``transformer.h.0.mlp``, ``bert.encoder.layer.0.attention.self``). Nothing is downloaded:
the weights come from the global torch seed (the CLI seeds before it builds), so the same
seed gives the same model. transformers is imported inside the factories, so ``surgery``
imports without it; it is the optional extra ``pip install 'surgery[hf]'``.

Every model is built with ``attn_implementation="eager"`` (attention is a plain module whose
output hooks can see and change, instead of a fused kernel), without the key/value cache
(the output is just ``logits``, which reports and fingerprints read), and in ``eval()`` mode.
Any other config field can be passed as a keyword and goes to the config class.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from surgery.errors import ConfigError

MISSING_EXTRA = "model: this model needs the optional extra: pip install 'surgery[hf]'"


def _transformers() -> Any:
    """The transformers module, offline; a ConfigError naming the extra when it is not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub: everything is built from a config
    try:
        import transformers
    except ImportError:
        raise ConfigError(MISSING_EXTRA) from None
    return transformers


def gpt2_tiny(
    n_layer: int = 2,
    n_embd: int = 32,
    n_head: int = 2,
    vocab_size: int = 100,
    n_positions: int = 64,
    **overrides: Any,
) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel``: token ids ``[batch, length]`` → logits ``[batch, length, vocab]``.

    Blocks are ``transformer.h.0..n_layer-1`` (``GPT2Block``), each with ``attn`` (``GPT2Attention``,
    returns a tuple whose item 0 is the attention output) and ``mlp`` (``GPT2MLP``); GPT-2's linear
    layers are ``Conv1D`` (weight stored transposed against ``nn.Linear``).

    >>> model = gpt2_tiny(n_layer=4)
    """
    hf = _transformers()
    fields: dict[str, Any] = {
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "vocab_size": vocab_size,
        "n_positions": n_positions,
        "use_cache": False,
        "attn_implementation": "eager",
        # GPT-2's default special tokens (50256) lie outside a tiny vocabulary
        "bos_token_id": vocab_size - 1,
        "eos_token_id": vocab_size - 1,
        **overrides,
    }
    return hf.GPT2LMHeadModel(hf.GPT2Config(**fields)).eval()


def bert_tiny(
    num_hidden_layers: int = 2,
    hidden_size: int = 32,
    num_attention_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = 100,
    max_position_embeddings: int = 64,
    **overrides: Any,
) -> nn.Module:
    """A randomly initialised ``BertForMaskedLM``: token ids ``[batch, length]`` → logits ``[batch, length, vocab]``.

    The masked-LM head makes the output logits, like ``gpt2_tiny``, so one recipe, loss and
    report serve both. Layers are ``bert.encoder.layer.0..N-1`` (``BertLayer``), each with
    ``attention.self`` (``BertSelfAttention``, returns a tuple whose item 0 is the context),
    ``attention.output`` (projection, residual add and LayerNorm), ``intermediate`` and
    ``output`` (the MLP's second projection, residual add and LayerNorm).

    >>> model = bert_tiny(num_hidden_layers=4)
    """
    hf = _transformers()
    fields: dict[str, Any] = {
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "attn_implementation": "eager",
        **overrides,
    }
    return hf.BertForMaskedLM(hf.BertConfig(**fields)).eval()


def llama_meta(
    num_hidden_layers: int = 80,
    hidden_size: int = 8192,
    intermediate_size: int = 28672,
    num_attention_heads: int = 64,
    num_key_value_heads: int = 8,
    vocab_size: int = 128256,
    max_position_embeddings: int = 8192,
    **overrides: Any,
) -> nn.Module:
    """A ``LlamaForCausalLM`` built on the meta device: names, shapes and dtypes of a 70B-class tree, no weights.

    For ``mode=plan`` and ``mode=modules`` with ``device=meta``: nothing is allocated or initialised
    (``no_init_weights``), so 80 layers of hidden size 8192 build in well under a second once
    transformers is imported. Layers are ``model.layers.0..N-1`` (``LlamaDecoderLayer``), each with
    ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj`` (``nn.Linear``).

    >>> model = llama_meta(num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    """
    import torch

    hf = _transformers()
    from transformers.initialization import no_init_weights

    fields: dict[str, Any] = {
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "use_cache": False,
        "attn_implementation": "eager",
        **overrides,
    }
    with torch.device("meta"), no_init_weights():
        return hf.LlamaForCausalLM(hf.LlamaConfig(**fields)).eval()
