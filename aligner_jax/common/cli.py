"""Gin plumbing shared by the binaries (t5x conventions).

Every binary accepts ``--gin_file`` (repeatable), ``--gin_bindings`` (repeatable),
``--gin_search_paths`` and the short form ``--gin.NAME=VALUE`` (rewritten into a binding, as
t5x does). The repository's ``gin/`` folder is always on the search path, so
``--gin_file=eval/zero_shot.gin`` and ``include 'models/minilm.gin'`` work from anywhere. A binary
run without ``--gin_file`` uses its default (``run_job``'s ``default_gin_files``) or says in one
line which file it needs.

Logs are quiet by default, in this one place: the project's own lines (``aligner_jax`` and its
``tasks``) at absl's ``--verbosity`` (default 0: INFO), other libraries' lines (orbax, clu, jax's
backend probing, gin's resource probing) only from WARNING up; ``--verbosity=1`` shows everything.
TensorFlow's C++ logs are off unless ``TF_CPP_MIN_LOG_LEVEL`` is exported (to another level than
jax's default, 1).
Progress (``--progress``, :mod:`aligner_jax.common.progress`) is a tqdm bar on a terminal and a log
line every 30 s otherwise.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging as std_logging
import os
import re
import signal
import sys
import tokenize
from collections.abc import Callable, Sequence
from pathlib import Path

# Before TensorFlow loads (gin imports the seqio tasks) and logs: its C++ lines (cuInit on a host
# without a GPU, oneDNN notes, at ERROR) are noise for a user. ``import jax`` sets the variable to
# "1" when unset, so "1" (or unset) means nobody chose a level; any other exported level wins.
if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import gin  # noqa: E402
from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

import aligner_jax  # noqa: E402
from aligner_jax.common import errors, fileio, progress  # noqa: E402

# Shown by --help beside the binary's own flags (absl lists the others under --helpfull).
GIN_FLAGS = ("gin_file", "gin_bindings", "gin_search_paths")
KEY_FLAGS = (*GIN_FLAGS, "verbosity", "progress")


def _gin_dir() -> Path:
    """The project's gin folder: ``aligner_jax/gin`` in an installed wheel, ``<repo>/gin`` in a
    checkout (the design card keeps it at the repository's top level)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "gin", package.parent / "gin"):
        if candidate.is_dir():
            return candidate
    return package.parent / "gin"


GIN_DIR = _gin_dir()


def define_gin_flags() -> None:
    """Defines the gin flags once (safe to call from several binaries' modules)."""
    if "gin_file" in flags.FLAGS:
        return
    flags.DEFINE_multi_string("gin_file", [], "Gin config files (searched in --gin_search_paths).")
    flags.DEFINE_multi_string("gin_bindings", [], "Individual gin bindings, e.g. 'X.y = 1'.")
    flags.DEFINE_list(
        "gin_search_paths", [], "Extra folders to search for gin files (the repo's gin/ is added)."
    )
    flags.DEFINE_enum(
        "progress",
        "auto",
        list(progress.MODES),
        "Progress of long steps on stderr: auto (a bar on a terminal, else a log line every "
        "30 s), bar, log or none.",
    )


def _project_roots() -> tuple[str, ...]:
    """Folders whose log records are the project's own: the package, its tasks (``tasks/`` in a
    checkout) and the running script's folder (``benchmarks/``)."""
    roots = [Path(__file__).resolve().parent.parent]
    spec = importlib.util.find_spec("aligner_jax.tasks")
    if spec is not None and spec.origin:
        roots.append(Path(spec.origin).resolve().parent)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and "site-packages" not in main_file:
        roots.append(Path(main_file).resolve().parent)
    return tuple(str(r) + os.sep for r in roots)


def _absl_verbosity() -> int:
    return flags.FLAGS.verbosity if flags.FLAGS.is_parsed() else 0


class QuietLibraries(std_logging.Filter):
    """Passes the project's records at any level and other libraries' from WARNING up; at
    ``--verbosity`` >= 1 everything. gin's resource probe (an ERROR "Path not found" for every
    include before gin tries the search paths) is dropped unless ``--verbosity`` >= 1."""

    def __init__(self, roots: Sequence[str], verbosity: Callable[[], int] | None = None):
        super().__init__()
        self.roots = tuple(roots)
        self.verbosity = verbosity or _absl_verbosity

    def filter(self, record: std_logging.LogRecord) -> bool:
        if self.verbosity() >= 1:
            return True
        path = os.path.realpath(record.pathname)
        if path.startswith(self.roots):
            return True
        if path.endswith(os.path.join("gin", "resource_reader.py")):
            return False
        return record.levelno >= std_logging.WARNING


def quiet_logs() -> None:
    """Installs :class:`QuietLibraries` on absl's handler (once)."""
    handler = absl_logging.get_absl_handler()
    if not any(isinstance(f, QuietLibraries) for f in handler.filters):
        handler.addFilter(QuietLibraries(_project_roots()))


def _help_and_exit(argv: Sequence[str]) -> None:
    """``--help`` (``-h``, ``--helpshort``) / ``--helpfull`` print absl's usage and exit 0 (absl's
    own help flags exit 1, which breaks ``aligner-eval --help && ...`` and scripted checks)."""
    for arg in argv[1:]:
        if arg == "--":
            return
        if arg in ("--help", "-h", "-?", "--helpshort", "--helpfull"):
            short = arg != "--helpfull"
            app.usage(shorthelp=short, writeto_stdout=True)
            if short:
                print("\nTry --helpfull to get a list of all flags.")
            sys.exit(0)


def _declare_key_flags(main: Callable, uses_gin: bool = True) -> None:
    """``--help`` lists the binary's flags and ``KEY_FLAGS``, also when it runs as a console
    script (absl lists the flags of the module named ``sys.argv[0]``)."""
    main_name = sys.argv[0]
    module = sys.modules.get(main.__module__)
    for flag in flags.FLAGS.flags_by_module_dict().get(main.__module__, []):
        flags.FLAGS.register_key_flag_for_module(main_name, flag)
    for name in KEY_FLAGS if uses_gin else set(KEY_FLAGS) - set(GIN_FLAGS):
        flags.FLAGS.register_key_flag_for_module(main_name, flags.FLAGS[name])
    entry = sys.modules.get("__main__")
    if entry is not None and not entry.__doc__ and module is not None:
        entry.__doc__ = module.__doc__  # a console script's wrapper has none


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
    """Turns ``--gin.NAME=VALUE`` into ``--gin_bindings=NAME = VALUE`` (t5x style)."""
    out = []
    for arg in argv:
        if arg.startswith("--gin.") and "=" in arg:
            name, value = arg[len("--gin.") :].split("=", 1)
            out.append(f"--gin_bindings={name} = {value}")
        elif arg.startswith("--gin."):
            raise app.UsageError(f"{arg}: expected --gin.NAME=VALUE")
        else:
            out.append(arg)
    return out


def search_paths(extra: Sequence[str] = ()) -> list[str]:
    paths = [str(p) for p in extra] + [str(GIN_DIR), os.getcwd()]
    return list(dict.fromkeys(paths))


def resolve_gin_file(name: str, paths: Sequence[str]) -> str:
    if os.path.isabs(name) and os.path.isfile(name):
        return name
    for base in paths if name else ():
        candidate = os.path.join(base, name)
        if os.path.isfile(candidate):
            return candidate
    raise errors.MissingPathError(
        f"--gin_file={name}: not found in the gin search paths {list(paths)} "
        "(add a folder with --gin_search_paths)"
    )


def parse_gin(
    gin_files: Sequence[str], bindings: Sequence[str] = (), extra_search_paths: Sequence[str] = ()
) -> None:
    """Parses gin files and bindings with the repository's gin/ folder on the search path."""
    paths = search_paths(extra_search_paths)
    for path in paths:
        gin.add_config_file_search_path(path)
    files = [resolve_gin_file(f, paths) for f in gin_files]
    try:
        gin.parse_config_files_and_bindings(files, list(bindings), finalize_config=False)
    except (
        ValueError,
        KeyError,
        NameError,
        ImportError,
        SyntaxError,
        TypeError,
        tokenize.TokenError,
    ) as e:
        unquoted = _unquoted_strings(bindings)
        if unquoted and ("Unable to parse value" in str(e) or "malformed node" in str(e)):
            name, value = unquoted[0]
            raise errors.ConfigError(
                f"gin configuration error: --gin.{name}={value}: gin reads an unquoted word as a "
                f"name, not a string; quote it: --gin.{name}=\"'{value}'\""
            ) from e
        raise errors.ConfigError(f"gin configuration error: {e}") from e
    _check_macros_used(bindings, files, paths)


def _macros_in_files(files: Sequence[str], paths: Sequence[str]) -> set[str]:
    """The macro names the gin files (and those they include) define or refer to."""
    names: set[str] = set()
    todo, seen = list(files), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        names.update(re.findall(r"%([A-Za-z_]\w*)", text))
        names.update(re.findall(r"^([A-Za-z_]\w*)\s*=", text, flags=re.M))
        for included in re.findall(r"^include\s+['\"]([^'\"]+)['\"]", text, flags=re.M):
            try:
                todo.append(resolve_gin_file(included, paths))
            except errors.UserError:
                continue
    return names


def _check_macros_used(
    bindings: Sequence[str], files: Sequence[str] = (), paths: Sequence[str] = ()
) -> None:
    """Refuses a macro binding (``--gin.NAME=VALUE``, no dot) that no gin file defines or
    refers to and no binding refers to as ``%NAME``: gin would accept a misspelt
    ``--gin.TRAIN_STEPSS=5`` and change nothing. Reads gin's parsed configuration
    (``gin.config._CONFIG``, gin's own registry) and the gin files' text."""
    names = [b.partition("=")[0].strip() for b in bindings]
    macros = [n for n in names if n.isidentifier()]
    if not macros:
        return
    used: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, gin.config.ConfigurableReference):
            scope, _, target = value.scoped_selector.rpartition("/")
            if target == "gin.macro":
                used.add(scope)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    for parameters in gin.config._CONFIG.values():
        for value in parameters.values():
            walk(value)
    known = used | _macros_in_files(files, paths)
    for name in macros:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean --gin.{close[0]}?" if close else ""
            raise errors.ConfigError(
                f"--gin.{name}: no gin file uses the macro {name} (%{name}), so this binding "
                f"would change nothing{hint}"
            )


