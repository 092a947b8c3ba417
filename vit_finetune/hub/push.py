"""`push`: export a run to a temporary folder and upload it to a Hugging Face Hub model repo with `HfApi`.

The token is the `token` argument, else huggingface_hub's `get_token()`: HF_TOKEN, then the cached `hf auth login`
(a Trusted Publishers OIDC exchange comes first when HF_OIDC_RESOURCE is set). It is only ever handed to
huggingface_hub, never printed, logged or written anywhere.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ..errors import VitftError
from ..run_folder import CARD_IMAGES
from .export import ADAPTER_FILES, MODEL_FILES, dtype_name, export
from .run import PathLike, check_run

log = logging.getLogger("vitft")


@dataclass(frozen=True)
class PushResult:
    """Where a push landed: the repo URL and the commit (plus the pull request, with create_pr)."""

    url: str
    commit: str
    commit_url: str = ""
    pr_url: Optional[str] = None


def resolve_token(token: Optional[str] = None) -> str:
    """The Hub token: `token`, else huggingface_hub's `get_token()` (HF_TOKEN, then the cached login); a VitftError
    when there is none.

    The trainer calls this before training when --push-to-hub is set, so a missing token fails early.
    """
    if token and token.strip():
        return token.strip()
    from huggingface_hub import get_token

    try:
        found = get_token()  # stripped, None when empty
    except Exception as err:  # noqa: BLE001 - e.g. a failed OIDC exchange: say so, without the details
        raise VitftError(f"cannot read the Hugging Face token ({type(err).__name__}); pass --token or set "
                         "HF_TOKEN") from None
    if found:
        return found
    raise VitftError("no Hugging Face token: pass --token, set HF_TOKEN, or log in once with `hf auth login` "
                     "(a token with write access, from https://huggingface.co/settings/tokens)")


def _check_repo_id(repo_id: str) -> str:
    repo_id = str(repo_id).strip().removeprefix("hf-hub:")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise VitftError(f"invalid repo id {repo_id!r}: use 'user/name' or 'org/name' "
                         f"({str(err).splitlines()[0]})") from None
    return repo_id


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception types of whichever HTTP client huggingface_hub uses."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        mod = sys.modules.get(module)
        for name in names:
            exc = getattr(getattr(mod, "exceptions", mod), name, None) if mod else None
            if isinstance(exc, type) and issubclass(exc, BaseException):
                errors.append(exc)
    return tuple(errors)


def _http_message(err: Exception, action: str, repo_id: str) -> str:
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    namespace = repo_id.split("/")[0]
    if status == 401:
        text = (f"authentication failed (401) while {action}: the Hub rejected the token; it may be invalid or "
                "expired; create a new one at https://huggingface.co/settings/tokens")
    elif status == 403:
        text = (f"permission denied (403) while {action}: the token cannot write to {namespace!r}; use a token "
                f"with write access to {repo_id}")
    elif status == 404:
        text = (f"not found (404) while {action}: {repo_id} (or the revision) does not exist, or the token "
                "cannot see it")
    elif status == 429:
        text = f"rate limited (429) by the Hub while {action}, even after retries; wait a few minutes and push again"
    elif isinstance(status, int) and status >= 500:
        text = f"the Hub failed (HTTP {status}) while {action}, even after retries; try again later"
    else:
        text = f"HTTP {status or 'error'} while {action}"
    detail = getattr(err, "server_message", None)
    if detail:
        detail = " ".join(str(detail).split())[:200]
        text += f" (server: {detail})"
    return text


@contextlib.contextmanager
def _hub_step(action: str, repo_id: str) -> Iterator[None]:
    """Turn huggingface_hub's errors during `action` into one clear VitftError."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HfHubHTTPError

    try:
        yield
    except HfHubHTTPError as err:
        raise VitftError(_http_message(err, action, repo_id)) from err
    except _transport_errors() as err:
        if type(err).__name__ == "OfflineModeIsEnabled":
            raise VitftError(f"cannot push while HF_HUB_OFFLINE is set ({action}); unset it") from err
        raise VitftError(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} while {action} "
                         f"({type(err).__name__}); check the network connection, proxy settings or HF_ENDPOINT") \
            from err
    except ValueError as err:  # huggingface_hub's own checks, e.g. invalid card metadata
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VitftError(f"{action} failed: {first}") from err


