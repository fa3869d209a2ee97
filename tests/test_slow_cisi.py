"""Full-CISI check (``make test-slow``): metrics.json is what pytrec_eval makes of run.trec.

In CISI every query id is also a document id, and 7 of those documents are judged relevant to
the query of the same id (queries 23, 27, 34, 46, 69, 71, 109): BEIR's identical-id rule would
drop them from metrics (not from run.trec). Indexing CISI's 1,460 documents takes about a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import gin
import pytest
from fixtures import trec_eval_run_file

from aligner_jax.common import cli
from aligner_jax.evaluation import beir_eval

CISI = Path(__file__).resolve().parents[2] / "shared" / "data" / "beir" / "cisi"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CISI.is_dir(), reason=f"{CISI} is not available"),
]


def test_cisi_metrics_json_equals_pytrec_eval_on_run_file(tmp_path):
    gin.clear_config()
    cli.parse_gin(["eval/zero_shot.gin", "eval/exhaustive.gin"])
    out = tmp_path / "out"
    beir_eval.evaluate(dataset_dir=str(CISI), output_dir=str(out))
    saved = json.loads((out / "metrics.json").read_text())
    ids = saved["identical_ids"]
    assert ids["mode"] == "same_text" and ids["dropped"] == 0
    assert ids["query_ids_in_corpus"] == 76 and ids["kept_judged_relevant"] == 7
    rows = {tuple(r.split()[:3]) for r in (out / "run.trec").read_text().splitlines()}
    assert {(q, "Q0", q) for q in ("23", "27", "34", "46", "69", "71", "109")} <= rows
    assert saved["metrics_all"] == trec_eval_run_file(out / "run.trec", CISI / "qrels" / "test.tsv")
