"""Exporting an ALIGNER encoder as a folder PyTorch users load (``aligner-export``).

The folder holds

  * the backbone as a ``transformers`` folder: ``config.json`` + ``model.safetensors``
    (``BertModel`` or ``T5EncoderModel`` layout) and the tokenizer files it was trained with;
  * ``aligner_heads.safetensors`` + ``aligner_config.json`` (``weights.aligner_heads``): the
    projection and salience heads and the settings that apply them;
  * with ``layout='pylate'`` (the default), the sentence-transformers files PyLate reads, so
    that ``pylate.models.ColBERT(FOLDER)`` loads it as it is and encodes our token vectors:
    ``modules.json`` (the Transformer module at the root, then ``1_Dense``), ``1_Dense/`` (the
    projection as a bias-free linear layer: ``W_p``, or the identity for
    ``projection='identity'``), ``sentence_bert_config.json`` and
    ``config_sentence_transformers.json`` (no query / document prefix tokens, no query expansion,
    no skiplist, the model's query and document token budgets);
  * ``README.md``: how to apply them (paper equations named).

``load_encoder(backbone_weights='hf:FOLDER')`` loads it back, heads included, and scores exactly as
the exported model did. PyLate's token vectors equal ours (``benchmarks/peers/pylate_check.py``);
its MaxSim ignores the saliences (u = 1: ColBERT's sum of maxima).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import numpy as np
from safetensors.numpy import save

from aligner_jax.common import errors, fileio
from aligner_jax.common.errors import ConfigError
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.models.t5 import T5Config
from aligner_jax.weights import aligner_heads, hf_folder, hf_models, minilm

LAYOUTS = ("pylate", "transformers")
DENSE_DIR = "1_Dense"
# The sentence-transformers / PyLate files of the ``pylate`` layout (removed from an earlier export
# re-written as ``transformers``).
_DENSE_WEIGHTS = f"{DENSE_DIR}/model.safetensors"
SENTENCE_TRANSFORMERS_FILES = (
    hf_folder.MODULES_FILE,
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)

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
{pylate}"""