def _unquoted_strings(bindings: Sequence[str]) -> list[tuple[str, str]]:
    """The bindings whose value is a bare word or path (``MODEL_DIR=/tmp/x``,
    ``DataConfig.task=beir_train_bm25``): strings a shell passed without gin's quotes."""
    out = []
    for binding in bindings:
        name, _, value = binding.partition("=")
        value = value.strip()
        if re.fullmatch(r"[A-Za-z_/.~][\w/.~-]*", value) and value not in (
            "True", "False", "None"
        ):  # fmt: skip
            out.append((name.strip(), value))
    return out


def run(main: Callable[[Sequence[str]], None], uses_gin: bool = True) -> None:
    """``app.run`` with the ``--gin.NAME=VALUE`` rewrite applied first, quiet library logs and
    ``--progress``. A binary without gin (``uses_gin=False``) refuses the gin flags.

    Ctrl-C before the job starts (flag parsing; during the imports ``aligner_jax``'s own
    handler) prints one line and exits 130; within the job :func:`call_or_exit` says what was
    kept."""
    if signal.getsignal(signal.SIGINT) is aligner_jax._exit_before_start:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)
    _job["started"] = False
    try:
        _run(main, uses_gin)
    except KeyboardInterrupt as stop:
        # The job's own interruption is call_or_exit's; this one came before it or after it.
        what = _AFTER_THE_JOB if _job["started"] else aligner_jax.INTERRUPTED_BEFORE_START
        _exit_interrupted(aligner_jax.program_name(), stop, what)


