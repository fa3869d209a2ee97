"""Real multi-process jobs on this machine: N processes started together by
``launch/local_processes.sh`` join one JAX job (gloo CPU collectives). Training under 2 processes
equals 1 process with 2 devices, checkpoints resume across process counts, indexing under 2
processes builds the 1-process index (a killed rank stops the job and a re-run completes it),
and the launcher stops everything when one process fails."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fixtures import REPO, python_env, run_python, start_python, write_beir_fixture

from aligner_jax.training import trainer

LAUNCHER = REPO / "launch" / "local_processes.sh"
WORDS = (
    "apple river stone cloud violin tiger copper lantern meadow orbit canyon pepper falcon "
    "glacier harbor velvet quartz maple thunder saddle ember mosaic nectar prism walrus"
).split()


@pytest.fixture()
def toy(tmp_path):
    """24 documents of random words; each query repeats 3 words of its document."""
    rng = random.Random(0)
    docs, queries, qrels = {}, {}, {}
    for i in range(24):
        words = rng.sample(WORDS, 10)
        docs[f"d{i}"] = {"title": "", "text": " ".join(words)}
        queries[f"q{i}"] = " ".join(rng.sample(words, 3))
        qrels[f"q{i}"] = {f"d{i}": 1}
    return write_beir_fixture(tmp_path / "data", docs, queries, qrels, split="test")


def _train_flags(model_dir: Path, data_dir: Path, steps: int, **extra) -> list[str]:
    bindings = {
        "MODEL_DIR": repr(str(model_dir)),
        "TRAIN_STEPS": steps,
        "QUERY_LENGTH": 8,
        "DOC_LENGTH": 16,
        "WARMUP_STEPS": 2,
        "LEARNING_RATE": 3e-3,
        "BATCH_SIZE": 4,
        "DataConfig.task": "'beir_train_bm25'",
        "beir_train_source.dataset_dir": repr(str(data_dir)),
        "beir_train_source.qrels_split": "'test'",
        "train.backbone_weights": "'random'",
        "train.summary_period": 3,
        "CheckpointConfig.period": 3,
        **extra,
    }
    flags = ["--gin_file=models/bert_tiny.gin", "--gin_file=runs/train.gin"]
    return flags + [f"--gin_bindings={k} = {v}" for k, v in bindings.items()]


class Jobs:
    """Processes started together, their output in files; any still running at the end (a
    failed assertion) is stopped, so a failing test leaves no process behind."""

    def __init__(self, tmp_path: Path, cache: Path):
        self.tmp_path, self.procs, self.cache = tmp_path, [], cache

    def start(self, cmd: list[str], devices: int = 1, **env: str) -> subprocess.Popen:
        env = python_env(
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            # one persistent compilation cache for every job of the session: a program compiled
            # by one job (the same step on the same devices) is read by the next
            JAX_COMPILATION_CACHE_DIR=str(self.cache),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            **env,
        )
        log = open(self.tmp_path / f"job{len(self.procs)}.log", "w+")  # noqa: SIM115
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.log = log
        self.procs.append(proc)
        return proc

    def launch(self, num: int, *flags: str, binary: str = "train", **env: str) -> subprocess.Popen:
        """``launch/local_processes.sh NUM BINARY FLAGS``: NUM processes of one job."""
        return self.start(["bash", str(LAUNCHER), str(num), binary, *flags], **env)

    def train(self, *flags: str, devices: int) -> subprocess.Popen:
        """One ``aligner-train`` process with ``devices`` forced host devices."""
        return self.start([sys.executable, "-m", "aligner_jax.train", *flags], devices)

    @staticmethod
    def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
        proc.wait(timeout=timeout)
        proc.log.seek(0)
        out = proc.log.read()
        assert proc.returncode == 0, out[-4000:]
        return out

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()  # the launcher stops its processes on SIGTERM
                proc.wait(timeout=30)
            proc.log.close()


@pytest.fixture()
def jobs(tmp_path, tmp_path_factory):
    started = Jobs(tmp_path, tmp_path_factory.getbasetemp() / "jax_cache")
    yield started
    started.stop()


def _losses(model_dir: Path) -> dict[int, float]:
    lines = (model_dir / trainer.TRAIN_LOG).read_text().splitlines()
    return {json.loads(x)["step"]: json.loads(x)["loss"] for x in lines}


def _assert_same_losses(model_dir: Path, want: dict[int, float], steps) -> None:
    got = _losses(model_dir)
    assert sorted(got) == list(steps), (model_dir, sorted(got))
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def test_two_processes_train_like_one_process_with_two_devices_and_resume_across(
    toy, tmp_path, jobs
):
    """Same global batches, same per-step losses (1e-5 relative) for 2 processes x 1 device as
    for 1 process x 2 devices; a 2-process checkpoint resumes on 1 process and a 1-process one on
    2 processes, at the same batch, with the uninterrupted run's losses."""
    steps, half = 6, {"train.stop_after_steps": 3}
    ref, two, one = tmp_path / "ref_1x2", tmp_path / "two_then_one", tmp_path / "one_then_two"
    # Started together: the reference (1 process x 2 devices, uninterrupted, a checkpoint every
    # 3 steps) and a 2-process job stopping after its step-3 checkpoint. (1 process x 1 device
    # sums the gradients in another order: ~1e-5 apart, so the meshes are kept equal.)
    first_wave = [
        jobs.train(*_train_flags(ref, toy, steps), devices=2),
        jobs.launch(2, *_train_flags(two, toy, steps, **half)),
    ]
    outputs = [jobs.finish(job) for job in first_wave]
    assert "[0] " in outputs[1] and "[1] " in outputs[1]  # lines prefixed by rank
    assert "process 1 of 2; devices: 1 local, 2 global" in outputs[1]
    assert outputs[1].count("ALIGNER training:") == 1  # one summary: both ranks printed it
    assert "[0] ALIGNER training: steps 0..3 of 6" in outputs[1]
    want = _losses(ref)
    assert sorted(want) == list(range(1, steps + 1))
    assert len(set(want.values())) == steps  # the losses differ step to step
    _assert_same_losses(two, want, range(1, 4))
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["3"]
    # the 1-process run as it stood after step 3: its step-3 checkpoint and log, nothing later
    shutil.copytree(ref, one)
    shutil.rmtree(one / "checkpoints" / str(steps))
    log = one / trainer.TRAIN_LOG
    log.write_text("".join(x + "\n" for x in log.read_text().splitlines()[:3]))
    assert sorted(_losses(one)) == [1, 2, 3]

    second_wave = [  # the other process count, from the step-3 checkpoints
        jobs.train(*_train_flags(two, toy, steps), devices=2),
        jobs.launch(2, *_train_flags(one, toy, steps)),
    ]
    assert "resumed from step 3 (3 batches consumed)" in jobs.finish(second_wave[0])
    assert "[0] " in jobs.finish(second_wave[1])
    for model_dir in (two, one):
        _assert_same_losses(model_dir, want, range(1, steps + 1))
        assert (model_dir / "checkpoints" / str(steps)).is_dir()


