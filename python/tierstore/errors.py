"""Errors raised by tierstore.

Every error is a :class:`TierstoreError` and also the builtin exception that
fits, so existing ``except FileNotFoundError`` or ``except ValueError`` code keeps
working. Each carries ``path`` (the file) and ``record`` (the record inside it,
when one is concerned), and its message names both::

    TierstoreError
    ├── NotFoundError            (FileNotFoundError)  missing file or directory
    ├── DirectoryError           (IsADirectoryError)  a directory where a file is expected
    ├── PermissionDeniedError    (PermissionError)    read-only directory, no access
    ├── NoSpaceError             (OSError)            disk full during a save
    ├── StorageIOError           (OSError)            any other I/O failure
    ├── ResourceLimitError       (MemoryError)        a load would need more memory than there is
    ├── LayoutError              (ValueError)         a layout that describes no valid placement
    ├── InvalidArgumentError     (ValueError)         an argument value tierstore cannot take
    ├── InvalidArgumentTypeError (TypeError)          an argument of a type tierstore cannot take
    ├── UsageError               (RuntimeError)       a call refused here, where torch raises RuntimeError
    ├── TornSnapshotError        (RuntimeError)       a tensor changed before its capture finished
    ├── WaitTimeoutError         (TimeoutError)       a wait with a timeout ran out
    ├── InternalError            (AssertionError)     a broken invariant inside tierstore (a bug)
    ├── DeviceError              (RuntimeError)       a GPU runtime call or the GPU shim's build failed
    ├── FormatError              (ValueError)         the file's contents are wrong
    │   ├── NotAContainerError                        not a zip archive at all
    │   ├── TruncatedFileError                        cut short
    │   ├── CorruptFileError                          inconsistent structure
    │   │   └── ManifestError                         a bad tierstore manifest or checkpoint metadata
    │   ├── UnsafePathError                           a name leading outside the checkpoint, or
    │   │                                             to something other than a regular file
    │   ├── CoverageError                             saved pieces that do not cover a target exactly
    │   ├── MissingRecordError                        a record the file needs is absent
    │   └── ChecksumError                             bytes differ from their checksum
    ├── UnsafeObjectError        (pickle.UnpicklingError)  refused by weights_only=True
    │   └── UnsafeTorchScriptError  (RuntimeError)      a TorchScript archive, as torch refuses it
    ├── UnsupportedObjectError   (RuntimeError)       an object torch cannot save either (ZeroTensor)
    ├── NotAFileError            (TypeError, AttributeError)  neither a path nor a file object
    └── NotSeekableError         (io.UnsupportedOperation)    a stream load cannot seek in
"""

from __future__ import annotations

import errno as _errno
import io as _io
import pickle

__all__ = [
    "ChecksumError",
    "CompressedFileError",
    "CorruptFileError",
    "CoverageError",
    "DeviceError",
    "DirectoryError",
    "FormatError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "LayoutError",
    "ManifestError",
    "MissingKeyError",
    "MissingRecordError",
    "NoSpaceError",
    "NotAContainerError",
    "NotAFileError",
    "NotFoundError",
    "NotSeekableError",
    "PermissionDeniedError",
    "ReferencedCheckpointError",
    "ResourceLimitError",
    "StorageIOError",
    "TierstoreError",
    "TorchLoadError",
    "TornSnapshotError",
    "TruncatedFileError",
    "UnsafeObjectError",
    "UnsafePathError",
    "UnsafeTorchScriptError",
    "UnsupportedObjectError",
    "UsageError",
    "WaitTimeoutError",
]


class TierstoreError(Exception):
    """Base class of every tierstore error."""

    path: str | None = None
    record: str | None = None

    def _locate(self, path: str | None, record: str | None) -> None:
        self.path = path
        self.record = record


