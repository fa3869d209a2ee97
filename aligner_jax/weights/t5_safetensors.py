"""Hugging Face T5 safetensors folders ↔ the Flax tree of :class:`~aligner_jax.models.t5.T5Encoder`.

``transformers`` names the encoder of ``T5EncoderModel`` / ``T5Model`` /
``T5ForConditionalGeneration`` (kernels ``[out, in]``, transposed here)::

  shared.weight (or encoder.embed_tokens.weight)             -> token_embedder/embedding
  encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight [buckets, heads]
                                                             -> encoder/relpos_bias/rel_embedding
                                                                [heads, buckets] (one table,
                                                                shared by every layer, as ours)
  encoder.block.{i}.layer.0.layer_norm.weight                -> layers_{i}/pre_attention_layer_norm
  encoder.block.{i}.layer.0.SelfAttention.{q,k,v,o}.weight   -> layers_{i}/attention/{query,key,
                                                                value,out}/kernel
  encoder.block.{i}.layer.1.layer_norm.weight                -> layers_{i}/pre_mlp_layer_norm
  encoder.block.{i}.layer.1.DenseReluDense.{wi_0,wi_1,wi,wo}.weight -> layers_{i}/mlp/.../kernel
  encoder.final_layer_norm.weight                            -> encoder/encoder_norm/scale

The decoder and the LM head of a full T5 checkpoint are skipped. ``config.json``'s
``feed_forward_proj`` (``gated-gelu`` for v1.1, ``relu`` for v1.0) and ``dense_act_fn`` give
``T5Config.mlp_activations``; Hugging Face's ``gelu_new`` is the tanh GELU of T5 v1.1 (our
``gelu``), its ``gelu`` the exact one (our ``gelu_exact``).
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from flax import traverse_util
from safetensors import safe_open

from aligner_jax.common.errors import ConfigError
from aligner_jax.models.t5 import T5Config, abstract_params
from aligner_jax.weights import hf_folder

# Hugging Face activation names -> T5Config.mlp_activations names.
_ACTIVATIONS = {
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "gelu": "gelu_exact",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_EXPORTED_ACTIVATIONS = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu", "silu": "silu"}
_EMBEDDING = ("token_embedder", "embedding")
_RELPOS = ("encoder", "relpos_bias", "rel_embedding")
_RELPOS_NAME = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
_ATTENTION = {"q": "query", "k": "key", "v": "value", "o": "out"}
_LAYER_RE = re.compile(
    r"^encoder\.block\.(\d+)\.layer\.(?:0\.SelfAttention\.([qkvo])|(0|1)\.layer_norm|"
    r"1\.DenseReluDense\.(wi|wi_\d+|wo))\.weight$"
)
_UNUSED_RE = re.compile(r"^(decoder\..*|lm_head\..*)$")


def config_from_hf(hf_config: Mapping[str, Any], source: str = "config.json") -> T5Config:
    """``T5Config`` (float32, dropout from the file) from a Hugging Face T5 ``config.json``."""
    proj = str(hf_config.get("feed_forward_proj", "relu"))
    gated = proj.startswith("gated-")
    act = str(hf_config.get("dense_act_fn") or proj.removeprefix("gated-"))
    if gated and act == "gelu" and "dense_act_fn" not in hf_config:
        act = "gelu_new"  # transformers maps 'gated-gelu' to the tanh GELU (T5 v1.1)
    if act not in _ACTIVATIONS:
        raise ConfigError(
            f"{source}: feed_forward_proj={proj!r} / dense_act_fn={act!r} is not supported "
            f"(activations: {sorted(_ACTIVATIONS)})"
        )
    activations = (_ACTIVATIONS[act], "linear") if gated else (_ACTIVATIONS[act],)
    try:
        return T5Config(
            vocab_size=int(hf_config["vocab_size"]),
            emb_dim=int(hf_config["d_model"]),
            num_heads=int(hf_config["num_heads"]),
            num_layers=int(hf_config["num_layers"]),
            head_dim=int(hf_config["d_kv"]),
            mlp_dim=int(hf_config["d_ff"]),
            dropout_rate=float(hf_config.get("dropout_rate", 0.1)),
            dtype="float32",
            param_dtype="float32",
            relative_attention_num_buckets=int(hf_config.get("relative_attention_num_buckets", 32)),
            relative_attention_max_distance=int(
                hf_config.get("relative_attention_max_distance", 128)
            ),
            mlp_activations=activations,
            layer_norm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-6)),
        )
    except KeyError as e:
        raise ConfigError(f"{source}: T5 config without {e.args[0]!r}") from None
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from e


def config_to_hf(config: T5Config) -> dict[str, Any]:
    """A Hugging Face ``T5EncoderModel`` ``config.json`` for ``config`` (inverse of
    ``config_from_hf``)."""
    acts = config.mlp_activations
    gated = len(acts) == 2 and acts[1] == "linear"
    if not (len(acts) == 1 or gated) or acts[0] not in _EXPORTED_ACTIVATIONS:
        raise ConfigError(
            f"T5Config.mlp_activations={acts!r} has no Hugging Face T5 equivalent "
            "(one activation, or (activation, 'linear') gated)"
        )
    hf_act = _EXPORTED_ACTIVATIONS[acts[0]]
    proj = f"gated-{'gelu' if hf_act == 'gelu_new' else hf_act}" if gated else hf_act
    return {
        "architectures": ["T5EncoderModel"],
        "model_type": "t5",
        "vocab_size": config.vocab_size,
        "d_model": config.emb_dim,
        "d_kv": config.head_dim,
        "d_ff": config.mlp_dim,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "dropout_rate": config.dropout_rate,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "feed_forward_proj": proj,
        "dense_act_fn": hf_act,
        "is_gated_act": gated,
        "is_encoder_decoder": False,
        "use_cache": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
    }


def hf_to_flax_path(name: str, num_layers: int) -> hf_folder.Target:
    """(Flax path, transpose) of a Hugging Face T5 tensor; None if the encoder does not use it;
    KeyError if the name is not a T5 encoder tensor of ``num_layers`` layers."""
    if name in ("shared.weight", "encoder.embed_tokens.weight"):
        return _EMBEDDING, False
    if name == _RELPOS_NAME:
        return _RELPOS, True
    if name == "encoder.final_layer_norm.weight":
        return ("encoder", "encoder_norm", "scale"), False
    if _UNUSED_RE.match(name):
        return None
    m = _LAYER_RE.match(name)
    if not m or int(m.group(1)) >= num_layers:
        raise KeyError(name)
    layer = ("encoder", f"layers_{int(m.group(1))}")
    if m.group(2):
        return layer + ("attention", _ATTENTION[m.group(2)], "kernel"), True
    if m.group(3):
        norm = "pre_attention_layer_norm" if m.group(3) == "0" else "pre_mlp_layer_norm"
        return layer + (norm, "scale"), False
    return layer + ("mlp", m.group(4), "kernel"), True


def flax_to_hf_name(path: tuple[str, ...]) -> str:
    """The Hugging Face ``T5EncoderModel`` tensor name of a Flax path (inverse of the above)."""
    path = tuple(path)
    if path == _EMBEDDING:
        return "shared.weight"
    if path == _RELPOS:
        return _RELPOS_NAME
    if path == ("encoder", "encoder_norm", "scale"):
        return "encoder.final_layer_norm.weight"
    block = f"encoder.block.{path[1].removeprefix('layers_')}"
    module = path[2]
    if module == "attention":
        inverse = {v: k for k, v in _ATTENTION.items()}
        return f"{block}.layer.0.SelfAttention.{inverse[path[3]]}.weight"
    if module in ("pre_attention_layer_norm", "pre_mlp_layer_norm"):
        return f"{block}.layer.{0 if module == 'pre_attention_layer_norm' else 1}.layer_norm.weight"
    if module == "mlp":
        return f"{block}.layer.1.DenseReluDense.{path[3]}.weight"
    raise ValueError(f"{'/'.join(path)} is not a T5Encoder parameter.")


def load_t5_from_safetensors(model_dir: str | os.PathLike) -> tuple[T5Config, dict[str, Any]]:
    """``(config, params)`` of the encoder of a Hugging Face T5 folder (float32 arrays).

    ``shared.weight`` and ``encoder.embed_tokens.weight`` are the same (tied) table; when a
    folder holds both, ``shared.weight`` is read.
    """
    config = config_from_hf(
        hf_folder.read_config(model_dir), str(pathlib.Path(model_dir) / hf_folder.CONFIG_FILE)
    )
    expected = {
        k: tuple(v.shape) for k, v in traverse_util.flatten_dict(abstract_params(config)).items()
    }
    folder_tensors = _tensor_names(model_dir)
    tied = {"shared.weight", "encoder.embed_tokens.weight"} <= folder_tensors

    def target_of(name: str) -> hf_folder.Target:
        if tied and name == "encoder.embed_tokens.weight":
            return None  # the tied copy of shared.weight
        return hf_to_flax_path(name, config.num_layers)

    params = hf_folder.load_mapped(
        model_dir,
        target_of,
        expected,
        flax_to_hf_name,
        f"a T5 encoder with num_layers={config.num_layers} (check config.json)",
    )
    return config, params


def _tensor_names(model_dir) -> set[str]:
    names: set[str] = set()
    for file in hf_folder.weight_files(model_dir)[1]:
        with safe_open(str(file), framework="numpy") as f:
            names.update(f.keys())
    return names


def save_t5_to_safetensors(
    config: T5Config, params: Mapping[str, Any], model_dir: str | os.PathLike
) -> pathlib.Path:
    """Writes a ``T5EncoderModel`` folder (``config.json`` + ``model.safetensors``)."""
    tensors = hf_folder.hf_tensors(
        params,
        lambda path: (flax_to_hf_name(path), path[-1] == "kernel" or tuple(path) == _RELPOS),
    )
    return hf_folder.write_folder(model_dir, config_to_hf(config), tensors)