def test_a_preemption_notice_saves_the_same_step_on_every_process(toy, tmp_path, jobs):
    """SIGTERM to the launcher (which passes it to both ranks): the ranks agree on one step,
    save it together and exit 143, each saying so; the same command resumes from it."""
    model_dir, steps = tmp_path / "preempted", 60
    flags = _train_flags(model_dir, toy, steps, **{"CheckpointConfig.period": 1000})
    job = jobs.launch(2, *flags, KILL_AFTER="120")
    log, deadline = model_dir / trainer.TRAIN_LOG, time.time() + 300
    while time.time() < deadline and job.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 4:
            job.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    job.wait(timeout=300)
    job.log.seek(0)
    out = job.log.read()
    assert job.returncode == 143, out[-4000:]
    saved = len(log.read_text().splitlines())
    assert 4 <= saved < steps
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == [str(saved)]
    for rank in (0, 1):
        assert f"[{rank}] " in out and f"preempted after step {saved} of {steps}" in out
    assert out.count(f"preempted after step {saved} of {steps}: saved step {saved}") == 2
    resumed = jobs.finish(jobs.launch(2, *flags))
    assert f"resumed from step {saved}" in resumed
    assert sorted(_losses(model_dir)) == list(range(1, steps + 1))


def _index_flags(data: Path, index_dir: Path, source: str = "--dataset_dir") -> list[str]:
    """aligner-index on the toy BEIR folder ``data`` (``--dataset_dir``, or ``--corpus`` its
    corpus.jsonl) with the tiny BERT: 12 shards of 2 documents."""
    return [
        "--gin_file=models/bert_tiny.gin",
        "--gin_file=index/default.gin",
        "--gin.IndexingConfig.shard_size=2",
        f"--dataset_dir={data}" if source == "--dataset_dir" else f"--corpus={data}/corpus.jsonl",
        f"--index_dir={index_dir}",
    ]


