"""Hub weights in: a pretrained cfg's Hub repo as local files, with one-line errors.

`hub_weights` turns a tag's `hf_hub_id` (or an `hf-hub:` name) into local weights, downloaded and cached
by huggingface_hub as usual: one file, or a sharded repo's index with every shard beside it. What can go
wrong on the way (a gated repo, a missing file, a cut download, no network, offline with nothing cached)
is one `HubError` line naming the fix. A cut download is resumed by huggingface_hub's own retries (HTTP
Range requests); its partial `.incomplete` file is removed when they fail and is never returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from timm.models._pretrained import PretrainedCfg

from .checkpoints.errors import CheckpointError, reason
from .checkpoints.formats import WEIGHTS_FILE
from .checkpoints.reader import read_index

__all__ = ["OFFICIAL_SUFFIX", "HubError", "HubWeights", "fetch_hub_weights", "hub_weights", "unreachable_reason"]

# A repo's weights, in the order tried when the cfg names no file: one file, else a sharded index.
WEIGHT_FILES = (WEIGHTS_FILE, f"{WEIGHTS_FILE}.index.json")
# Tags of Meta's official (gated) transformers repos: `<weights>_facebook` beside timm's ungated `<weights>`.
OFFICIAL_SUFFIX = "_facebook"


class HubError(CheckpointError):
    """Hub weights that cannot be had; the message names the problem and the fix in one line.

    `unreachable` says why the Hub could not be asked (see `unreachable_reason`) when that is the problem
    and nothing was cached; it is None when the Hub answered (gated, missing, HTTP errors).
    """

    def __init__(self, message: str, unreachable: str | None = None) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class HubWeights:
    """Local weights of a Hub repo and where they came from."""

    path: Path  # a weights file, or a sharded repo's index with its shards beside it
    origin: str  # `Hub org/name[@revision]`, plus ` from the local cache (why)` when the Hub was not asked


def unreachable_reason(exc: BaseException | None) -> str | None:
    """Why the Hub could not be asked, when it could not: `HF_HUB_OFFLINE is set`, or the connection error
    in `exc`'s chain (`ENDPOINT: Error: message`). None when the Hub answered (any HTTP status) or `exc` is
    no connection error."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    chain = []
    while exc is not None and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    network = (LocalEntryNotFoundError, ConnectionError, TimeoutError)
    if any(isinstance(e, HfHubHTTPError) for e in chain) or not any(
        isinstance(e, network) or any(c.__name__ == "TransportError" for c in type(e).__mro__) for e in chain
    ):
        return None
    return f"{constants.ENDPOINT}: {type(chain[-1]).__name__}: {reason(chain[-1])}"


def _hub_source(source: str | Mapping[str, Any] | PretrainedCfg) -> tuple[str, str | None, str | None]:
    """(repo id, revision, file or None)."""
    if isinstance(source, str):
        cfg: Mapping[str, Any] = {"hf_hub_id": source.removeprefix("hf-hub:")}
    else:
        cfg = source.to_dict() if isinstance(source, PretrainedCfg) else source
    hub_id = cfg.get("hf_hub_id")
    if not hub_id:
        raise HubError(f"{cfg.get('architecture') or 'this pretrained cfg'} names no Hub repo (hf_hub_id)")
    repo_id, _, revision = hub_id.partition("@")
    return repo_id, revision or None, cfg.get("hf_hub_filename")


def _download(repo_id: str, filename: str, revision: str | None, cache_dir: str | Path | None) -> Path:
    return Path(huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir))


def _cached(
    repo_id: str, filenames: tuple[str, ...], revision: str | None, cache_dir: str | Path | None
) -> Path | None:
    for filename in filenames:
        found = huggingface_hub.try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
        if isinstance(found, str):
            return Path(found)
    return None


