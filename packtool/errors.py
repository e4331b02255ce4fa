"""Errors: what packtool raises, and the line between bad data and packtool's own bugs.

Every error a user can cause is a :class:`PacktoolError`; the CLI prints its message as one line and exits 2.
A :class:`SampleError` is about one sample only: the encoder quarantines that sample in the ledger with the
message as its reason and goes on. It is the one data error: raised on purpose where a sample's data is found
bad, and made at the few places where code that is not packtool's meets one sample's data: the user's adapter
and chat template, and the parsers of the user's bytes (JSON, images, video, audio, pickles, the tokenizer). There
:func:`user_code` (or the media layer's own ``except``) turns whatever they raise into a :class:`SampleError`
that says where it came from. Any other exception raised while one sample is processed comes from packtool's own
code: a bug, which stops the run with its traceback and the sample named (:func:`bug_in`), never a quarantined
row.

Messages are written for whoever called the library: they name the value that is wrong, not a CLI flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


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


class StoreError(PacktoolError):
    """An object store refused a request (a missing bucket, access denied, out of reach)."""


class FormatError(PacktoolError, ValueError):
    """A packed dataset does not follow the format (missing or malformed member or metadata file)."""


class EngineError(PacktoolError):
    """The execution engine cannot run tasks (e.g. a Ray cluster that cannot be reached)."""


class SampleError(PacktoolError, ValueError):
    """One sample cannot be used; the message is its ledger reason. The run goes on without it."""


class FatalSampleError(PacktoolError):
    """A sample-level failure that must stop the run (``strict`` mode); the message names the sample."""


class UserCodeExit(PacktoolError):
    """User code (an adapter) called ``sys.exit`` while it handled a sample: the run stops, naming the code."""


@contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run code that is not packtool's on one sample's data: the user's adapter or chat template, or a parser of
    the user's bytes. Whatever it raises is about that sample: a :class:`SampleError` (``"{what}: Type: message"``;
    one of its own passes as it is), even the types that in packtool's own code mean a bug (``AttributeError``,
    ``RecursionError``, ``MemoryError``, ``NotImplementedError``). ``sys.exit`` is no sample's reason: it becomes a
    :class:`UserCodeExit` naming ``what``. ``KeyboardInterrupt`` goes through."""
    try:
        yield
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(f"{what}: {type(exc).__name__}: {exc}") from exc
    except SystemExit as exc:
        raise UserCodeExit(f"{what} called sys.exit({exc.code!r})") from None


def bug_in(exc: BaseException, sample: str) -> None:
    """Add a note naming ``sample`` to ``exc``, raised by packtool's own code while that sample was processed (the
    traceback shows it; the note travels with the exception across processes)."""
    exc.add_note(f"packtool failed on sample {sample}: a bug in packtool, not in the data")


class LimitError(PacktoolError):
    """The run's samples broke a limit the user set (error, drop or truncation rate, failures in a row): the
    run stops, early where what already happened decides it (the CLI exits 3)."""


def is_data_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised while one sample was processed, is about that sample's data (quarantine it) rather
    than a bug or an interruption (let it propagate): only a :class:`SampleError` is."""
    return isinstance(exc, SampleError)


def sample_reason(exc: BaseException) -> str:
    """The ledger reason for a data error: a :class:`SampleError`'s own message, else the type and message."""
    if isinstance(exc, SampleError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