def _terminate(signum, frame) -> None:
    raise errors.Terminated()


def _exit_interrupted(program: str, stop: KeyboardInterrupt, what: str) -> None:
    """One line saying what was kept; exit 130 for Ctrl-C, 143 for SIGTERM (128 + signal)."""
    terminated = isinstance(stop, errors.Terminated)
    how = "terminated (SIGTERM)" if terminated else "interrupted"
    print(f"{program}: {how}: {what}", file=sys.stderr)
    sys.exit(143 if terminated else 130)


_job = {"started": False}  # whether call_or_exit ran this process's job (for Ctrl-C's line)
_AFTER_THE_JOB = "after the job finished; its outputs are complete"


def _run(main: Callable[[Sequence[str]], None], uses_gin: bool) -> None:
    define_gin_flags()
    _declare_key_flags(main, uses_gin)
    _help_and_exit(sys.argv)
    quiet_logs()
    try:
        sys.argv = rewrite_gin_args(sys.argv)
    except app.UsageError as e:  # absl's own one-line form for flag errors
        sys.exit(f"FATAL Flags parsing error: {e}")

    def main_with_progress(argv):
        if not uses_gin and any(flags.FLAGS[n].present for n in GIN_FLAGS):
            raise app.UsageError("this binary takes no gin configuration (--gin_file/--gin.X)")
        progress.set_mode(flags.FLAGS.progress)
        return main(argv)

    app.run(main_with_progress)


