r"""Export binary (``aligner-export``): a thin absl + gin wrapper of
:func:`aligner_jax.weights.hf_export.export_model`, writing an encoder as a folder PyTorch users
load (``transformers`` backbone + tokenizer, ``aligner_heads.safetensors``,
``aligner_config.json``, ``README.md``; ``--format=pylate``, the default: also a
sentence-transformers model ``pylate.models.ColBERT(FOLDER)`` loads) that ``hf:FOLDER`` loads.

  python -m aligner_jax.export --checkpoint=outputs/scifact_minilm --output_dir=outputs/hf

  python -m aligner_jax.export --gin_file=models/t5_base.gin --gin_file=models/aligner_t5.gin \
    --gin.load_encoder.backbone_weights="'t5x:/path/checkpoint_1000000'" --output_dir=t5_hf

Flags: ``--gin_file``, ``--gin.NAME=VALUE``, ``--checkpoint``, ``--output_dir``, ``--format``.

Without ``--gin_file`` the model is the one the checkpoint was trained with: the ``config.gin``
that ``aligner-train`` wrote in its MODEL_DIR (the backbone weights and tokenizer of the
training run, unless bound otherwise); with no ``--checkpoint``, the bundled zero-shot model
(``models/minilm_identity.gin``).
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.encoding import loading
from aligner_jax.weights import hf_export

FLAGS = flags.FLAGS
DEFAULT_GIN_FILES = ("models/minilm_identity.gin",)  # without --checkpoint: the bundled model
flags.DEFINE_string("checkpoint", None, "aligner-train MODEL_DIR (newest step) or step folder.")
flags.DEFINE_string("output_dir", None, "The export folder (new, empty or an earlier export).")
flags.DEFINE_enum(
    "format", "pylate", hf_export.LAYOUTS, "pylate (PyLate loads it too) or transformers."
)


def _export(checkpoint: str | None, output_dir: str, layout: str) -> None:
    if checkpoint and not flags.FLAGS.gin_file:
        loading.bind_encoder_as_trained()
    bundle = loading.load_encoder(**({"checkpoint": checkpoint} if checkpoint else {}))
    files = hf_export.export_model(
        bundle.config, bundle.params, bundle.source["tokenizer"], output_dir, layout
    )
    print(f"aligner-export: {bundle.name} -> {output_dir} ({layout}): {', '.join(files)}")
    print(f"  load back with --gin.load_encoder.backbone_weights=\"'hf:{output_dir}'\"")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.output_dir:
        raise app.UsageError("--output_dir is required")
    trained = loading.trained_config(FLAGS.checkpoint)
    needs = loading.gin_file_needed(FLAGS.checkpoint)
    cli.run_job(
        "aligner-export",
        _export,
        default_gin_files=(str(trained),) if trained else DEFAULT_GIN_FILES,
        needs_gin_file=needs,
        on_interrupt=f"{FLAGS.output_dir} is as it was before (the export is written aside and "
        "renamed into place once complete)",
        checkpoint=FLAGS.checkpoint,
        output_dir=FLAGS.output_dir,
        layout=FLAGS.format,
    )


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