class _OSBaseError(TierstoreError, OSError):
    def __init__(
        self, message: str, *, path: str | None = None, record: str | None = None, errno: int | None = None
    ) -> None:
        if errno is not None:
            OSError.__init__(self, errno, message)
        else:
            OSError.__init__(self, message)
        self._locate(path, record)
        # OSError.filename feeds the standard "[Errno N] msg: 'file'" form;
        # our message already names the file, so leave it unset.

    def __str__(self) -> str:
        return str(self.strerror if self.strerror is not None else self.args[0])


class NotFoundError(_OSBaseError, FileNotFoundError):
    """A file or directory does not exist."""


class DirectoryError(_OSBaseError, IsADirectoryError):
    """A directory was given where a file is expected."""


class PermissionDeniedError(_OSBaseError, PermissionError):
    """The file or directory cannot be written or read (e.g. read-only)."""


class NoSpaceError(_OSBaseError):
    """The disk filled up during a save; the previous file is untouched."""


class StorageIOError(_OSBaseError):
    """Any other operating-system I/O failure."""


class _ValueBaseError(TierstoreError, ValueError):
    def __init__(self, message: str, *, path: str | None = None, record: str | None = None) -> None:
        ValueError.__init__(self, message)
        self._locate(path, record)


class FormatError(_ValueBaseError):
    """The file's contents are not what a tierstore or torch file holds."""


class NotAContainerError(FormatError):
    """The file is not a zip archive (nor a legacy torch file)."""


class TruncatedFileError(FormatError):
    """The file ends before the data its directory describes."""


class CorruptFileError(FormatError):
    """A structure inside the file is inconsistent."""


class TorchLoadError(CorruptFileError, RuntimeError):
    """``torch.load`` raised a ``RuntimeError`` on a file tierstore handed to
    it (legacy or TorchScript formats are torch's alone): a ``RuntimeError``
    as torch's own, so code that catches torch's error still does, with the
    file named in the message."""


class ManifestError(CorruptFileError):
    """The tierstore manifest is malformed or disagrees with the archive."""


class MissingRecordError(FormatError):
    """A record the file needs is absent."""


class MissingKeyError(TierstoreError, KeyError):
    """A name a checkpoint's table does not hold (a ``KeyError``, as a
    mapping raises)."""


class CompressedFileError(FormatError):
    """A tierstore-compressed file was opened by a reader that cannot decode
    it (``torch.load``): load it with ``tierstore.load`` or convert it with
    ``tierstore convert --plain``."""


class ChecksumError(FormatError):
    """A record's bytes do not match its stored checksum."""


class UnsafePathError(FormatError):
    """A file names a path outside its checkpoint (absolute, ``..``, a
    symlink leading out) or something other than a regular file."""


class CoverageError(FormatError):
    """The saved pieces do not cover a target tensor exactly once (a hole,
    an overlap, or a tensor the checkpoint lacks)."""


class LayoutError(_ValueBaseError):
    """A layout that does not describe a valid placement."""


class InvalidArgumentError(_ValueBaseError):
    """An argument with a value tierstore cannot take (a size it cannot
    read, an unknown policy name, a tier list without a disk): a
    ``ValueError`` too, as a builtin would raise."""


class InvalidArgumentTypeError(TierstoreError, TypeError):
    """An argument of a type tierstore cannot take: a ``TypeError`` too."""


class WaitTimeoutError(TierstoreError, TimeoutError):
    """A wait with a ``timeout`` (``CheckpointHandle.wait``) ran out: a
    ``TimeoutError`` too."""


class InternalError(TierstoreError, AssertionError):
    """A broken invariant inside tierstore (an internal state move its
    transition table forbids, a call on an object that cannot serve it): a bug
    in tierstore, never caused by the user's data; please report it."""


class DeviceError(TierstoreError, RuntimeError):
    """A GPU runtime call failed, or the GPU shim could not be built or
    loaded where it was asked for; the message carries the runtime's own."""


class UsageError(TierstoreError, RuntimeError):
    """A call tierstore refuses in this situation, where torch raises a
    ``RuntimeError`` (``weights_only=True`` with an explicit
    ``pickle_module``; two tensors viewing one storage as different types)."""