def call_or_exit(program: str, fn: Callable, on_interrupt: str = "", **kwargs):
    """``fn(**kwargs)`` under the one error policy of every binary.

    A user error (``errors.USER_ERRORS``: a bad input file, flag, gin binding, missing path or
    permission) exits non-zero with one line ``PROGRAM: error: ...`` and no traceback; anything
    else is a bug and keeps its traceback. Ctrl-C exits 130 with one line
    ``PROGRAM: interrupted: ON_INTERRUPT`` (what was kept).
    """
    _job["started"] = True
    try:
        try:
            return fn(**kwargs)
        except OSError as e:
            # A storage that refused a write outside fileio (orbax checkpoints, log appends,
            # np.save): the user's to fix, named in one line like fileio's own writes.
            if e.errno not in fileio.STORAGE_ERRNOS or isinstance(e, errors.UserError):
                raise
            raise fileio.storage_error(e.filename or "an output file", e.errno) from e
    except errors.USER_ERRORS as e:
        # gin appends "  In call to configurable ..." lines: context for a bug, noise for a user.
        lines = [ln for ln in str(e).splitlines() if not ln.startswith("  In call to configurable")]
        sys.exit(f"{program}: error: " + "\n".join(lines))
    except KeyboardInterrupt as stop:
        _exit_interrupted(program, stop, on_interrupt or "nothing more was written")


def refuse_empty(*names: str) -> None:
    """A string flag given empty (``--add=``) is a usage error naming it, never the flag left
    out."""
    for name in names:
        flag = flags.FLAGS[name]
        if flag.present and not str(flag.value or "").strip():
            raise app.UsageError(f"--{name}= is empty; expected: {flag.help}")


def parse_gin_flags(default_gin_files: Sequence[str] = ()) -> list[str]:
    """Parses ``--gin_file`` (or, when none is given, ``default_gin_files``) and the bindings;
    returns the gin files used."""
    f = flags.FLAGS
    files = list(f.gin_file) or list(default_gin_files)
    if files and not f.gin_file:
        absl_logging.info("no --gin_file: using the default %s", " ".join(files))
    parse_gin(files, f.gin_bindings, f.gin_search_paths)
    return files


def run_job(
    program: str,
    fn: Callable,
    on_interrupt: str = "",
    default_gin_files: Sequence[str] = (),
    needs_gin_file: str = "",
    **kwargs,
):
    """What every binary's ``main`` does after checking its flags: parse ``--gin_file`` /
    ``--gin_bindings``, then ``fn(**kwargs)``, both under :func:`call_or_exit`.

    Without ``--gin_file`` the binary runs ``default_gin_files``; a binary with no sensible
    default passes ``needs_gin_file`` (what to give), reported as a one-line error.
    """

    def job():
        if needs_gin_file and not flags.FLAGS.gin_file:
            raise errors.ConfigError(f"no --gin_file: {needs_gin_file}")
        parse_gin_flags(default_gin_files)
        return fn(**kwargs)

    return call_or_exit(program, job, on_interrupt)
