"""llama.cpp's log as pymoecache handles it: one callback for the whole process, installed when this
module is imported (by pymoecache.llama, and by pymoecache.lowbit, which quantizes without a Llama).

It keeps llama.cpp's warnings and errors for our messages (pymoecache._logtail), sends our C++'s
lines ("moecache: ...") to the "pymoecache" logger, passes each line to the LISTENERS, and prints
llama.cpp's log only where llama-cpp-python's logger is at DEBUG (verbose=True).
"""

from __future__ import annotations

import ctypes
import logging
import sys

from . import _moecache_cpp  # noqa: F401  (first: our libllama, before llama_cpp loads one)
import llama_cpp  # noqa: E402
from llama_cpp import _logger as LLAMA_CPP_LOGGER  # noqa: E402
from ._logtail import LINES  # noqa: E402

LISTENERS: list = []  # callables (level, text) that see every line (pymoecache.lowbit: its progress bar)

# --- llama.cpp's log, kept even when verbose=False -------------------------------------------------
# llama-cpp-python silences llama.cpp while a model loads with verbose=False, so its reason for
# refusing a file would be lost. Every line also goes to llama-cpp-python's own callback (which
# prints or not, as before); warnings and errors stay in a small ring buffer for our messages.
# Lines of our C++ ("moecache: ...") go to the "pymoecache" logger instead.
log = logging.getLogger("pymoecache")  # the library's warnings (mlock refused, ...): no handler of ours,
                                        # so they reach stderr through logging's last resort unless configured
_LOG_LEVEL_WARN, _LOG_LEVEL_CONT = 3, 5   # enum ggml_log_level (ggml.h)
_log_last_level = 0


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data) -> None:
    global _log_last_level
    if sys.is_finalizing():  # a model freed at interpreter exit: logging and imports are gone by now
        return
    for listen in LISTENERS:
        listen(level, text)
    effective = level if level != _LOG_LEVEL_CONT else _log_last_level
    if level != _LOG_LEVEL_CONT:
        _log_last_level = level
    line = text.decode("utf-8", "replace").strip() if effective >= _LOG_LEVEL_WARN and text else ""
    if line.startswith("moecache: "):  # our own warnings: Python's logging, whatever llama.cpp's verbosity
        log.warning("%s", line[len("moecache: "):].removeprefix("warning: "))
        return
    if line:
        LINES.append(line)
    # verbose=True: llama.cpp's whole log, as stock. verbose=False: nothing (llama-cpp-python's own
    # callback maps an older ggml enum and printed every warning, "n_ctx_seq > n_ctx_train" among them);
    # warnings and errors stay in the log tail, and a failed load's reason is in its exception
    if LLAMA_CPP_LOGGER.logger.level <= logging.DEBUG:
        _llama_cpp_log(level, text, user_data)


_llama_cpp_log = LLAMA_CPP_LOGGER.llama_log_callback  # bound now: no import inside a callback
llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
