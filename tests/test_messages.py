"""Every message is true (issue 24 item 5) and every binary names a concept the same way (issue 25
item 8).

Each string of ``aligner_jax/`` (error messages, log lines, help texts, docstrings) that suggests a
flag (``--name``, ``--noname``, ``--gin.Configurable.param``) or a command (``aligner-xxx``) is
checked against the flags the binaries really define: a flag after ``aligner-X`` in the same
string must be one of X's, a flag in a binary's own module one of that binary's, any other one of
some binary's; a ``--gin.`` binding must name a registered configurable and one of its
parameters. The command lines README.md and WORKSPACE.md show are checked the same way. The flags
are read from absl's registry after importing each binary module (in one subprocess: two binaries
define some of the same flags).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_binaries import SCRIPTS

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "aligner_jax"

# The flags a binary accepts: its own and its declared key flags (cli's gin / progress flags,
# common/distributed's), plus every flag of a library outside aligner_jax (absl's --verbosity,
# jax's --jax_*): those are accepted by every binary.
_DUMP_FLAGS = r"""
import importlib, inspect, json, pkgutil, sys
import gin
from absl import flags
import aligner_jax
from aligner_jax.common import cli

cli.define_gin_flags()
F = flags.FLAGS
binaries = json.loads(sys.argv[1])
out = {"binaries": {}, "flags": {}, "gin": {}}


def library_flags(mod):  # flags of the aligner_jax modules it imports (common.distributed)
    names = set()
    for name, value in vars(mod).items():
        module = getattr(value, "__name__", "") if inspect.ismodule(value) else ""
        if module.startswith("aligner_jax.") and module not in binaries.values():
            names |= {f.name for f in F.flags_by_module_dict().get(module, [])}
    return names


for script, module in binaries.items():
    mod = importlib.import_module(module)
    keys = {f.name for f in F.get_key_flags_for_module(mod)} | set(cli.KEY_FLAGS)
    keys |= library_flags(mod)
    own = list(F.flags_by_module_dict().get(module, []))
    out["binaries"][script] = sorted(keys)
    out["flags"][script] = {f.name: type(f.parser).__name__ for f in own}
    for f in own:  # the next binary may define a flag of the same name
        delattr(F, f.name)
shared = set()
for module, defined in F.flags_by_module_dict().items():
    if not module.startswith("aligner_jax"):
        shared |= {f.name for f in defined}
out["shared"] = sorted(shared)
for info in pkgutil.walk_packages(aligner_jax.__path__, "aligner_jax."):
    if info.name in binaries.values():
        continue
    try:
        importlib.import_module(info.name)
    except ImportError:  # an optional dependency (qdrant, playwright...) that is not installed
        pass