def _search_index_meta(index_dir: Path) -> dict:
    """The published search index's metadata without its timings: its settings, counts and
    every file's size and sha256."""
    manifest = json.loads((index_dir / "manifest.json").read_text())
    meta = json.loads((index_dir / manifest["search_index"]["meta"]).read_text())
    for update in meta["updates"]:
        for timing in ("time", "seconds", "kmeans_s"):
            update.pop(timing)
    return meta


def _top10(index_dirs: list[Path], queries: dict[str, str]) -> list[dict[str, list[tuple]]]:
    """Each index's top 10 (doc id, score) for each query, searched with ``Searcher.load`` and
    the model of the first index's ``encoder.json`` (queries of at most 16 tokens: the load's
    warm-up compiles one query length bucket)."""
    from aligner_jax.encoding import loading
    from aligner_jax.encoding.encoder import Encoder
    from aligner_jax.retrieval.searcher import Searcher

    spec = json.loads((index_dirs[0] / "encoder.json").read_text())
    encoder, tops = Encoder(loading.encoder_from_spec(spec), query_maxlen=16), []
    for index_dir in index_dirs:
        searcher = Searcher.load(str(index_dir), encoder=encoder)
        pages = searcher.search_batch(list(queries.values()), k=10)
        tops.append(
            {q: [tuple(hit) for hit in page] for q, page in zip(queries, pages, strict=True)}
        )
    return tops


