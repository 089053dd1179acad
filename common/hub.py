"""`--model` as a directory or a Hugging Face hub id (`Qwen/Qwen3.5-0.8B`, `ORG/NAME@REVISION`), as vLLM takes it.

A hub id goes through `huggingface_hub.snapshot_download`: its cache (HF_HUB_CACHE / HF_HOME), its progress bars,
its token, and HF_HUB_OFFLINE=1 (resolve from the cache only). Only the files a shard and the coordinator read
are fetched. Torch-free: shardctl resolves the id once and hands the daemons the directory."""

from __future__ import annotations

import re
from pathlib import Path

# What a Qwen3.5 checkpoint needs here: config, weights and their index, tokenizer and chat template.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(ValueError):
    """Neither a directory nor a hub model this host can get; the message says which and what to do."""


def is_hub_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec.partition("@")[0])) and not spec.startswith((".", "~"))


def resolve_model(spec: str) -> str:
    """The model directory for `spec`: the directory itself, else the hub id's snapshot (downloaded when missing)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelNotFound(f"{spec} is a file, not a model directory")
    if not is_hub_id(spec):
        raise ModelNotFound(f"{spec}: no such directory, and not a Hugging Face model id (ORG/NAME, e.g. Qwen/Qwen3.5-0.8B)")
    repo_id, _, revision = spec.partition("@")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise ModelNotFound(f"{spec} is not a directory; a Hugging Face model id needs huggingface_hub: "
                            f"pip install huggingface_hub") from None
    try:
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=ALLOW_PATTERNS)
    except GatedRepoError:
        raise ModelNotFound(f"{repo_id} is gated on the Hugging Face hub: accept its terms on huggingface.co, "
                            f"then log in (hf auth login) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"{repo_id}: no such directory, and no such model on the Hugging Face hub (a private "
                            f"one needs hf auth login or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{repo_id} has no revision {revision!r} on the Hugging Face hub") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFound(f"{spec} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
                                f"forbids downloading it: download it once online (hf download {repo_id}) or unset "
                                f"HF_HUB_OFFLINE") from None
        raise ModelNotFound(f"cannot download {repo_id} from the Hugging Face hub (no connection?) and it is not in the "
                            f"cache ({constants.HF_HUB_CACHE})") from None
    except (HfHubHTTPError, OSError) as error:  # the hub unreachable mid-download, a full disk, ...
        raise ModelNotFound(f"cannot get {repo_id} from the Hugging Face hub: {error}") from None


def model_name(model_dir: str | Path) -> str:
    """The name a model is served as: the hub id for a snapshot in the hub cache (as vLLM serves it), else the
    directory's name."""
    path = Path(model_dir).resolve()
    repo = path.parent.parent.name if path.parent.name == "snapshots" else ""
    if repo.startswith("models--") and repo.count("--") >= 2:
        _, org, name = repo.split("--", 2)
        return f"{org}/{name}"
    return path.name
