"""Exporting an ALIGNER encoder as a folder PyTorch users load (``aligner-export``).

The folder holds

  * the backbone as a ``transformers`` folder: ``config.json`` + ``model.safetensors``
    (``BertModel`` or ``T5EncoderModel`` layout) and the tokenizer files it was trained with;
  * ``aligner_heads.safetensors`` + ``aligner_config.json`` (``weights.aligner_heads``): the
    projection and salience heads and the settings that apply them;
  * ``README.md``: how to apply them (paper equations named).

``load_encoder(backbone_weights='hf:FOLDER')`` loads it back, heads included, and scores exactly as
the exported model did.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from aligner_jax.common import fileio
from aligner_jax.common.errors import ConfigError
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.models.t5 import T5Config
from aligner_jax.weights import aligner_heads, hf_folder, hf_models, minilm

_README = """# ALIGNER encoder ({backbone}, exported by aligner_jax)

ALIGNER ("Multi-vector retrieval as sparse alignment"): one shared encoder
for queries and documents; a document's score for a query is

    sim(Q, D) = Σ_ij S_ij A_ij / Σ_ij A_ij                          (Eq. 1-2)
    S_ij = q_i · d_j,   A = Ã ⊙ (u^q ⊗ u^d),   Ã = top-k per query token (k = 1: ColBERT)

Files: `config.json` + `model.safetensors` (a `transformers` {model_class}), the tokenizer
files, `aligner_heads.safetensors` and `aligner_config.json` (projection `{projection}`,
{dim}-d token vectors, salience `{salience}`).

```python
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoTokenizer, {model_class}

folder = "THIS_FOLDER"
tokenizer = AutoTokenizer.from_pretrained(folder)
model = {model_class}.from_pretrained(folder{model_kwargs}).eval()
heads = load_file(f"{{folder}}/aligner_heads.safetensors")

batch = tokenizer(["a query"], truncation=True, max_length={query_maxlen}, return_tensors="pt")
with torch.no_grad():
    h = model(**batch).last_hidden_state                  # [B, L, H] backbone token states
mask = batch["attention_mask"].bool()
{project}
q = F.normalize(v, dim=-1) * mask[..., None]            # token vectors q_i (padding: 0)
```

Salience (Eq. 3): `s_i = ReLU(W h_i + b)` with `query_salience.*` for queries and
`doc_salience.*` for documents; `u_i = λ_i · s_i`, where λ solves the entropy-regularised LP of
Eq. 4 (Σλ = k = ⌈α·m⌉ over the m real tokens, α^q = {alpha_q}, α^d = {alpha_d}, ε = {epsilon}),
by the iterations of Eq. 5 ({lp_iters} after an exact initialisation; `aligner_jax.core.salience.
entropic_top_k`). With `salience = "none"` there are no salience tensors and u = 1; with `relu`,
u = s. Queries are encoded with at most {query_maxlen} tokens in training, documents {doc_maxlen}.

In aligner_jax: `--gin.load_encoder.backbone_weights="'hf:THIS_FOLDER'"`.
"""


def _tokenizer_sources(spec: str) -> dict[str, pathlib.Path]:
    """{file name in the export: source file} for a resolved ``load_encoder`` tokenizer spec."""
    if spec == "minilm":
        folder = minilm.minilm_model_dir()
        main = folder / "tokenizer.json"
    else:
        for prefix in ("sentencepiece:", "wordpiece:"):
            spec = spec.removeprefix(prefix)
        main = pathlib.Path(spec)
        folder = main.parent
    canonical = {".model": "spiece.model", ".txt": "vocab.txt", ".json": "tokenizer.json"}
    if main.suffix not in canonical:
        raise ConfigError(f"tokenizer {spec!r}: cannot export a tokenizer of this kind")
    sources = {canonical[main.suffix]: main}
    if main.name in hf_folder.TOKENIZER_FILES:  # a model folder's tokenizer: take its siblings
        for name in hf_folder.TOKENIZER_FILES:
            if (folder / name).is_file():
                sources.setdefault(name, folder / name)
    return sources


def readme(config: aligner_lib.AlignerConfig) -> str:
    t5 = isinstance(config.backbone, T5Config)
    if config.projection == "dense":
        project = 'v = h @ heads["projection.weight"].T                  # [B, L, D] (§4.1)'
    else:
        project = "v = h                                                 # identity projection"
    return _README.format(
        backbone="T5 encoder" if t5 else "BERT",
        model_class="T5EncoderModel" if t5 else "AutoModel",
        model_kwargs="" if t5 else ", add_pooling_layer=False",
        dim=config.output_dim,
        project=project,
        **{f: getattr(config, f) for f in aligner_heads.ARCHITECTURE_FIELDS},
        query_maxlen=config.query_maxlen,
        doc_maxlen=config.doc_maxlen,
    )


def _copy(source: pathlib.Path):
    def write(f):
        with open(source, "rb") as src:
            shutil.copyfileobj(src, f)

    return write


def export_model(
    config: aligner_lib.AlignerConfig, params: dict, tokenizer: str, output_dir: str | os.PathLike
) -> list[str]:
    """Writes the export folder (see the module docstring); returns the names of its files.

    ``tokenizer`` is the resolved tokenizer of ``load_encoder`` (``EncoderBundle.source``). An
    existing folder is refused unless it holds an earlier export, whose files are replaced.
    """
    output_dir = fileio.check_output_dir(output_dir, "--output_dir")
    if (
        output_dir.is_dir()
        and any(output_dir.iterdir())
        and not aligner_heads.has_heads(output_dir)
    ):
        raise ConfigError(
            f"--output_dir={output_dir}: not empty and not an aligner-export folder; choose an "
            "empty or new folder"
        )
    sources = _tokenizer_sources(tokenizer)
    output_dir.mkdir(parents=True, exist_ok=True)
    stale = set(hf_folder.TOKENIZER_FILES) | {hf_folder.WEIGHTS_INDEX_FILE}
    for name in stale - set(sources):
        (output_dir / name).unlink(missing_ok=True)
    hf_models.save_backbone(config.backbone, params["backbone"], output_dir)
    for name, source in sources.items():
        fileio.atomic_write(output_dir / name, _copy(source))
    aligner_heads.save_heads(config, params, output_dir, readme(config))
    return sorted(p.name for p in output_dir.iterdir() if p.is_file())
