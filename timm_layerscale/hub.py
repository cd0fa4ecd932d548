"""Hub weights in: a pretrained cfg's Hub repo as local files, with one-line errors.

`hub_weights` turns a tag's `hf_hub_id` (or an `hf-hub:` name) into local weights, downloaded and cached
by huggingface_hub as usual: one file, or a sharded repo's index with every shard beside it. What can go
wrong on the way (a gated repo, a missing file, a cut download, no network, offline with nothing cached)
is one `HubError` line naming the fix. A cut download is resumed by huggingface_hub's own retries (HTTP
Range requests); its partial `.incomplete` file is removed when they fail and is never returned.

Before any download the Hub is asked once, without retries and for at most `HUB_TIMEOUT_S` seconds, whether
it has the file: a Hub that cannot be asked (no network, a refused or silent connection, `HF_HUB_OFFLINE`)
costs that wait at most, then the cached file is taken, or the one line says none is cached.
"""

from __future__ import annotations

import os
import sys
import threading
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
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from timm.models._pretrained import PretrainedCfg

from .checkpoints.errors import CheckpointError, reason
from .checkpoints.formats import WEIGHTS_FILE
from .checkpoints.read.reader import read_index

__all__ = [
    "HUB_TIMEOUT_S",
    "HUB_TIMEOUT_VARIABLE",
    "OFFICIAL_SUFFIX",
    "HubError",
    "HubWeights",
    "fetch_hub_weights",
    "hub_timeout",
    "hub_weights",
    "local_way_out",
    "unreachable_reason",
]

# A repo's weights, in the order tried when the cfg names no file: one file, else a sharded index.
WEIGHT_FILES = (WEIGHTS_FILE, f"{WEIGHTS_FILE}.index.json")
# Tags of Meta's official (gated) transformers repos: `<weights>_facebook` beside timm's ungated `<weights>`.
OFFICIAL_SUFFIX = "_facebook"
# How long the one question to the Hub may take in all (name lookup, connection, TLS, answer) before the Hub
# counts as unreachable. The Hub answers a HEAD well within a second; without a bound of our own a silent
# network costs huggingface_hub's 10 s per attempt and its retries, half a minute or more, where "no Hub"
# should take seconds. A slow link sets a longer wait with HUB_TIMEOUT_VARIABLE (seconds).
HUB_TIMEOUT_S = 3.0
HUB_TIMEOUT_VARIABLE = "TIMM_LAYERSCALE_HUB_TIMEOUT"
# The request's own timeout ends it first and closes its connection; the deadline, this much later, is for what
# that timeout does not reach (the name lookup) and for its phases adding up.
DEADLINE_GRACE_S = 0.5
# The way around the Hub with a local file, in Python; and in timm's scripts, found by the script's name
# (`python train.py`, `timm-ls run train.py`): train.py takes the file as pretrained weights, validate.py
# loads it after building the model, both through this package's load hook.
PYTHON_LOCAL_FILE = "pass pretrained_cfg_overlay=dict(file=PATH)"
SCRIPT_LOCAL_FILE = {
    "train.py": "pass a local file with train.py's --pretrained-path PATH",
    "validate.py": "pass a local file with validate.py's --checkpoint PATH (without --pretrained)",
}


class HubError(CheckpointError):
    """Hub weights that cannot be had; the message names the problem and the fix in one line.

    `unreachable` says why the Hub could not be asked (see `unreachable_reason`) when that is the problem
    and nothing was cached; it is None when the Hub answered (gated, missing, HTTP errors). `way_out`, when
    the message has one, is its last part (after `, or `): how to pass a local file instead, for how the
    program was started (`local_way_out`); a command line names its own with `instead`.
    """

    def __init__(self, problem: str, unreachable: str | None = None, way_out: str = "") -> None:
        super().__init__(f"{problem}, or {way_out}" if way_out else problem)
        self.problem, self.unreachable, self.way_out = problem, unreachable, way_out

    def instead(self, way_out: str) -> HubError:
        """The same error with the caller's way around the Hub (a command's flag) where it names one."""
        return HubError(self.problem, self.unreachable, way_out) if self.way_out else self