def _shard_files(index_dir: Path, shards: list[int]) -> dict[str, str]:
    """sha256 of every file of the store shards ``shards``."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for i in shards
        for p in sorted(index_dir.glob(f"shard-{i:05d}.*"))
    }


def test_two_process_index_equals_one_process_and_a_killed_rank_resumes(toy, tmp_path, jobs):
    """aligner-index under 2 processes builds the 1-process search index bit for bit (the same
    top-10 for every query). A rank killed with SIGKILL part-way stops the job (the launcher
    exits 137, no process left), the shards committed before stay as they were, and re-running
    the same command completes the same index; re-run on a finished index, it changes nothing."""
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    pids = tmp_path / "pids"
    wrapper = tmp_path / "python"  # records each rank's pid (exec keeps it)
    wrapper.write_text(
        "#!/bin/bash\n"
        'for a in "$@"; do case $a in --process_id=*) '
        f'echo "${{a#--process_id=}} $$" >> "{pids}";; esac; done\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    started = [
        jobs.start(
            [sys.executable, "-m", "aligner_jax.index", *_index_flags(toy, one, "--corpus")]
        ),
        jobs.launch(2, *_index_flags(toy, two), binary="index"),
    ]
    victim = jobs.launch(2, *_index_flags(toy, killed), binary="index", PYTHON=str(wrapper))
    deadline = time.monotonic() + 300
    rank1_shards = [killed / f"shard-{i:05d}.json" for i in (1, 3)]  # shard i on rank i mod 2
    while not all(p.exists() for p in rank1_shards):
        assert victim.poll() is None and time.monotonic() < deadline, "rank 1 never got there"
        time.sleep(0.02)
    rank1 = next(int(pid) for r, pid in map(str.split, pids.read_text().splitlines()) if r == "1")
    os.kill(rank1, signal.SIGKILL)
    victim.wait(timeout=120)
    victim.log.seek(0)
    out = victim.log.read()
    assert victim.returncode == 137, out[-3000:]
    assert "process 1 exited with status 137: stopping the others" in out
    ranks = [int(pid) for _, pid in map(str.split, pids.read_text().splitlines())]
    time.sleep(0.5)
    assert len(ranks) == 2 and not [pid for pid in ranks if _alive(pid)]
    assert not (killed / "manifest.json").exists()  # killed while indexing
    markers = sorted(int(p.name[6:11]) for p in killed.glob("shard-?????.json"))
    committed = _shard_files(killed, markers)
    assert 2 <= len(markers) < 12
    outputs = [jobs.finish(job) for job in started]
    # the search index was built by both processes: each compressed a part, process 0 merged them
    for rank in (0, 1):
        assert re.search(
            rf"^\[{rank}\] .* process {rank} of 2 compressed 6 of 12 ", outputs[1], re.M
        )
    assert "2 parts merged into segment-00001" in outputs[1]

    rerun = jobs.launch(2, *_index_flags(toy, killed), binary="index")
    summaries = {  # each rank's last line: its JSON summary
        int(line[1]): json.loads(line[4:])
        for line in jobs.finish(rerun).splitlines()
        if line[:5] in ("[0] {", "[1] {")
    }
    for rank in (0, 1):  # each rank resumed after the shards it had committed
        done = len([i for i in markers if i % 2 == rank])
        assert summaries[rank]["shards_skipped"] == done
        assert summaries[rank]["shards_written"] == 6 - done
    assert _shard_files(killed, markers) == committed
    want = _search_index_meta(one)
    assert want["num_centroids"] > 8 and want["num_cells"] > 1  # both k-means levels split
    for index_dir in (two, killed):
        assert _search_index_meta(index_dir) == want, index_dir
        assert not list((index_dir / "search_index").glob("*part*"))  # merged, then removed
    queries = {
        q["_id"]: q["text"]
        for q in map(json.loads, (toy / "queries.jsonl").read_text().splitlines())
    }
    top10, *others = _top10([one, two, killed], queries)
    assert all(len(hits) == 10 for hits in top10.values())
    assert others == [top10, top10]

    # the same command on the finished index: nothing encoded, nothing rebuilt, nothing rewritten
    manifest = (two / "manifest.json").read_bytes()
    again = jobs.finish(jobs.launch(2, *_index_flags(toy, two), binary="index"))
    assert f"the search index of {two} is up to date" in again
    assert again.count('"shards_written": 0') == 2
    assert (two / "manifest.json").read_bytes() == manifest


# k-means split between 2 processes (assignment chunks and cells handed out in turn, results
# all-gathered) against the same fit on one process: equal bit for bit on both processes.
KMEANS_SCRIPT = """
import hashlib, json, sys
import numpy as np
from aligner_jax.common import distributed
out, coordinator, rank = sys.argv[1:4]
distributed.initialize(coordinator, 2, int(rank))
from aligner_jax.indexing import distributed_build, kmeans
kmeans.CHUNK = 64  # 16 assignment chunks of the 1,000 points
rng = np.random.default_rng(0)
sample = rng.normal(size=(1000, 8)).astype(np.float32)
sample /= np.linalg.norm(sample, axis=1, keepdims=True)
split = distributed_build.ProcessSplit()
digest = lambda *arrays: hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()
split_fit = kmeans.fit_two_level(sample, 48, 6, 4, 0, split)
one_fit = kmeans.fit_two_level(sample, 48, 6, 4, 0)
result = {
    "split": digest(*split_fit),
    "one": digest(*one_fit),
    "assign": [digest(*kmeans.assign(sample, one_fit[0], p)) for p in (split, kmeans.SERIAL)],
    "one_item": [a.tolist() for a in split.map(lambda j: np.full(2, 7, np.int32), 1, np.zeros(2, np.int32))],
}
try:
    split.map(lambda j: np.zeros(2), 2, np.zeros(2))
except TypeError as e:
    result["float64"] = str(e)
with open(f"{out}.{rank}", "w") as f:
    json.dump(result, f)