for selector, configurable in gin.config._REGISTRY.items():
    try:
        params = list(inspect.signature(configurable.wrapped).parameters)
    except (TypeError, ValueError):
        params = []
    out["gin"][configurable.name] = params
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def registry():
    """``{"binaries": {script: [flags]}, "flags": {script: {own flag: parser}}, "shared":
    [flags], "gin": {configurable: [parameters]}}``."""
    binaries = {
        script: module
        for script, (module, _) in SCRIPTS.items()
        if (REPO / (module.replace(".", "/") + ".py")).is_file()
    }
    proc = subprocess.run(
        [sys.executable, "-c", _DUMP_FLAGS, json.dumps(binaries)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The messages.

FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*)((?:\.[A-Za-z_]\w*)*)(?![\w-])")
COMMAND = re.compile(r"(?<![\w-])aligner-([a-z]+)(?![\w-])")
MODULE = re.compile(r"(?<=python -m )aligner_jax\.\w+")
# Flags of other programs quoted in our texts (pip, tensorboard, XLA, docker...).
FOREIGN = {"logdir", "xla_force_host_platform_device_count"}


@dataclasses.dataclass(frozen=True)
class Mention:
    where: str  # file:line
    text: str  # the whole string
    flag: str  # without "--" (and without "no" for a negated boolean: see ``names``)
    gin: str  # ".Configurable.param" after --gin, else ""
    binary: str  # the aligner-X named before it, or the module's own binary, or ""
    module_binary: str  # the binary whose module holds the string, or ""


def _strings(tree: ast.AST):
    """Every string literal (f-strings whole, ``{}`` for their fields), with its line."""
    parts_of_fstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts_of_fstrings |= {id(v) for v in node.values}
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            yield node.lineno, "".join(parts)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in parts_of_fstrings:
                yield node.lineno, node.value


def _script_of_module(name: str) -> str:
    for script, (module, _) in SCRIPTS.items():
        if module == name:
            return script
    return ""


def _logical_lines(text: str) -> list[str]:
    """The lines of a string, a shell line continued with a backslash joined to the next."""
    return text.replace("\\\n", " ").split("\n")


def mentions() -> tuple[list[Mention], list[tuple[str, str]]]:
    """Every flag mention and every ``aligner-X`` command mention in ``aligner_jax/``. A flag
    belongs to the command named before it on the same line (``aligner-X`` or ``python -m
    aligner_jax.X``), else to the binary whose module holds the string, else to none."""
    flags_found, commands = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = _script_of_module("aligner_jax." + path.stem) if path.parent == PACKAGE else ""
        for line, text in _strings(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{line}"
            commands += [(where, f"aligner-{m.group(1)}") for m in COMMAND.finditer(text)]
            for piece in _logical_lines(text):
                named = [(m.start(), f"aligner-{m.group(1)}") for m in COMMAND.finditer(piece)]
                named += [
                    (m.start(), _script_of_module(m.group(0)) or m.group(0))
                    for m in MODULE.finditer(piece)
                ]
                for m in FLAG.finditer(piece):
                    before = sorted((start, n) for start, n in named if start < m.start())
                    binary = before[-1][1] if before else own
                    flags_found.append(Mention(where, text, m.group(1), m.group(2), binary, own))
    return flags_found, commands


MENTIONS, COMMANDS = mentions()


def test_the_scan_finds_the_messages_it_checks():
    """The scan itself: known suggestions are found, attributed to their binary."""
    found = {(m.flag, m.binary) for m in MENTIONS}
    assert ("search_index", "aligner-index") in found  # the repair of a search index
    assert ("output", "aligner-search") in found
    assert ("gin", "") in found or any(m.flag == "gin" for m in MENTIONS)
    assert len(MENTIONS) > 200


def test_every_suggested_command_exists():
    wrong = sorted({f"{where}: {name}" for where, name in COMMANDS if name not in SCRIPTS})
    assert not wrong, "messages name commands that do not exist:\n" + "\n".join(wrong)


def _accepted(registry, binary: str) -> set[str]:
    return set(registry["binaries"][binary]) | set(registry["shared"])


def _is_known(flag: str, accepted: set[str], registry) -> bool:
    if flag in accepted or flag in FOREIGN or flag in ("gin", "help", "helpfull", "helpshort"):
        return True
    # --noNAME negates the boolean flag NAME
    booleans = {
        name
        for own in registry["flags"].values()
        for name, parser in own.items()
        if parser == "BooleanParser"
    }
    return flag.startswith("no") and flag[2:] in accepted and flag[2:] in booleans


def false_flags(mentions: list[Mention], registry) -> list[str]:
    """The mentions of a flag its binary (or, without one, every binary) does not define."""
    everywhere = set().union(*(_accepted(registry, b) for b in registry["binaries"]))
    wrong = []
    for m in mentions:
        if m.gin:
            continue  # test_every_suggested_gin_binding_exists
        if m.binary and m.binary not in registry["binaries"]:
            continue  # test_every_suggested_command_exists
        accepted = _accepted(registry, m.binary) if m.binary else everywhere
        if m.module_binary:  # a binary's help text: its own flags, also after other commands
            accepted = accepted | _accepted(registry, m.module_binary)
        if not _is_known(m.flag, accepted, registry):
            wrong.append(f"{m.where}: --{m.flag} ({m.binary or 'any binary'}): {m.text[:120]!r}")
    return sorted(wrong)


def test_the_check_catches_the_false_suggestions_of_issue_24(registry):
    """The messages issue 24 found false, as they were: each is caught."""
    texts = [
        "rebuild it with aligner-index --search_index --rebuild_search_index",  # no such flag
        "aligner-search --multiprocess",  # another binary's flag
        "python -m aligner_jax.search --corpus=X",
        "re-run with --no_such_flag",
    ]
    found = [
        Mention("x.py:1", text, m.group(1), m.group(2), binary, "")
        for text in texts
        for m in FLAG.finditer(text)
        for binary in [
            "aligner-index"
            if "aligner-index" in text
            else "aligner-search"
            if "search" in text
            else ""
        ]
    ]
    wrong = false_flags(found, registry)
    assert {w.split(": ")[1] for w in wrong} == {
        "--rebuild_search_index (aligner-index)",
        "--multiprocess (aligner-search)",
        "--corpus (aligner-search)",
        "--no_such_flag (any binary)",
    }
    ok = [Mention("x.py:1", "t", "nosearch_index", "", "aligner-index", "")]
    assert false_flags(ok, registry) == []


def test_every_suggested_flag_exists_for_its_binary(registry):
    wrong = false_flags(MENTIONS, registry)
    assert not wrong, "messages suggest flags that do not exist:\n" + "\n".join(wrong)


DOCS = ("README.md", "WORKSPACE.md", "Makefile", "launch/local_cpu.sh", "launch/tpu_pod.sh")
COMMAND_LINE = re.compile(r"^\s*(?:\S*python -m aligner_jax\.\w+|aligner-[a-z]+)\b")


def doc_commands() -> list[Mention]:
    """The flags of the command lines the documentation shows (``python -m aligner_jax.X ...``
    or ``aligner-X ...`` at the start of a line, backslash continuations joined)."""
    found = []
    for doc in DOCS:
        path = REPO / doc
        if not path.is_file():
            continue
        for piece in _logical_lines(path.read_text()):
            start = COMMAND_LINE.match(piece)
            if not start:
                continue
            command = COMMAND.search(start.group(0)) or MODULE.search(start.group(0))
            name = command.group(0)
            binary = name if name.startswith("aligner-") else _script_of_module(name)
            for m in FLAG.finditer(piece):
                found.append(Mention(doc, piece, m.group(1), m.group(2), binary, ""))
    return found


def test_every_documented_command_line_uses_flags_that_exist(registry):
    mentions = doc_commands()
    assert len(mentions) > 50  # README and WORKSPACE show dozens of command lines
    wrong = false_flags(mentions, registry)
    assert not wrong, "documented commands use flags that do not exist:\n" + "\n".join(wrong)


def test_every_suggested_gin_binding_exists(registry):
    """``--gin.Name.param=...`` (in messages and documented command lines): ``Name`` is a
    registered configurable and ``param`` one of its parameters (or a macro, ``--gin.MODEL_DIR``)."""
    wrong = []
    for m in MENTIONS + doc_commands():
        if m.flag != "gin" or not m.gin:
            continue
        parts = m.gin.lstrip(".").split(".")
        if len(parts) == 1:  # a macro (--gin.TRAIN_STEPS=...) or the NAME of a usage text
            continue
        name, param = parts[-2], parts[-1]
        if name == "NAME" or name not in registry["gin"]:
            if name != "NAME":
                wrong.append(f"{m.where}: --gin{m.gin}: no configurable {name!r}")
            continue
        params = registry["gin"][name]
        if params and param not in params:
            wrong.append(f"{m.where}: --gin{m.gin}: {name} has no parameter {param!r}")
    assert not wrong, "messages suggest gin bindings that do not exist:\n" + "\n".join(wrong)


# ---------------------------------------------------------------------------------------------
# One name per concept (issue 25 item 8).

# concept → the one flag name every binary uses, and the synonyms no binary may define.
CONCEPTS = {
    "index_dir": ("index", "index_path", "store", "store_dir", "index_folder", "idx"),
    "k": ("top_k", "topk", "num_results", "n_results", "num_hits", "hits", "limit"),
    "output": ("out", "output_file", "out_file", "run_file", "output_path", "outfile"),
    "queries": ("queries_file", "query_file", "queries_path", "query_set"),
    "dataset_dir": ("dataset", "data_dir", "beir_dir", "data", "dataset_path", "stats"),
    "output_dir": ("out_dir", "outdir", "output_folder", "output_path"),
}


def test_no_binary_defines_a_synonym_of_a_concept_flag(registry):
    wrong = []
    for script, own in registry["flags"].items():
        for canonical, synonyms in CONCEPTS.items():
            for name in set(own) & set(synonyms):
                wrong.append(f"{script} --{name}: call it --{canonical}, as the other binaries")
    assert not wrong, "\n".join(sorted(wrong))


def test_a_concept_flag_has_one_type_everywhere(registry):
    """``--k`` is an integer in every binary that has it, ``--index_dir`` a string..."""
    types: dict[str, dict[str, str]] = {}
    for script, own in registry["flags"].items():
        for canonical in CONCEPTS:
            if canonical in own:
                types.setdefault(canonical, {})[script] = own[canonical]
    mixed = {c: t for c, t in types.items() if len(set(t.values())) > 1}
    assert not mixed, mixed
    assert {"aligner-search", "aligner-publish"} <= set(types["k"])  # the test sees them