def _no_download(repo_id: str, filename: str, revision: str | None, ungated: str, exc: BaseException) -> HubError:
    """The one line for an error of `hf_hub_download` that no other file of the repo can cure."""
    page = f"{constants.ENDPOINT}/{repo_id}"
    if isinstance(exc, GatedRepoError):
        status = exc.response.status_code if exc.response is not None else "401/403"
        same = f"; or use {ungated}, which holds the same weights ungated" if ungated else ""
        return HubError(
            f"{repo_id} is a gated repository this machine has no access to (HTTP {status}): accept its licence on "
            f"{page} while logged in, then log in here with `hf auth login` or set HF_TOKEN{same}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            f"{repo_id} is not a repository on {constants.ENDPOINT} (or a private one): check the name; a private "
            f"repository needs `hf auth login` or HF_TOKEN"
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{repo_id} has no revision {revision!r}: check the @revision in its name")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "error"
        return HubError(f"the Hub answered HTTP {status} for {repo_id} ({reason(exc)}); try again later")
    return HubError(
        f"the download of {filename} from {repo_id} was cut short ({type(exc).__name__}: {reason(exc)}), also on "
        f"huggingface_hub's resumed retries; the partial file was removed, not loaded: try again"
    )


def _from_cache(
    repo_id: str, filenames: tuple[str, ...], revision: str | None, cache_dir: str | Path | None, exc: BaseException
) -> Path:
    path = _cached(repo_id, filenames, revision, cache_dir)
    if path is None:
        raise _not_cached(repo_id, filenames, exc, cache_dir) from None
    return path


def _cache_origin(exc: BaseException) -> str:
    """Why cached weights were taken without asking the Hub."""
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return f"the Hub answered HTTP {exc.response.status_code}"
    return f"the Hub is not reachable: {unreachable_reason(exc) or reason(exc)}"


def _not_cached(
    repo_id: str, filenames: tuple[str, ...], exc: BaseException, cache_dir: str | Path | None = None
) -> HubError:
    cache = cache_dir or constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set"
        fix = "download them once with the Hub reachable (HF_HUB_OFFLINE unset)"
    elif isinstance(exc, HfHubHTTPError):
        why = f"the Hub ({constants.ENDPOINT}) answered HTTP {exc.response.status_code}"
        fix = "try again later"
    else:
        cause = exc.__cause__ or exc
        why = f"the Hub ({constants.ENDPOINT}) is not reachable: {type(cause).__name__}: {reason(cause)}"
        fix = "check the connection, or download them once where the Hub is reachable"
    return HubError(
        f"{why}, and the weights of {repo_id} ({' or '.join(filenames)}) are not in the local cache {cache}; {fix}, "
        f"or pass pretrained_cfg_overlay=dict(file=PATH)",
        unreachable=None if isinstance(exc, HfHubHTTPError) else unreachable_reason(exc) or reason(exc),
    )


def hub_weights(
    source: str | Mapping[str, Any] | PretrainedCfg, *, cache_dir: str | Path | None = None, ungated: str = ""
) -> Path:
    """The local path of the weights that `source` names on the Hub: `fetch_hub_weights(...).path`."""
    return fetch_hub_weights(source, cache_dir=cache_dir, ungated=ungated).path


def fetch_hub_weights(
    source: str | Mapping[str, Any] | PretrainedCfg, *, cache_dir: str | Path | None = None, ungated: str = ""
) -> HubWeights:
    """The local path of the weights that `source` names on the Hub, downloading what the cache lacks.

    `source` is a pretrained cfg (a mapping or timm's `PretrainedCfg`, as a tag or an `hf-hub:` name gives
    it) with `hf_hub_id` (`org/name`, optionally `@revision`) and optionally `hf_hub_filename`, or a repo id
    (`org/name[@revision]`, `hf-hub:` prefix allowed). Without a file name the repo's `model.safetensors`
    is taken, else its `model.safetensors.index.json`.

    Returns the path and where it came from: a weights file, or for a sharded repo its index, with every
    shard downloaded beside it (`checkpoints.open_checkpoint` reads either). Files come from huggingface_hub's
    cache when there (offline too, `HF_HUB_OFFLINE=1`), else are downloaded into it; `cache_dir` overrides the
    cache folder.

    Raises `HubError` (a `CheckpointError`) with one line: a gated repo without access (how to get it, and
    `ungated`, the name of an ungated copy of the same weights, when the caller knows one), a missing repo,
    revision or file, a download cut short, or no Hub and nothing cached.
    """
    repo_id, revision, filename = _hub_source(source)
    candidates = (filename,) if filename else WEIGHT_FILES
    origin = f"Hub {repo_id}" + (f"@{revision}" if revision else "")
    path = None
    for name in candidates:
        try:  # one quick look first (none offline): huggingface_hub's download retries a lost Hub for ~25 s
            huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo_id, name, revision=revision))
        except EntryNotFoundError:  # this file is not in the repo: try the next name
            continue
        except HfHubHTTPError as exc:
            if exc.response is None or exc.response.status_code < 500:
                raise _no_download(repo_id, name, revision, ungated, exc) from exc
            path = _from_cache(repo_id, candidates, revision, cache_dir, exc)
            origin += f" from the local cache ({_cache_origin(exc)})"
            break
        except Exception as exc:  # offline or no Hub: what the cache has, under whichever name
            path = _from_cache(repo_id, candidates, revision, cache_dir, exc)
            origin += f" from the local cache ({_cache_origin(exc)})"
            break
        try:
            path = _download(repo_id, name, revision, cache_dir)
        except Exception as exc:
            raise _no_download(repo_id, name, revision, ungated, exc) from exc
        break
    if path is None:
        raise HubError(
            f"{repo_id} has no {' or '.join(candidates)} (HTTP 404): see its files on {constants.ENDPOINT}/{repo_id}; "
            f"a tag or pretrained_cfg_overlay can name another file with hf_hub_filename"
        )
    if path.name.endswith(".index.json"):
        _download_shards(repo_id, path, cache_dir, ungated)
    return HubWeights(path, origin)


def _download_shards(repo_id: str, index: Path, cache_dir: str | Path | None, ungated: str) -> None:
    """Every shard of a cached index, from the same revision (the index's snapshot folder)."""
    shards = sorted(set(read_index(index).values()))
    revision = index.parent.name
    for shard in shards:
        try:
            _download(repo_id, shard, revision, cache_dir)
        except LocalEntryNotFoundError as exc:
            raise _not_cached(repo_id, (shard,), exc, cache_dir) from None
        except EntryNotFoundError:
            raise HubError(f"{repo_id}'s {index.name} names {shard}, which the repo does not have (HTTP 404)") from None
        except Exception as exc:
            raise _no_download(repo_id, shard, revision, ungated, exc) from exc
