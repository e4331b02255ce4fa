"""Errors: what packtool raises, and the line between bad data and packtool's own bugs.

Every error a user can cause is a :class:`PacktoolError`; the CLI prints its message as one line and exits 2.
A :class:`SampleError` is about one sample only: the encoder quarantines that sample in the ledger with the
message as its reason and goes on. Any other exception raised while one sample is processed is a data error too
(a library choking on odd bytes: PIL, the tokenizer, JSON), *except* the :data:`BUG_EXCEPTIONS`, which mean
packtool's own code is wrong and must stop the run instead of hiding as a quarantined row.

Messages are written for whoever called the library: they name the value that is wrong, not a CLI flag.
"""

from __future__ import annotations


class PacktoolError(Exception):
    """Base of every error a user can cause; its message is one line, fit to print as it is. ``option`` names
    the setting that would resolve it (the CLI shows it as its flag)."""

    def __init__(self, message: str = "", *, option: str | None = None):
        super().__init__(message)
        self.option = option

    def __reduce__(self):  # keep ``option`` across processes (pool and Ray workers pickle errors)
        return (_rebuild, (type(self), str(self), self.option))


def _rebuild(cls: type[PacktoolError], message: str, option: str | None) -> PacktoolError:
    return cls(message, option=option)


class ConfigError(PacktoolError, ValueError):
    """A setting, or the model folder, cannot work (checked before any work starts)."""


class SourceError(PacktoolError, ValueError):
    """The source dataset as a whole (or one of its shards) cannot be read."""


class OutputError(PacktoolError):
    """OUTPUT cannot be written as asked: settings differ, another run holds it, it overlaps SOURCE, I/O failed."""


class FormatError(PacktoolError, ValueError):
    """A packed dataset does not follow the format (missing or malformed member or metadata file)."""


class EngineError(PacktoolError):
    """The execution engine cannot run tasks (e.g. a Ray cluster that cannot be reached)."""


class SampleError(PacktoolError, ValueError):
    """One sample cannot be used; the message is its ledger reason. The run goes on without it."""


class FatalSampleError(PacktoolError):
    """A sample-level failure that must stop the run (``strict`` mode); the message names the sample."""


class LimitError(PacktoolError):
    """The run's samples broke a limit the user set (error, drop or truncation rate, failures in a row): the
    run stops, early where what already happened decides it (the CLI exits 3)."""


#: Exceptions that are never a property of the data: raised while a sample is processed, they stop the run.
BUG_EXCEPTIONS: tuple[type[BaseException], ...] = (
    NameError,  # includes UnboundLocalError
    AttributeError,
    ImportError,
    SyntaxError,
    AssertionError,
    NotImplementedError,
    SystemError,
    ReferenceError,
    MemoryError,
    RecursionError,
    StopIteration,
    FatalSampleError,
)


def is_data_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised while one sample was processed, is about that sample's data (quarantine it) rather
    than a bug or an interruption (let it propagate)."""
    return isinstance(exc, Exception) and not isinstance(exc, BUG_EXCEPTIONS)


def sample_reason(exc: BaseException) -> str:
    """The ledger reason for a data error: a :class:`SampleError`'s own message, else the type and message."""
    if isinstance(exc, SampleError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
