"""The package's exceptions: everything pymoecache raises on bad input derives from :class:`Error`.

    Error
    ├── ConfigError          a routing or cache parameter is out of range or cannot be parsed
    ├── ModelFileError       the model file is missing, not a GGUF file, damaged or impossible
    │   ├── ModelNotFoundError   (also a FileNotFoundError)
    │   ├── ModelLoadError       llama.cpp refused the file; the message carries its reason
    │   └── (lowbit.CompanionError)  a low-bit companion missing, damaged or for another model
    ├── MissingDependencyError  an optional extra (server, hub, plot) is not installed
    ├── MoECacheError        the native cache refused a call
    │   ├── StateFileError       a cache state or calibration file is unreadable, damaged or for another model
    │   ├── MoECacheIOError      an expert could not be read, or the model file changed during a run
    │   ├── ConcurrentUseError   one Llama used from two threads at once
    │   ├── ClosedError          a Llama used after close()
    │   └── DeviceLostError      an RPC server holding the model's layers went away
    ├── EvalError            an evaluation cannot run as asked (text, context, sweep spec)
    └── (hub.HubError)

The CLI prints any of them as one line and exits with code 2. This module imports nothing else
of the package, so it never needs the native library.

>>> issubclass(ModelNotFoundError, FileNotFoundError) and issubclass(ConfigError, Error)
True
"""

from __future__ import annotations


class Error(Exception):
    """Base of every error pymoecache raises on bad input (files, parameters, state, I/O)."""


class ConfigError(Error, ValueError):
    """A routing or cache parameter is out of range or cannot be parsed."""


class GrammarError(ConfigError):
    """A GBNF grammar llama.cpp cannot parse or sample from (pymoecache.grammar.check_grammar)."""


class ModelFileError(Error, ValueError):
    """The file is missing, not a GGUF file, truncated or otherwise unusable."""


class ModelNotFoundError(ModelFileError, FileNotFoundError):
    """The model path does not exist."""


class ModelLoadError(ModelFileError):
    """llama.cpp could not load a file that passed the header check; the message ends with
    llama.cpp's own last log lines (kept even when ``verbose=False``)."""


class MissingDependencyError(Error, ImportError):
    """An optional dependency is not installed; the message says what to pip install."""


class EvalError(Error, ValueError):
    """An evaluation cannot run as asked (missing text, context too small, bad sweep spec, ...)."""


class MoECacheError(Error, RuntimeError):
    """The native moecache refused a call; the message says why."""


class StateFileError(MoECacheError, ValueError):
    """A cache state or prior calibration file cannot be read or written, is damaged, or belongs
    to another model. Nothing was loaded."""


class MoECacheIOError(MoECacheError):
    """An expert could not be read from the model file (truncated, unreadable), or the file was
    changed or replaced since it was loaded. The decode's output was discarded."""


class ConcurrentUseError(MoECacheError):
    """A ``Llama`` was used from a second thread while a first one was decoding with it."""


class ClosedError(MoECacheError):
    """A ``Llama`` was used after :meth:`~pymoecache.Llama.close` (or the end of its ``with`` block)."""


class DeviceLostError(MoECacheError):
    """A device the model's layers were on is gone (an RPC server that stopped). That ``Llama`` is
    closed for good; the process and other models go on."""
