"""Every error type of aligner_jax, and the one rule that tells a user error from a bug.

A *user error* is one the user fixes by changing an input file, a flag, a gin binding or a path;
its message names that file, line, flag or binding and says how to fix it. Every binary prints
it as one line ``PROGRAM: error: ...`` and exits non-zero (``cli.call_or_exit``). Anything else
(a ``ValueError`` from a shape check, a ``KeyError`` in our code) is a bug and keeps its
traceback.

The subclasses also derive from the builtin type a caller would expect (``ValueError`` for a bad
value, ``FileNotFoundError`` for a missing path), so ``except ValueError`` keeps working.
This module imports nothing: every stage of the package may raise these.
"""

from __future__ import annotations


class UserError(Exception):
    """Base class: an error the user fixes (input, flag, binding, path), reported in one line."""


class ConfigError(UserError, ValueError):
    """A flag, gin binding or argument out of its valid range; the message names it."""


class MissingPathError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or is not what it should be)."""


class BeirFormatError(UserError, ValueError):
    """A BEIR file is missing or malformed; the message names the file, the line and the fix."""


class RunFileError(UserError, ValueError):
    """A TREC run file (``aligner-eval --rerank_run``) is malformed or names unknown documents."""


class BeirDownloadError(UserError, RuntimeError):
    """The official BEIR archive could not be downloaded or unpacked."""


class CheckpointError(UserError, ValueError):
    """A checkpoint (aligner-train, T5X, safetensors) that does not fit the configured model."""


class T5XCheckpointError(CheckpointError):
    """A T5X checkpoint that cannot be imported into the configured encoder."""


class IndexIntegrityError(UserError, RuntimeError):
    """An index directory does not match its manifest (or the model asking to use it)."""


class SnapshotGoneError(IndexIntegrityError):
    """A file of the index generation a reader opened was removed by a later commit (a vacuum
    replaces the store's shards): the reader must load the index again."""


class LockedError(UserError, RuntimeError):
    """Another process holds the lock of a folder this job writes (e.g. an index directory)."""


class OutputWriteError(UserError, OSError):
    """An output file could not be written: disk full, quota, read-only filesystem."""


class NonFiniteLossError(UserError, FloatingPointError):
    """Training produced a NaN/inf loss (lower the learning rate, check the data)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cluster's or a service manager's stop) inside a binary: handled as Ctrl-C is
    (what was written is kept, temporary files removed), exit status 143."""


# OS errors about a path the user gave (their message names the path): one line, too.
PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)

#: What ``cli.call_or_exit`` reports in one line; everything else keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, *PATH_ERRORS)