class ReferencedCheckpointError(UsageError):
    """Deleting a checkpoint that kept deltas still reference (their
    keyframe); ``dependents`` names them. Delete the dependents first."""

    def __init__(self, message: str, *, path: str | None = None, dependents: list[str] | None = None) -> None:
        RuntimeError.__init__(self, message)
        self._locate(path, None)
        self.dependents = list(dependents or [])


class ResourceLimitError(TierstoreError, MemoryError):
    """Loading would allocate more memory than is available (the sizes a
    file states are refused before anything is allocated)."""

    def __init__(self, message: str, *, path: str | None = None, record: str | None = None) -> None:
        MemoryError.__init__(self, message)
        self._locate(path, record)


class UnsafeObjectError(TierstoreError, pickle.UnpicklingError):
    """``weights_only=True`` refused an object outside the allow-list."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        pickle.UnpicklingError.__init__(self, message)
        self._locate(path, None)


class UnsafeTorchScriptError(UnsafeObjectError, RuntimeError):
    """``weights_only=True`` refused a TorchScript archive: torch raises a
    ``RuntimeError`` there, so this is both."""


class TornSnapshotError(TierstoreError, RuntimeError):
    """A tensor was modified before its capture finished (the Checkpointer's
    ``debug=True`` check)."""


class NotAFileError(TierstoreError, TypeError, AttributeError):
    """``f`` is neither a path nor a file object with what the call needs
    (``write``; ``read``, ``seek`` and ``tell``): an ``AttributeError`` as
    torch raises for the missing method, and a ``TypeError``."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        TypeError.__init__(self, message)
        self._locate(path, None)


class NotSeekableError(TierstoreError, _io.UnsupportedOperation):
    """A stream whose ``seek`` or ``tell`` is unsupported (a pipe, a socket):
    ``io.UnsupportedOperation``, as ``torch.load`` raises."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        _io.UnsupportedOperation.__init__(self, message)
        self._locate(path, None)


class UnsupportedObjectError(TierstoreError, RuntimeError):
    """An object that cannot be saved (as with torch: a ``ZeroTensor``)."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        RuntimeError.__init__(self, message)
        self._locate(path, None)


_OS_ERRORS: dict[int, type[_OSBaseError]] = {
    _errno.ENOENT: NotFoundError,
    _errno.ENOTDIR: NotFoundError,
    _errno.EISDIR: DirectoryError,
    _errno.EACCES: PermissionDeniedError,
    _errno.EPERM: PermissionDeniedError,
    _errno.EROFS: PermissionDeniedError,
    _errno.ENOSPC: NoSpaceError,
    _errno.EDQUOT: NoSpaceError,
}

_FORMAT_ERRORS: dict[str, type[FormatError]] = {
    "not_a_container": NotAContainerError,
    "truncated": TruncatedFileError,
    "corrupt": CorruptFileError,
    "checksum": ChecksumError,
    "missing_record": MissingRecordError,
    "not_regular": UnsafePathError,
}


def _from_engine(kind: str, message: str, path: str | None, record: str | None, errno: int | None) -> BaseException:
    """Builds the exception for an engine error (called by ``tierstore._core``)."""
    if kind == "io":
        cls = _OS_ERRORS.get(errno or 0, StorageIOError)
        return cls(message, path=path, record=record, errno=errno)
    if kind == "cancelled":
        return KeyboardInterrupt(message)
    fcls = _FORMAT_ERRORS.get(kind)
    if fcls is not None:
        return fcls(message, path=path, record=record)
    err = TierstoreError(message)
    err._locate(path, record)
    return err


def os_error(exc: OSError, path: str, action: str) -> TierstoreError:
    """Wraps an ``OSError`` raised by Python code into the hierarchy."""
    cls = _OS_ERRORS.get(exc.errno or 0, StorageIOError)
    return cls(f"{path}: {action}: {exc.strerror or exc}", path=path, errno=exc.errno)
