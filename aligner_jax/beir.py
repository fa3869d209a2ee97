r"""BEIR datasets binary (``aligner-beir``): download an official BEIR dataset, or validate a BEIR
folder and print its counts (a thin absl wrapper of :mod:`aligner_jax.data.beir`).

  python -m aligner_jax.beir --download=scifact --to=data/beir

  python -m aligner_jax.beir --dataset_dir=../shared/data/beir/scifact --split=test

``--download`` unpacks ``NAME.zip`` from the BEIR mirror (``--url_template``) into ``TO/NAME``;
``--dataset_dir`` loads the folder with the same checks as every binary (a bad line is reported
with its file and line number) and prints its counts (``--json``: as JSON).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.data import beir

FLAGS = flags.FLAGS
flags.DEFINE_string("download", None, "Download this BEIR dataset, e.g. scifact (needs --to).")
flags.DEFINE_string("to", None, "Folder to unpack a --download into (creates TO/NAME).")
flags.DEFINE_string(
    "url_template", beir.BEIR_URL_TEMPLATE, "Download URL with a {name} placeholder."
)
flags.DEFINE_float("timeout_s", 60.0, "Network timeout of --download, in seconds.")
flags.DEFINE_string("dataset_dir", None, "A BEIR folder to validate and count.")
flags.DEFINE_string("split", "test", "qrels split of --dataset_dir (qrels/<split>.tsv).")
flags.DEFINE_enum(
    "unknown_qrels", "error", list(beir.UNKNOWN_QRELS_MODES), "qrels naming unknown ids."
)
flags.DEFINE_bool("json", False, "Print the counts of --dataset_dir as JSON.")


def _job() -> str:
    f = FLAGS
    if f.download:
        return f"{f.download}: ready at {beir.download_dataset(f.download, f.to, f.url_template, f.timeout_s)}"
    dataset = beir.load_beir(f.dataset_dir, f.split, f.unknown_qrels)
    if f.json:
        return json.dumps(
            {"name": dataset.name, "split": dataset.split, **dataset.stats.as_dict()}, indent=2
        )
    return beir.format_stats(dataset)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if bool(FLAGS.download) == bool(FLAGS.dataset_dir):
        raise app.UsageError("give one of --download=NAME (with --to=DIR) or --dataset_dir=DIR")
    if FLAGS.download and not FLAGS.to:
        raise app.UsageError("--download needs --to=DIR (the folder to unpack into)")
    print(cli.call_or_exit("aligner-beir", _job))


def console_entry() -> None:
    cli.run(main, uses_gin=False)


if __name__ == "__main__":
    console_entry()