"""


def test_kmeans_split_between_processes_equals_one_process(tmp_path, jobs):
    address, out = f"127.0.0.1:{_free_port()}", tmp_path / "kmeans.json"
    procs = [
        jobs.start([sys.executable, "-c", KMEANS_SCRIPT, str(out), address, str(rank)])
        for rank in range(2)
    ]
    for proc in procs:
        jobs.finish(proc, timeout=300)
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert results[0] == results[1]
    result = results[0]
    assert result["split"] == result["one"]
    assert result["assign"][0] == result["assign"][1]
    assert result["one_item"] == [[7, 7]]
    assert "float64 does not cross processes exactly" in result["float64"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper has finished)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_launcher_stops_every_process_when_one_fails(tmp_path):
    """Rank 1 exits 1 at once; rank 0 is a real aligner-train waiting for it in
    jax.distributed.initialize: the launcher exits 1 within seconds and no process is left."""
    pids = tmp_path / "pids"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'echo $$ >> "{pids}"\n'
        # rank 1 fails once both ranks have started (so that rank 0 is there to be stopped)
        'if [[ " $* " == *" --process_id=1 "* ]]; then\n'
        f'  for i in $(seq 100); do [ "$(wc -l < "{pids}")" -ge 2 ] && break; sleep 0.1; done\n'
        '  echo "rank 1 fails" >&2; exit 1\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    wrapper.chmod(0o755)
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", str(LAUNCHER), "2", "train", "--gin_file=runs/train.gin"],
        cwd=REPO,
        env=python_env(PYTHON=str(wrapper), KILL_AFTER="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, out + err
    assert "[1] rank 1 fails" in err
    assert "process 1 exited with status 1: stopping the others" in err
    assert elapsed < 15, elapsed
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    time.sleep(0.5)
    assert not [pid for pid in started if _alive(pid)]


def test_launcher_usage_and_unknown_binary():
    proc = subprocess.run(["bash", str(LAUNCHER), "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = subprocess.run(["bash", str(LAUNCHER), "2", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no binary 'nope'" in proc.stderr
    proc = subprocess.run(["bash", str(LAUNCHER), "2", "eval"], capture_output=True, text=True)
    assert proc.returncode == 2  # its flags were refused by each process, after the start
    assert "aligner-evaluate runs as one process (it takes no --coordinator_address)" in proc.stderr


def test_incomplete_distributed_flags_are_one_line():
    proc = run_python(
        "-m", "aligner_jax.train", "--num_processes=2", "--gin_file=runs/train.gin", timeout=120
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "aligner-train: error: --coordinator_address, --process_id not set: a multi-process job "
        "named by --coordinator_address needs all three of --coordinator_address, "
        "--num_processes and --process_id (or --multiprocess alone on a TPU pod / SLURM cluster)"
    )


JOIN_SCRIPT = """
import sys
from aligner_jax.common import cli, distributed
address, num, rank = (sys.argv[1:] + [None] * 3)[:3]
cli.call_or_exit(
    "aligner-test", distributed.initialize, coordinator_address=address,
    num_processes=num and int(num), process_id=rank and int(rank), auto=not address,
    timeout_s=20,
)
"""


def test_a_job_that_cannot_be_joined_is_one_line():
    """The coordinator's port taken (JAX crashed with SIGSEGV), or --multiprocess where JAX
    detects no cluster (a 35-line ValueError traceback)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_python("-c", JOIN_SCRIPT, f"127.0.0.1:{port}", "1", "0", timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"aligner-test: error: --coordinator_address=127.0.0.1:{port}: port {port} is in use on "
        "this host (Address already in use); process 0 serves the job there: choose a free port"
    ), proc.stderr[-2000:]
    proc = run_python("-c", JOIN_SCRIPT, timeout=120)  # this machine is no cluster
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("aligner-test: error: --multiprocess: JAX found no cluster to join (")
    ), proc.stderr[-2000:]


def test_processes_given_other_counts_are_refused():
    """A rank started with --num_processes=3 in a job of 2 joined silently as 'process 1 of 2'."""
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        start_python("-c", JOIN_SCRIPT, address, num, rank, capture=True)
        for num, rank in (("2", "0"), ("3", "1"))
    ]
    (_, first), (_, second) = (p.communicate(timeout=200) for p in procs)
    assert procs[0].returncode == 0, first[-2000:]
    assert procs[1].returncode == 1
    assert second.strip().splitlines()[-1] == (
        "aligner-test: error: --num_processes=3 --process_id=1: the job's coordinator counts 2 "
        "processes and made this one 1; give every process the same --num_processes and its own "
        "--process_id"
    )


def test_updates_refuse_the_process_flags(tmp_path):
    """aligner-index --add under the launcher ran the whole update in every process, which then
    raced for the index's lock."""
    proc = run_python(
        "-m", "aligner_jax.index", f"--index_dir={tmp_path}", "--add=x.jsonl",
        "--coordinator_address=127.0.0.1:1234", "--num_processes=2", "--process_id=1",
    )  # fmt: skip
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "updates run as one process: drop --coordinator_address, --num_processes, --process_id"
        )
    ), proc.stderr[-2000:]
    proc = run_python("-m", "aligner_jax.index", f"--index_dir={tmp_path}", "--process_count=2",
                      "--compact")  # fmt: skip
    assert proc.stderr.strip().splitlines()[-1].endswith("drop --process_count")