def local_way_out(python: str = PYTHON_LOCAL_FILE, argv0: str | None = None) -> str:
    """How to pass a local file instead of the Hub's: train.py's or validate.py's flag when `argv0` (default
    `sys.argv[0]`) is that script, else `python`, the way in Python."""
    script = argv0 if argv0 is not None else (sys.argv[0] if sys.argv else "")
    return SCRIPT_LOCAL_FILE.get(Path(script).name, python)


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
        f"{why}, and the weights of {repo_id} ({' or '.join(filenames)}) are not in the local cache {cache}; {fix}",
        unreachable=None if isinstance(exc, HfHubHTTPError) else unreachable_reason(exc) or reason(exc),
        way_out=local_way_out(),
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
    shard downloaded beside it (`checkpoints.open_checkpoint` reads either). The Hub is asked once, without
    retries, whether it has the file (nothing is asked with `HF_HUB_OFFLINE=1`); waiting at most
    `HUB_TIMEOUT_S` seconds (`TIMM_LAYERSCALE_HUB_TIMEOUT` to change it). When it answers, the file is
    downloaded into huggingface_hub's cache, or revalidated there. When it cannot be asked or answers 5xx,
    the cached file is taken, offline. `cache_dir` overrides the cache folder.

    Raises `HubError` (a `CheckpointError`) with one line: a gated repo without access (how to get it, and
    `ungated`, the name of an ungated copy of the same weights, when the caller knows one), a missing repo,
    revision or file, a download cut short, or no Hub and nothing cached.
    """
    repo_id, revision, filename = _hub_source(source)
    candidates = (filename,) if filename else WEIGHT_FILES
    origin = f"Hub {repo_id}" + (f"@{revision}" if revision else "")
    cached = _cached(repo_id, candidates, revision, cache_dir)  # what to take if the Hub cannot be asked
    name, unanswered = _file_on_hub(repo_id, candidates, revision, ungated)
    if unanswered is not None:
        if cached is None:
            raise _not_cached(repo_id, candidates, unanswered, cache_dir)
        path, origin = cached, f"{origin} from the local cache ({_cache_origin(unanswered)})"
    elif name is None:
        raise HubError(
            f"{repo_id} has no {' or '.join(candidates)} (HTTP 404): see its files on {constants.ENDPOINT}/{repo_id}",
            way_out=local_way_out("name another of its files with hf_hub_filename in a tag or pretrained_cfg_overlay"),
        )
    else:
        try:
            path = _download(repo_id, name, revision, cache_dir)
        except Exception as exc:
            raise _no_download(repo_id, name, revision, ungated, exc) from exc
    if path.name.endswith(".index.json"):
        _download_shards(repo_id, path, cache_dir, ungated, unanswered)
    return HubWeights(path, origin)


def _file_on_hub(
    repo_id: str, candidates: tuple[str, ...], revision: str | None, ungated: str
) -> tuple[str | None, BaseException | None]:
    """(the first of `candidates` the Hub has, None) or (None, None) when it has none of them; (None, why)
    when the Hub could not be asked or answered 5xx. Other answers (gated, missing repo) raise their line."""
    if constants.HF_HUB_OFFLINE:
        return None, OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
    timeout = hub_timeout()
    for name in candidates:
        try:
            _ask(huggingface_hub.hf_hub_url(repo_id, name, revision=revision), timeout)
        except EntryNotFoundError:  # this file is not in the repo: try the next name
            continue
        except HfHubHTTPError as exc:
            if exc.response is None or exc.response.status_code < 500:
                raise _no_download(repo_id, name, revision, ungated, exc) from exc
            return None, exc
        except Exception as exc:  # no Hub: no other name is asked for
            return None, exc
        return name, None
    return None, None


def hub_timeout() -> float:
    """Seconds the question to the Hub may take: `TIMM_LAYERSCALE_HUB_TIMEOUT` when set, else `HUB_TIMEOUT_S`."""
    value = os.environ.get(HUB_TIMEOUT_VARIABLE, "").strip()
    if not value:
        return HUB_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise HubError(
            f"{HUB_TIMEOUT_VARIABLE}={value!r} is not a number of seconds above 0: set it to how long to wait for "
            f"the Hub (e.g. 10), or unset it for {HUB_TIMEOUT_S:g}"
        )
    return seconds


def _ask(url: str, timeout: float) -> None:
    """One HEAD of a file's URL, without retries; the Hub's HTTP error, or why it could not be asked, is raised.

    huggingface_hub's timeout bounds each phase of the request but not the name lookup, which can stall for
    tens of seconds without a network; so the request runs in a thread that is waited for this long only.
    """
    outcome: list[BaseException | None] = []

    def head() -> None:
        try:  # huggingface_hub makes no retry of a HEAD unless asked to (retry_on_errors)
            huggingface_hub.get_hf_file_metadata(url, timeout=timeout)
        except Exception as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    asking = threading.Thread(target=head, name="timm_layerscale Hub question", daemon=True)
    asking.start()
    asking.join(timeout + DEADLINE_GRACE_S)
    error = outcome[0] if outcome else TimeoutError()
    if error is None:
        return
    if isinstance(error, TimeoutError) or any(c.__name__ == "TimeoutException" for c in type(error).__mro__):
        error = TimeoutError(f"no answer within {timeout:g} s ({HUB_TIMEOUT_VARIABLE} sets how long to wait)")
    raise error


def _download_shards(
    repo_id: str, index: Path, cache_dir: str | Path | None, ungated: str, unanswered: BaseException | None
) -> None:
    """Every shard of a cached index, from the same revision (the index's snapshot folder); from the cache
    only when the Hub was not asked (`unanswered` says why)."""
    shards = sorted(set(read_index(index).values()))
    revision = index.parent.name
    for shard in shards:
        if unanswered is not None:
            if _cached(repo_id, (shard,), revision, cache_dir) is None:
                raise _not_cached(repo_id, (shard,), unanswered, cache_dir)
            continue
        try:
            _download(repo_id, shard, revision, cache_dir)
        except LocalEntryNotFoundError as exc:
            raise _not_cached(repo_id, (shard,), exc, cache_dir) from None
        except EntryNotFoundError:
            raise HubError(f"{repo_id}'s {index.name} names {shard}, which the repo does not have (HTTP 404)") from None
        except Exception as exc:
            raise _no_download(repo_id, shard, revision, ungated, exc) from exc
