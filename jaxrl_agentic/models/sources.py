"""Where a model comes from, as a user names it: a Hugging Face directory, a `.gguf` file,
or the name of a packaged model (`packaged.PACKAGED_MODELS`). Each resolves to a local
Hugging Face directory, which is what the loader reads (GGUF files are converted once into
the cache). The built-in tiny models (`"tiny"`, `"tiny-tools"`) are resolved by
`models.tiny.pretrained_dir`, since building them needs the loader itself.
"""

from __future__ import annotations

import os

from jaxrl_agentic.models.gguf_io import gguf_model_dir
from jaxrl_agentic.models.packaged import PACKAGED_MODELS, packaged_model_dir


def is_gguf(source: str) -> bool:
    return str(source).lower().endswith(".gguf")


def hf_directory(source: str) -> str:
    """The local Hugging Face directory of `source` (fetching or converting it on first use)."""
    source = str(source)
    if source in PACKAGED_MODELS:
        return packaged_model_dir(source)
    if is_gguf(source):
        return gguf_model_dir(source)
    return os.path.expanduser(source)


def source_problem(source: str) -> str | None:
    """Why `source` cannot name a model (checked without fetching or reading weights), or
    None when it can."""
    source = str(source)
    if source in PACKAGED_MODELS:
        return None
    path = os.path.expanduser(source)
    if is_gguf(source):
        return None if os.path.isfile(path) else f"GGUF file not found: {path}"
    if not os.path.isdir(path):
        return f"model directory not found: {path}"
    if not os.path.exists(os.path.join(path, "config.json")):
        return f"{path} has no config.json (not a Hugging Face model directory)"
    return None