# Sharded exhaustive search: a random token store (tombstones included) searched by
# ShardedExhaustiveSearch over every device of the job, compared with refine.score_chunk over all
# documents on one device (the project's exhaustive kernel) ranked by one stable sort.
SHARDED_SCRIPT = """
import json, sys
import numpy as np
from aligner_jax.common import distributed
store_dir, out, coordinator, num, rank = sys.argv[1:6]
if coordinator != "-":
    distributed.initialize(coordinator, int(num), int(rank))
import jax
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import sharded_search
store = ts.TokenStore(store_dir)
store.deleted[[3, 50, 77]] = True
queries = np.load(store_dir + "/queries.npz")
results = {"devices": jax.device_count(), "local": jax.local_device_count()}
for salience in (True, False):
    config = sharded_search.ShardedSearchConfig(salience=salience, block_docs=8)
    search = sharded_search.ShardedExhaustiveSearch(store, config=config)
    results[str(salience)] = search.search(queries["q"], queries["mask"], queries["u"], 10)
with open(f"{out}.{jax.process_index()}", "w") as f:  # every process has the whole answer
    json.dump(results, f)
"""


def _random_store(directory: Path):
    """203 documents of 1-39 random unit vectors (dim 16) with saliences; 5 queries."""
    from aligner_jax.indexing import token_store as ts

    rng = np.random.default_rng(0)
    writer = ts.TokenStoreWriter(directory, {"name": "random", "fingerprint": "r", "dim": 16}, 17)
    for i in range(203):
        m = int(rng.integers(1, 40))
        v = rng.normal(size=(m, 16))
        writer.add(f"doc{i}", v / np.linalg.norm(v, axis=1, keepdims=True), rng.random(m))
    store = writer.close()
    q = rng.normal(size=(5, 12, 16)).astype(np.float32)
    q /= np.linalg.norm(q, axis=2, keepdims=True)
    mask = np.arange(12)[None] < np.array([[3], [12], [7], [1], [10]])
    u = rng.random((5, 12)).astype(np.float32)
    np.savez(directory / "queries.npz", q=q, mask=mask, u=u)
    return store, q, mask, u


def _unsharded_top10(store, q, mask, u, salience: bool) -> list[list[tuple[int, float]]]:
    from aligner_jax.core import scoring
    from aligner_jax.retrieval import refine

    length = int(store.doc_lengths.max())
    vectors, d_mask, u_d, ids = store.gather_padded(np.arange(store.num_docs), length)
    if not salience:
        u, u_d = mask.astype(np.float32), d_mask.astype(np.float32)
    strategies = (scoring.AlignmentStrategy.parse("top_k:1"),)
    token_ids = np.zeros(mask.shape, np.int32)
    scores = np.array(
        refine.score_chunk(q, mask, u, token_ids, vectors, d_mask, u_d, ids, strategies)
    )[0]
    scores[:, [3, 50, 77]] = -np.inf  # the tombstones
    order = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    return [[(int(p), float(row[p])) for p in top] for top, row in zip(order, scores, strict=True)]


def _assert_same_ranking(got, want):
    for g, w in zip(got, want, strict=True):
        assert [p for p, _ in g] == [p for p, _ in w]
        np.testing.assert_allclose([s for _, s in g], [s for _, s in w], rtol=1e-6)


def test_sharded_exhaustive_search_equals_unsharded_on_8_devices_and_2_processes(tmp_path, jobs):
    store, q, mask, u = _random_store(tmp_path / "store")
    port = str(_free_port())
    runs = {
        "8 devices": [("-", "-", "-")],
        "2 processes x 2 devices": [(f"127.0.0.1:{port}", "2", str(r)) for r in range(2)],
    }
    started = {}
    for name, ranks in runs.items():  # all started together
        devices = 8 if name == "8 devices" else 2
        out = tmp_path / f"{name.replace(' ', '_')}.json"
        started[name] = (out, [
            jobs.start([sys.executable, "-c", SHARDED_SCRIPT, str(tmp_path / "store"), str(out), *r],
                       devices)
            for r in ranks
        ])  # fmt: skip
    for name, (out, procs) in started.items():
        for proc in procs:
            jobs.finish(proc, timeout=300)
        for rank in range(len(procs)):
            result = json.loads(Path(f"{out}.{rank}").read_text())
            assert result["devices"] == (8 if name == "8 devices" else 4), name
            assert result["local"] == (8 if name == "8 devices" else 2), name
            for salience in (True, False):
                want = _unsharded_top10(store, q, mask, u, salience)
                _assert_same_ranking(result[str(salience)], want)


