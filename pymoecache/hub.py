"""GGUF models from the Hugging Face Hub (``pymoecache run --hf-repo REPO --hf-file FILE``).

Files go to the usual Hugging Face cache (``$HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``),
so a model is downloaded once and found there afterwards, also offline (``HF_HUB_OFFLINE=1``).
``huggingface_hub`` is imported only when needed: ``pip install "huggingface-hub>=0.23"``.

>>> path = download("OWNER/SOME-MOE-GGUF", "some-moe-q4_k_m.gguf")  # doctest: +SKIP
>>> download("OWNER/SOME-MOE-GGUF", "config.json")
Traceback (most recent call last):
...
pymoecache.hub.HubError: config.json is not a GGUF file (the name must end in .gguf)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .errors import Error

PIP_HUB = 'pip install "huggingface-hub>=0.23"'


class HubError(Error, RuntimeError):
    """A model could not be found or downloaded; the one-line message says why and what to do."""


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # submodules are attributes of the package only once imported
        import huggingface_hub.utils
    except ImportError:
        raise HubError(f"downloading models from the Hugging Face Hub needs huggingface_hub: {PIP_HUB}") from None
    return huggingface_hub


def _check_name(filename: str) -> None:
    if not filename.lower().endswith(".gguf"):
        raise HubError(f"{filename} is not a GGUF file (the name must end in .gguf)")


def _offline(hub) -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE), as the library itself sees it."""
    is_offline = getattr(hub.constants, "is_offline_mode", None)  # newer versions; older ones: the constant
    return bool(is_offline() if is_offline else hub.constants.HF_HUB_OFFLINE)


def _reachable(hub) -> bool:
    """One quick request to the hub's endpoint (through the library's own session, so proxies and
    HF_ENDPOINT apply). Saves the library's retries with back-off (about 25 s) when there is no network."""
    try:
        hub.utils.get_session().head(hub.constants.ENDPOINT, timeout=10)
        return True
    except Exception:  # any failure to get an answer: connection refused, DNS, timeout, proxy error
        return False


def _unreachable(hub, repo_id: str, filename: str, cache_dir) -> HubError:
    why = ("HF_HUB_OFFLINE is set" if _offline(hub)
           else f"no connection to {hub.constants.ENDPOINT}")
    cache = cache_dir or hub.constants.HF_HUB_CACHE
    return HubError(f"could not reach the Hugging Face Hub ({why}) and {repo_id}/{filename} is not in the "
                    f"local cache {cache}: download the file elsewhere and pass its path as MODEL")


def resolve(repo_id: str, filename: str, *, cache_dir: "Optional[os.PathLike[str] | str]" = None) -> Optional[Path]:
    """The local path of ``filename`` from ``repo_id`` if it is already in the Hugging Face cache
    (its ``main`` revision), else None. Never touches the network.

    >>> resolve("x/not-downloaded", "model.gguf", cache_dir="/nonexistent")
    """
    _check_name(filename)
    hub = _hub()
    try:
        p = hub.try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
    except ValueError as e:  # HFValidationError: a malformed repository id or file name
        raise HubError(f"invalid repository {repo_id!r} or file {filename!r}: {str(e).splitlines()[0]}") from None
    return Path(p) if isinstance(p, str) else None  # None: not cached; a sentinel: cached as missing


def download(repo_id: str, filename: str, *, cache_dir: "Optional[os.PathLike[str] | str]" = None,
             progress: bool = True) -> Path:
    """Path of ``filename`` from Hugging Face repository ``repo_id``, downloaded into the cache if
    needed (with huggingface_hub's progress bar unless ``progress=False``). Raises :class:`HubError`
    with a one-line message when it cannot.
    """
    _check_name(filename)
    hub = _hub()
    if not _offline(hub) and resolve(repo_id, filename, cache_dir=cache_dir) is None and not _reachable(hub):
        raise _unreachable(hub, repo_id, filename, cache_dir)
    try:
        from huggingface_hub import errors
    except ImportError:  # before 0.23 the exception classes lived in .utils
        from huggingface_hub import utils as errors
    bars_were_off = hub.utils.are_progress_bars_disabled()
    if not progress:
        hub.utils.disable_progress_bars()
    try:
        return Path(hub.hf_hub_download(repo_id, filename, cache_dir=cache_dir))
    except errors.LocalEntryNotFoundError:  # neither the hub nor the cache has it
        raise _unreachable(hub, repo_id, filename, cache_dir) from None
    except errors.GatedRepoError:
        raise HubError(f"{repo_id} is a gated repository: accept its terms on the Hugging Face Hub "
                       "and set HF_TOKEN (or log in with the hf CLI)") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"repository {repo_id} not found on the Hugging Face Hub (if it is private, "
                       "set HF_TOKEN or log in with the hf CLI)") from None
    except errors.EntryNotFoundError:
        raise HubError(f"{filename} not found in repository {repo_id} (the file list is at "
                       f"{hub.constants.ENDPOINT}/{repo_id}/tree/main)") from None
    except errors.HfHubHTTPError as e:
        raise HubError(f"the Hugging Face Hub refused {repo_id}/{filename}: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # HFValidationError
        raise HubError(f"invalid repository {repo_id!r} or file {filename!r}: {str(e).splitlines()[0]}") from None
    except OSError as e:  # disk full, cache not writable, connection lost mid-download
        raise HubError(f"could not download {repo_id}/{filename}: {e}") from None
    finally:
        if not progress and not bars_were_off:
            hub.utils.enable_progress_bars()