_PYLATE_README = """
With PyLate (`modules.json`, `1_Dense/`, `config_sentence_transformers.json`: no prefix tokens,
no query expansion, no skiplist, queries cut at {query_maxlen} tokens and documents at
{doc_maxlen}) the same token vectors come out, L2-normalised:

```python
from pylate import models

model = models.ColBERT("THIS_FOLDER")
q = model.encode(["a query"], is_query=True)[0]        # [m, {dim}] token vectors q_i
d = model.encode(["a document"], is_query=False)[0]    # [n, {dim}]
```

PyLate's MaxSim gives every token u = 1 (ColBERT's sum of maxima); apply the salience heads above
for ALIGNER's Eq. 2.
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
    elif main.suffix == ".txt" and (folder / "tokenizer_config.json").is_file():
        # a WordPiece vocabulary of any name is cased as its folder's config says
        # (hf_models.lowercase): without it the export would lower-case
        sources["tokenizer_config.json"] = folder / "tokenizer_config.json"
    return sources


def readme(config: aligner_lib.AlignerConfig, layout: str = "pylate") -> str:
    t5 = isinstance(config.backbone, T5Config)
    if config.projection == "dense":
        project = 'v = h @ heads["projection.weight"].T                  # [B, L, D] (§4.1)'
    else:
        project = "v = h                                                 # identity projection"
    pylate = ""
    if layout == "pylate":
        pylate = _PYLATE_README.format(
            query_maxlen=config.query_maxlen, doc_maxlen=config.doc_maxlen, dim=config.output_dim
        )
    return _README.format(
        pylate=pylate,
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


def projection_matrix(config: aligner_lib.AlignerConfig, params: dict) -> np.ndarray:
    """The token projection as a PyTorch ``Linear`` weight ``[D, H]`` float32: ``W_p`` (§4.1), or
    the identity for ``projection='identity'`` (exact in float32: ``x·1 + Σ 0·x_j = x``)."""
    if config.projection == "dense":
        return aligner_heads.heads_to_tensors(config, params)["projection.weight"]
    return np.eye(aligner_lib.backbone_hidden_size(config.backbone), dtype=np.float32)


def sentence_transformers_files(config: aligner_lib.AlignerConfig) -> dict[str, dict | list]:
    """The JSON files of the ``pylate`` layout, ``{relative path: object}``: a sentence-transformers
    model of two modules, the backbone (at the folder's root) and a bias-free ``1_Dense`` linear
    layer, with PyLate's ColBERT settings set to give our token vectors: no ``[Q]``/``[D]``
    prefix tokens, no query expansion (no ``[MASK]`` padding), no punctuation skiplist, queries
    cut at ``query_maxlen`` and documents at ``doc_maxlen`` tokens (special tokens included, as
    our tokenizer counts them)."""
    hidden = aligner_lib.backbone_hidden_size(config.backbone)
    transformer = {"max_seq_length": config.doc_maxlen, "do_lower_case": False}
    if not isinstance(config.backbone, T5Config):  # BertModel without the unused pooler
        transformer["model_args"] = {"add_pooling_layer": False}
    return {
        hf_folder.MODULES_FILE: [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": DENSE_DIR, "type": "pylate.models.Dense.Dense"},
        ],
        "sentence_bert_config.json": transformer,
        "config_sentence_transformers.json": {
            "model_type": "ColBERT",
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "MaxSim",
            "query_prefix": "",
            "document_prefix": "",
            "query_length": config.query_maxlen,
            "document_length": config.doc_maxlen,
            "attend_to_expansion_tokens": False,
            "skiplist_words": [],
            "do_query_expansion": False,
        },
        f"{DENSE_DIR}/config.json": {
            "in_features": hidden,
            "out_features": config.output_dim,
            "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity",
            "use_residual": False,
        },
    }


def _write_export(config, params: dict, sources: dict, layout: str, folder: pathlib.Path) -> None:
    """Every file of the export, written into ``folder`` (a new, empty one)."""
    hf_models.save_backbone(config.backbone, params["backbone"], folder)
    for name, source in sources.items():
        fileio.atomic_write(folder / name, _copy(source))
    if layout == "pylate":
        (folder / DENSE_DIR).mkdir(exist_ok=True)
        weight = {"linear.weight": np.ascontiguousarray(projection_matrix(config, params))}
        fileio.atomic_write_bytes(folder / _DENSE_WEIGHTS, save(weight, {"format": "pt"}))
        for name, obj in sentence_transformers_files(config).items():
            fileio.atomic_write_json(folder / name, obj, sort_keys=False)
    aligner_heads.save_heads(config, params, folder, readme(config, layout))


def _refuse_foreign_files(output_dir: pathlib.Path, work: pathlib.Path) -> None:
    """Refuses to replace an earlier export holding files this export does not write (the
    user's own, which the swap would delete): names them; nothing is changed."""
    if not output_dir.is_dir():
        return
    ours = {p.relative_to(work) for p in work.rglob("*")}  # and the other layout's:
    ours |= {pathlib.Path(name) for name in (*SENTENCE_TRANSFORMERS_FILES, DENSE_DIR)}
    ours |= {pathlib.Path(DENSE_DIR, "config.json"), pathlib.Path(_DENSE_WEIGHTS)}
    foreign = sorted(str(p.relative_to(output_dir)) for p in output_dir.rglob("*")
                     if p.relative_to(output_dir) not in ours)  # fmt: skip
    if foreign:
        raise ConfigError(
            f"--output_dir={output_dir}: holds {len(foreign)} file(s) or folder(s) an export "
            f"does not write (e.g. {foreign[:3]}), which replacing it would delete; move them "
            "or choose another folder (nothing was changed)"
        )


def _swap_in(work: pathlib.Path, output_dir: pathlib.Path) -> None:
    """Puts the finished export ``work`` at ``output_dir``: renamed into place, the earlier
    export (if any) renamed aside first and removed after, so the folder holds one whole export
    at every moment but the instant between the two renames."""
    old = None
    if output_dir.exists():
        old = work.with_name(work.name.replace(".export-tmp", ".export-old"))
        os.rename(output_dir, old)
    os.rename(work, output_dir)
    fileio.fsync_dir(output_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_model(
    config: aligner_lib.AlignerConfig,
    params: dict,
    tokenizer: str,
    output_dir: str | os.PathLike,
    layout: str = "pylate",
) -> list[str]:
    """Writes the export folder (see the module docstring); returns the paths of its files,
    relative to it.

    ``tokenizer`` is the resolved tokenizer of ``load_encoder`` (``EncoderBundle.source``);
    ``layout`` is ``pylate`` (also a sentence-transformers / PyLate model) or ``transformers``
    (the backbone folder and the heads only). An existing folder is refused unless it holds an
    earlier export, which is replaced as a whole: the new export is written into a temporary
    folder beside it and renamed into place once complete, so a failed or interrupted export
    leaves the earlier one as it was (never a mix of two). A symbolic link is followed: the
    export it points to is replaced, the link kept.
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"--format={layout}: choose one of {', '.join(LAYOUTS)}")
    output_dir = fileio.check_output_dir(output_dir, "--output_dir")
    if output_dir.is_symlink():  # the export goes where the link points; the link stays
        output_dir = output_dir.resolve()
    if (
        output_dir.is_dir()
        and any(output_dir.iterdir())
        and not aligner_heads.is_export(output_dir)
    ):
        raise ConfigError(
            f"--output_dir={output_dir}: not empty and not an aligner-export folder; choose an "
            "empty or new folder"
        )
    sources = _tokenizer_sources(tokenizer)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("tmp", "old"):  # what a killed export left
        for stale in output_dir.parent.glob(f".{output_dir.name}.*.export-{suffix}"):
            shutil.rmtree(stale, ignore_errors=True)
    work = pathlib.Path(
        tempfile.mkdtemp(prefix=f".{output_dir.name}.", suffix=".export-tmp", dir=output_dir.parent)
    )
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(work, 0o777 & ~umask)  # a folder as mkdir makes it (mkdtemp's is private)
    try:
        _write_export(config, params, sources, layout, work)
        _refuse_foreign_files(output_dir, work)
        _swap_in(work, output_dir)
    except BaseException as error:
        shutil.rmtree(work, ignore_errors=True)
        code = getattr(error.__cause__, "errno", None) or getattr(error, "errno", None)
        if isinstance(error, OSError) and code in fileio.STORAGE_ERRNOS:
            kept = "the export there before is unchanged"
            kept = kept if output_dir.exists() else "nothing was left behind"
            raise errors.OutputWriteError(
                f"--output_dir={output_dir}: the export was not written ({os.strerror(code)}); "
                f"{kept}: free space or fix the folder's permissions and re-run"
            ) from error
        raise
    return sorted(str(p.relative_to(output_dir)) for p in output_dir.rglob("*") if p.is_file())
