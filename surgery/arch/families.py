"""Where each site lives in one architecture family: paths inside a block, and next to the block list.

A path is relative to one block (``self_attn.o_proj``); a tuple lists alternatives, the first that exists
wins (T5's encoder blocks have their MLP at ``layer.1``, its decoder blocks at ``layer.2``). ``None`` means
the family has no such site, and ``absent`` says why, for the refusal. ``final_norm`` is relative to the
module holding the block list; ``unembed`` is relative to the root (``None``: the model's
``get_output_embeddings()``). The token embedding is always ``get_input_embeddings()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Path = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Family:
    """One architecture family's site table."""

    name: str
    blocks: tuple[str, ...]  # class names of its repeated block
    attn: Path  # the attention module (its output's item 0 is the attention result)
    attn_out: Path  # what the attention writes to the residual stream
    mlp: Path  # the MLP (or mixture-of-experts block)
    mlp_out: Path  # what the MLP writes to the residual stream
    heads: Path  # the attention's output projection: its input is the per-head result
    mlp_norm: Path  # pre-norm blocks: the MLP's norm, whose input is @resid_mid and @mlp_in
    final_norm: Path  # next to the block list
    unembed: Path = None  # from the root; None: get_output_embeddings()
    embed: Path = None  # next to each block list; None: get_input_embeddings()
    attn_norm: Path = None  # pre-norm blocks: the attention's norm, whose input is @attn_in
    pattern_item: int = 1  # eager attention: the item of the attention module's output holding the probabilities
    output_only: tuple[str, ...] = ()  # sites standing in for a module the family does not have (its output is right)
    absent: dict[str, str] = field(default_factory=dict)  # site -> why this family has none
    notes: str = ""


PRE_NORM_DECODER: dict[str, Any] = dict(attn="self_attn", attn_out="self_attn", heads="self_attn.o_proj",
                                        attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                                        final_norm="norm")  # fmt: skip
POST_NORM = ("blocks are post-norm: each branch reads the residual stream itself (normed after the residual add),"
             " so no input is read by one branch only")  # fmt: skip
NO_BRANCHES = "Mamba blocks have no attention and no MLP: one state-space mixer (`mixer`)"

FAMILIES: tuple[Family, ...] = (
    Family("gpt2", ("GPT2Block",), attn="attn", attn_out="attn", mlp="mlp", mlp_out="mlp", heads="attn.c_proj",
           attn_norm="ln_1", mlp_norm="ln_2", final_norm="ln_f"),
    Family("gpt_neox", ("GPTNeoXLayer",), attn="attention", attn_out="attention", mlp="mlp", mlp_out="mlp",
           heads="attention.dense", attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
           final_norm="final_layer_norm",
           notes="with use_parallel_residual (the default) attention and MLP both read the block input:"
                 " @resid_mid is refused"),
    Family("opt", ("OPTDecoderLayer",), attn="self_attn", attn_out="self_attn", mlp="fc2", mlp_out="fc2",
           heads="self_attn.out_proj", attn_norm="self_attn_layer_norm", mlp_norm="final_layer_norm",
           final_norm="final_layer_norm",
           output_only=("mlp",),
           notes="no MLP module: @mlp is fc2 (its output is the MLP's); the MLP runs on [batch*positions, hidden];"
                 " post-norm OPT (do_layer_norm_before: false) refuses @resid_mid, @attn_in and @mlp_in"),
    Family("llama", ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                     "Phi3DecoderLayer", "MixtralDecoderLayer", "GemmaDecoderLayer", "Qwen2MoeDecoderLayer",
                     "Qwen3MoeDecoderLayer"),
           mlp=("mlp", "block_sparse_moe"), mlp_out=("mlp", "block_sparse_moe"), **PRE_NORM_DECODER,
           notes="Llama, Mistral, Qwen2/3, Phi3, Mixtral (@mlp is the sparse MoE block)"),
    Family("gemma2", ("Gemma2DecoderLayer", "Gemma3DecoderLayer"), attn="self_attn",
           attn_out="post_attention_layernorm", mlp="mlp", mlp_out="post_feedforward_layernorm",
           heads="self_attn.o_proj", attn_norm="input_layernorm", mlp_norm="pre_feedforward_layernorm",
           final_norm="norm",
           notes="Gemma2/3 norm each sublayer's output before the residual add: @attn_out, @mlp_out are those norms"),
    Family("bert", ("BertLayer", "RobertaLayer"), attn="attention.self", attn_out="attention.output.dense",
           mlp="output.dense", mlp_out="output.dense", heads="attention.output.dense", mlp_norm=None,
           final_norm=None, unembed="cls.predictions", output_only=("mlp",),
           absent={"resid_mid": "BERT blocks are post-norm: the stream between attention and MLP is"
                                " attention.output.LayerNorm's output; select it by name",
                   "final_norm": "BERT blocks are post-norm: there is no final norm",
                   "attn_in": f"BERT {POST_NORM}", "mlp_in": f"BERT {POST_NORM}",
                   "unembed_in": "BERT blocks are post-norm: there is no final norm"},
           notes="@mlp is output.dense, the MLP's down projection (its output is the MLP's);"
                 " @unembed is the masked-LM head cls.predictions"),
    Family("t5", ("T5Block",), attn="layer.0.SelfAttention", attn_out="layer.0.SelfAttention",
           mlp=("layer.2.DenseReluDense", "layer.1.DenseReluDense"),
           mlp_out=("layer.2.DenseReluDense", "layer.1.DenseReluDense"), heads="layer.0.SelfAttention.o",
           mlp_norm=("layer.2.layer_norm", "layer.1.layer_norm"), final_norm="final_layer_norm", embed="embed_tokens",
           attn_norm="layer.0.layer_norm", pattern_item=2,
           notes="encoder and decoder blocks: @SITE is both stacks, @encoder.SITE / @decoder.SITE one; @embed is each"
                 " stack's embed_tokens (the tied `shared` is never called);"
                 " @attn is self-attention (cross-attention is layer.1.EncDecAttention)"),
    Family("vit", ("ViTLayer",), attn="attention", attn_out="attention", mlp=("mlp", "intermediate"),
           mlp_out=("mlp", "output.dense"), heads=("attention.o_proj", "attention.output.dense"),
           attn_norm="layernorm_before", mlp_norm="layernorm_after", final_norm="layernorm", unembed="",
           absent={"unembed": "a vision classifier has no unembedding (its head is `classifier`)",
                   "unembed_in": "a vision classifier has no unembedding (its head is `classifier`)"}),
    Family("mamba", ("MambaBlock", "Mamba2Block"), attn=None, attn_out=None, mlp=None, mlp_out=None, heads=None,
           mlp_norm=None, final_norm="norm_f",
           absent={site: NO_BRANCHES for site in ("attn", "attn_out", "mlp", "mlp_out", "heads", "resid_mid",
                                                  "attn_in", "mlp_in", "attn_pattern")}),
)  # fmt: skip

BY_BLOCK: dict[str, Family] = {cls: family for family in FAMILIES for cls in family.blocks}