# Searcher.load(mode="exhaustive", mesh=...) on 8 devices against the single-device exhaustive
# Searcher, on a toy index of the tiny BERT (built here: exhaustive search needs no search index).
SEARCHER_MESH_SCRIPT = """
import json, sys
import jax
from aligner_jax.common import cli, errors
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder
from aligner_jax.indexing import indexer
from aligner_jax.retrieval import sharded_search
from aligner_jax.retrieval.searcher import Searcher
corpus, index_dir, out = sys.argv[1:4]
cli.parse_gin(["models/bert_tiny.gin", "index/default.gin"], ["IndexingConfig.shard_size = 7"])
indexer.index_corpus(corpus, index_dir, search_index=False)
queries = [json.loads(line)["text"] for line in open(corpus.replace("corpus", "queries"))]
mesh = sharded_search.document_mesh()
# queries of at most 16 tokens: the load's warm-up compiles one query length bucket
encoder = Encoder(loading.load_encoder(), query_maxlen=16)
result = {"devices": mesh.devices.size}
for salience in (True, False):
    one = Searcher.load(index_dir, mode="exhaustive", salience=salience, encoder=encoder)
    sharded = Searcher.load(index_dir, mode="exhaustive", mesh=mesh, salience=salience,
                            encoder=encoder)
    assert one.sharded is None and sharded.sharded.mesh is mesh
    result[str(salience)] = [
        [[list(map(tuple, page)) for page in s.search_batch(queries, k=k)] for s in (one, sharded)]
        for k in (10, 30)
    ]
refused = []
for kwargs in ({"mesh": mesh}, {"mesh": mesh, "mode": "exhaustive", "alignment": "top_k:2"},
               {"mesh": "all", "mode": "exhaustive"}):
    try:
        Searcher.load(index_dir, **kwargs)
    except errors.ConfigError as e:
        refused.append(str(e))
result["refused"] = refused
with open(out, "w") as f:
    json.dump(result, f)
"""


def test_searcher_mesh_option_equals_single_device_exhaustive_search(toy, tmp_path, jobs):
    """``Searcher.load(..., mode="exhaustive", mesh=document_mesh())`` over 8 devices ranks
    every query's documents as the single-device exhaustive Searcher does (top 10 and all 24
    documents, with and without saliences); a mesh with another mode or alignment is refused."""
    out = tmp_path / "mesh.json"
    script = [SEARCHER_MESH_SCRIPT, str(toy / "corpus.jsonl"), str(tmp_path / "index"), str(out)]
    jobs.finish(jobs.start([sys.executable, "-c", *script], devices=8), timeout=300)
    result = json.loads(out.read_text())
    assert result["devices"] == 8
    for salience in ("True", "False"):
        for one, sharded in result[salience]:
            for want, got in zip(one, sharded, strict=True):
                assert [doc for doc, _ in got] == [doc for doc, _ in want]
                np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-5)
        assert [len(page) for page in result[salience][1][0]] == [24] * 24  # k=30: every doc
    assert result["refused"] == [
        "Searcher.load: mesh= shards the exhaustive search; use mode='exhaustive' (got "
        "mode='fast')",
        "Searcher.load: mesh= scores with top-1 alignment; use alignment='top_k:1' (got 'top_k:2')",
        "Searcher.load: mesh must be a jax.sharding.Mesh (e.g. sharded_search.document_mesh()), "
        "got str",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("127.0.0.1:1234", 2, 2), r"^--process_id=2: must be in 0\.\.1 \(--num_processes=2\)$"),
        (("127.0.0.1:1234", 0, 0), r"^--num_processes=0: must be >= 1$"),
        (("localhost", 2, 0), r"^--coordinator_address=localhost: expected HOST:PORT"),
        (("h:99999", 2, 0), r"^--coordinator_address=h:99999: expected HOST:PORT"),
        ((None, 2, None), r"^--coordinator_address, --process_id not set"),
    ],
)
def test_distributed_settings_are_checked_before_joining(args, message):
    from aligner_jax.common import distributed, errors

    with pytest.raises(errors.ConfigError, match=message):
        distributed.initialize(*args)
    assert distributed.initialize() is False  # no setting: one process, nothing done