def _plain_branch(revision: Optional[str]) -> bool:
    """A branch name push may create (not main, a PR ref or a commit hash)."""
    return bool(revision) and revision != "main" and not revision.startswith("refs/") \
        and not re.fullmatch(r"[0-9a-f]{40}", revision)


def push(run_dir: PathLike, repo_id: str, token: Optional[str] = None, private: bool = False,
         revision: Optional[str] = None, create_pr: bool = False, commit_message: Optional[str] = None,
         overwrite_card: bool = False, *, dtype: str = "fp32", dataset: Optional[str] = None,
         adapter: bool = False) -> PushResult:
    """Export `run_dir` and upload it to the Hub model repo `repo_id` (created when missing).

    The repo's existing README.md is kept unless `overwrite_card`. `revision` commits to that branch
    (created from main when missing); `create_pr` opens a pull request against main instead. The
    export lives in a temporary folder that is always removed. `adapter` pushes a LoRA run's adapter alone, with
    its card (export's `adapter`).
    """
    run = check_run(run_dir)
    from ..weights.sources import weights_in

    weights_in(run.path)  # the cheap local checks first: nothing is created on the Hub for a broken run
    repo_id = _check_repo_id(repo_id)
    dtype_name(dtype)
    if create_pr and revision not in (None, "main"):
        raise VitftError("--create-pr opens a pull request against main; drop --revision (or drop --create-pr "
                         "to commit to that branch)")
    token = resolve_token(token)  # before any work: no token, no export and no request

    from huggingface_hub import HfApi

    from .. import __version__

    api = HfApi(token=token, library_name="vitft", library_version=__version__)
    message = commit_message or f"Upload {run.path.resolve().name} with vitft"
    # the Hub first (auth, permission and network problems show before the export's work) ...
    with _hub_step(f"creating the repo {repo_id}", repo_id):
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
    repo_id = getattr(repo_url, "repo_id", None) or repo_id  # a bare name lands in the token's namespace
    if _plain_branch(revision) and not create_pr:
        with _hub_step(f"creating the branch {revision} of {repo_id}", repo_id):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    keep_card = False
    if not overwrite_card:
        with _hub_step(f"checking {repo_id} for a README.md", repo_id):
            keep_card = api.file_exists(repo_id, "README.md", revision=None if create_pr else revision)
        if keep_card:
            log.info("keeping the model card (README.md) already in %s; --overwrite-card replaces it", repo_id)
    # ... then the export, in a temporary folder that is removed whatever happens
    with tempfile.TemporaryDirectory(prefix="vitft-push-") as tmp:
        folder = export(run, Path(tmp) / "export", dtype=dtype, repo_id=repo_id, dataset=dataset,
                        adapter=adapter)
        # the other kind of model's files go (an adapter push over a merged model, or back): the repo holds one
        # model; card images the new card no longer shows go too (not when the old card stays)
        stale = [n for n in (*MODEL_FILES, *ADAPTER_FILES, *([] if keep_card else CARD_IMAGES))
                 if not (folder / n).is_file()]
        with _hub_step(f"uploading to {repo_id}", repo_id):
            info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=message,
                                     revision=revision, create_pr=create_pr,
                                     ignore_patterns=["README.md"] if keep_card else None,
                                     delete_patterns=stale or None)
    return PushResult(url=str(repo_url), commit=str(info.oid), commit_url=str(info.commit_url or ""),
                      pr_url=str(info.pr_url) if getattr(info, "pr_url", None) else None)


def push_run(run_dir: PathLike, repo_id: str, **options: Any) -> PushResult:
    """`vitft finetune --push-to-hub REPO_ID`: push the finished run and log where it went."""
    result = push(run_dir, repo_id, **options)
    log.info("pushed %s to %s (commit %s)", run_dir, result.pr_url or result.url, result.commit[:12])
    return result
