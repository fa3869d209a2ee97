"""Gin plumbing shared by the binaries (t5x conventions).

Every binary accepts ``--gin_file`` (repeatable), ``--gin_bindings`` (repeatable),
``--gin_search_paths`` and the short form ``--gin.NAME=VALUE`` (rewritten into a binding, as
t5x does). The repository's ``gin/`` folder is always on the search path, so
``--gin_file=eval/zero_shot.gin`` and ``include 'models/minilm.gin'`` work from anywhere.
"""

from __future__ import annotations

import os
import sys
import tokenize
from collections.abc import Callable, Sequence
from pathlib import Path

import gin
from absl import app, flags

from aligner_jax.common import errors


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
        raise errors.ConfigError(f"gin configuration error: {e}") from e


def run(main: Callable[[Sequence[str]], None]) -> None:
    """``app.run`` with the ``--gin.NAME=VALUE`` rewrite applied first."""
    define_gin_flags()
    try:
        sys.argv = rewrite_gin_args(sys.argv)
    except app.UsageError as e:  # absl's own one-line form for flag errors
        sys.exit(f"FATAL Flags parsing error: {e}")
    app.run(main)


def _is_missing_gin_binding(error: BaseException) -> bool:
    """gin reports an unbound ``gin.REQUIRED`` parameter or macro as a plain RuntimeError with
    this message; it is the user's to fix (a binding), so it is turned into a ``ConfigError``."""
    return type(error).__name__ == "RuntimeError" and str(error).startswith("Required bindings")


def call_or_exit(program: str, fn: Callable, on_interrupt: str = "", **kwargs):
    """``fn(**kwargs)`` under the one error policy of every binary.

    A user error (``errors.USER_ERRORS``: a bad input file, flag, gin binding, missing path or
    permission) exits non-zero with one line ``PROGRAM: error: ...`` and no traceback; anything
    else is a bug and keeps its traceback. Ctrl-C exits 130 with one line
    ``PROGRAM: interrupted: ON_INTERRUPT`` (what was kept).
    """
    try:
        try:
            return fn(**kwargs)
        except RuntimeError as e:
            if _is_missing_gin_binding(e):
                raise errors.ConfigError(
                    f"{e} (set them with --gin.NAME=VALUE or in a gin file)"
                ) from e
            raise
    except errors.USER_ERRORS as e:
        # gin appends "  In call to configurable ..." lines: context for a bug, noise for a user.
        lines = [ln for ln in str(e).splitlines() if not ln.startswith("  In call to configurable")]
        sys.exit(f"{program}: error: " + "\n".join(lines))
    except KeyboardInterrupt:
        print(
            f"{program}: interrupted: {on_interrupt or 'nothing more was written'}", file=sys.stderr
        )
        sys.exit(130)


def parse_gin_flags() -> None:
    f = flags.FLAGS
    parse_gin(f.gin_file, f.gin_bindings, f.gin_search_paths)


def run_job(program: str, fn: Callable, on_interrupt: str = "", **kwargs):
    """What every binary's ``main`` does after checking its flags: parse ``--gin_file`` /
    ``--gin_bindings``, then ``fn(**kwargs)``, both under :func:`call_or_exit`."""

    def job():
        parse_gin_flags()
        return fn(**kwargs)

    return call_or_exit(program, job, on_interrupt)
