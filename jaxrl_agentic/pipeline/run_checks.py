"""Checks a run makes before it trains: every process loads the same model files."""

from __future__ import annotations

from jaxrl_agentic.config import ConfigError
from jaxrl_agentic.runtime.parallel import allgather_objects


def model_files_digest(model_dir: str) -> str:
    """sha256 over the weight and config files of an HF directory (names and contents)."""
    import hashlib
    import os

    digest = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".safetensors", ".json")):
            digest.update(name.encode())
            with open(os.path.join(model_dir, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
    return digest.hexdigest()


def check_same_model_everywhere(model_dir: str) -> None:
    """Each process loads its own shards from its own copy of the model (and may have run
    its own format warm-up): different files would silently mix two models."""
    digests = allgather_objects(model_files_digest(model_dir))
    if len(set(digests)) > 1:
        odd = [i for i, d in enumerate(digests) if d != digests[0]]
        raise ConfigError(f"config.pretrain: the model files in {model_dir} differ between "
                          f"processes (process 0 vs {odd}); copy the same model to every host")
