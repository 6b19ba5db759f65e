"""GGUF models from the Hugging Face Hub (``pymoecache run -hf OWNER/REPO[:QUANT]`` or
``--hf-repo REPO --hf-file FILE``).

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
    what = f"{repo_id}/{filename} is not" if filename else f"no file of {repo_id} is"
    return HubError(f"could not reach the Hugging Face Hub ({why}) and {what} in the "
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


DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's choice when -hf names no quantization


def split_repo(spec: str):
    """``OWNER/REPO[:QUANT]`` (llama.cpp's -hf) as (repo, quant or None).

    >>> split_repo("ggml-org/Some-MoE-GGUF:q8_0")
    ('ggml-org/Some-MoE-GGUF', 'Q8_0')
    >>> split_repo("ggml-org/Some-MoE-GGUF")
    ('ggml-org/Some-MoE-GGUF', None)
    >>> split_repo("https://huggingface.co/ggml-org/Some-MoE-GGUF")   # a repository's address, as copied
    ('ggml-org/Some-MoE-GGUF', None)
    >>> split_repo("https")
    Traceback (most recent call last):
    ...
    pymoecache.hub.HubError: -hf 'https': expected OWNER/REPO[:QUANT], e.g. ggml-org/Some-MoE-GGUF:Q4_K_M
    """
    import re

    s = str(spec).strip()
    url = re.match(r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/(.*)$", s, re.IGNORECASE)
    if url:  # https://huggingface.co/OWNER/REPO[/tree/main...]
        parts = url.group(1).split("/")
        s = "/".join(parts[:2]) if len(parts) >= 2 else url.group(1)
    repo, _, quant = s.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo) or "://" in s:
        raise HubError(f"-hf {spec!r}: expected OWNER/REPO[:QUANT], e.g. ggml-org/Some-MoE-GGUF:Q4_K_M")
    return repo, (quant.upper() or None)


def pick_gguf(files, quant: Optional[str] = None) -> Optional[str]:
    """The file llama.cpp's -hf would take from a repository's file list: the GGUF whose name carries
    ``quant`` (case-insensitive, default Q4_K_M), else the first GGUF; the first part of a split
    model; never a multimodal projector (mmproj). None when the list has no GGUF.

    >>> pick_gguf(["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-f16.gguf"])
    'm-Q4_K_M.gguf'
    >>> pick_gguf(["m-Q8_0-00002-of-00002.gguf", "m-Q8_0-00001-of-00002.gguf"], "q8_0")
    'm-Q8_0-00001-of-00002.gguf'
    """
    import re

    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower().rsplit("/", 1)[-1])
    part = [re.search(r"-(\d+)-of-\d+\.gguf$", f, re.IGNORECASE) for f in ggufs]
    ggufs = [f for f, m in zip(ggufs, part) if m is None or int(m.group(1)) == 1]  # not a later part of a split
    if not ggufs:
        return None
    want = (quant or DEFAULT_QUANT).upper()
    for f in ggufs:
        name = f.rsplit("/", 1)[-1].upper()
        if re.search(rf"(^|[-._]){re.escape(want)}([-._]|$)", name):
            return f
    if quant is not None:  # asked for by name: no silent substitute
        return None
    return ggufs[0]


def _cached_files(hub, repo_id: str, cache_dir) -> list:
    """The files of ``repo_id``'s main revision in the local cache (offline listing)."""
    root = Path(cache_dir or hub.constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    try:
        commit = (root / "refs" / "main").read_text().strip()
    except OSError:
        return []
    snap = root / "snapshots" / commit
    return sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file() or p.is_symlink())


def repo_files(repo_id: str, *, cache_dir: "Optional[os.PathLike[str] | str]" = None) -> list:
    """The file names in a Hugging Face repository: from the hub, or from the local cache when
    offline or unreachable. HubError when neither knows the repository."""
    hub = _hub()
    if _offline(hub) or not _reachable(hub):
        files = _cached_files(hub, repo_id, cache_dir)
        if not files:
            raise _unreachable(hub, repo_id, "", cache_dir)
        return files
    try:
        return list(hub.list_repo_files(repo_id))
    except Exception as e:  # not found, gated, refused: the hub's message, one line
        name = type(e).__name__
        if "RepositoryNotFound" in name:
            raise HubError(f"repository {repo_id} not found on the Hugging Face Hub (if it is private, "
                           "set HF_TOKEN or log in with the hf CLI)") from None
        raise HubError(f"could not list the files of {repo_id}: {str(e).splitlines()[0] if str(e) else name}") from None


def download_spec(spec: str, filename: Optional[str] = None, *,
                  cache_dir: "Optional[os.PathLike[str] | str]" = None, progress: bool = True) -> Path:
    """llama.cpp's ``-hf OWNER/REPO[:QUANT]`` (and ``-hff FILE``, which overrides the quant): the
    GGUF chosen by :func:`pick_gguf` from the repository's files, downloaded once."""
    repo, quant = split_repo(spec)
    if filename is None:
        files = repo_files(repo, cache_dir=cache_dir)
        filename = pick_gguf(files, quant)
        if filename is None:
            ggufs = [f for f in files if f.lower().endswith(".gguf")]
            raise HubError(f"{repo} has no GGUF file" + (f" for quantization {quant}" if quant else "")
                           + (f" (it has: {', '.join(ggufs[:8])}{', ...' if len(ggufs) > 8 else ''})" if ggufs else ""))
    return download(repo, filename, cache_dir=cache_dir, progress=progress)
