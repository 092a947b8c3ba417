"""Files from the Hugging Face Hub through its cache, with one fast check that the Hub (or any HTTP endpoint) can be
reached."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from ..errors import VitftError

log = logging.getLogger("vitft")

# seconds allowed for an endpoint's name lookup (the Hub's, an MLflow server's), then for its TCP connect: an
# unreachable endpoint is found out within their sum
HUB_LOOKUP_TIMEOUT = 3.0
HUB_CONNECT_TIMEOUT = 3.0
# how a caller names local weights instead, in Python's terms and the command line's (this layer cannot tell which)
LOCAL_WEIGHTS = ("pretrained=PATH in Python, --pretrained PATH on the command line, or the PATH as the model to "
                 "evaluate, predict or explain")


def endpoint_unreachable(url: str) -> Optional[str]:
    """Why the server at `url` cannot be reached (its host does not resolve, or refuses connections), else None.

    One name lookup and one TCP connect with a short timeout: HTTP clients (huggingface_hub's, MLflow's) would
    otherwise retry an unreachable host several times, silently or logging every retry, before giving up.
    """
    import socket
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as LookupTimeout
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    pool = ThreadPoolExecutor(max_workers=1)  # getaddrinfo has no timeout of its own
    try:
        addresses = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM).result(HUB_LOOKUP_TIMEOUT)
    except LookupTimeout:
        return f"looking up {host} timed out"
    except OSError as err:
        return f"{host} cannot be resolved ({err.strerror or err})"
    finally:
        pool.shutdown(wait=False)
    family, kind, proto, _, address = addresses[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(HUB_CONNECT_TIMEOUT)
            sock.connect(address)
    except OSError as err:
        return f"{host}:{port} does not answer ({err.strerror or type(err).__name__})"
    return None


def hub_unreachable() -> Optional[str]:
    """Why the Hub endpoint (HF_ENDPOINT) cannot be reached, else None."""
    from huggingface_hub import constants

    return endpoint_unreachable(constants.ENDPOINT)


def hub_download(repo_id: str, filenames: tuple[str, ...], revision: Optional[str] = None) -> Path:
    """The first of `filenames` that the repo has, through the HF cache (honours HF_HOME, HF_HUB_OFFLINE...).

    An unreachable Hub is found out once, up front: then only the cache is looked at, and the error names
    the ways out.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    unreachable = None if offline else hub_unreachable()
    if not offline:
        log.info("fetching %s (%s) from %s%s", repo_id, " or ".join(filenames), constants.ENDPOINT,
                 f": unreachable ({unreachable}), looking in the local cache only" if unreachable else "")
    missing, not_cached = [], None
    for filename in filenames:
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision,
                                        local_files_only=bool(unreachable)))
        except LocalEntryNotFoundError as err:  # a subclass of EntryNotFoundError: test it first
            not_cached = not_cached or err  # the next filename may still be in the cache
            missing.append(filename)
            unreachable = unreachable or "the request failed"  # the other files: from the cache only, no retries
        except EntryNotFoundError:
            missing.append(filename)
        except RepositoryNotFoundError as err:
            raise VitftError(f"Hub repo {repo_id!r} not found (or private: set HF_TOKEN)") from err
    if not_cached is not None:
        why = ("HF_HUB_OFFLINE is set" if offline
               else f"the Hub at {constants.ENDPOINT} cannot be reached ({unreachable})")
        raise VitftError(
            f"{repo_id}/{' or '.join(missing)} is not in the local HF cache and {why}; download it once with "
            f"network access, give a local weights file or model folder in its place ({LOCAL_WEIGHTS})"
            + ("" if offline else ", or set HF_HUB_OFFLINE=1 to use the local cache only")) from not_cached
    raise VitftError(f"Hub repo {repo_id!r} has none of {', '.join(missing)}")
