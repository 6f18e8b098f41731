"""The dependencies pyproject.toml declares are enough for the train path.

A module that arrives only through a `[test]` extra (jinja2 came with torch) passes every
test and breaks `pip install -e .`. So a fresh interpreter that sees only the declared,
non-extra requirements and what they require (a directory of links to those distributions,
site-packages switched off with `-S`) imports the train path and does what a run does
first: parse a recipe, load the tokenizer, render the chat template. Importing what is
merely installed (flax imports IPython, transformers torch, when they are there) is not a
need; this finds what is.
"""

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
import textwrap

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli pip vendors
    from pip._vendor import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_PACKAGES = {"jaxrl_agentic", "pallas_kernels", "tests"}

TRAIN_PATH = textwrap.dedent("""
    import json, sys
    baseline = set(json.loads(sys.argv[2]))
    import jaxrl_agentic.train as train
    import jaxrl_agentic.pipeline, jaxrl_agentic.training, jaxrl_agentic.sampling  # noqa
    import jaxrl_agentic.runtime.checkpoint, jaxrl_agentic.runtime.metrics_writer  # noqa
    import jaxrl_agentic.warmup  # noqa
    import jaxrl_agentic.evaluate, jaxrl_agentic.export, jaxrl_agentic.play  # noqa
    import jaxrl_agentic.rollout.python_runner  # noqa
    from jaxrl_agentic.models import load_pretrained
    from jaxrl_agentic.rollout.conversation import ChatFormatter
    train.parse_config(["train", "--config", sys.argv[3]])
    _, tokenizer = load_pretrained(sys.argv[1])
    formatter = ChatFormatter(tokenizer)
    formatter.next_prompt("turn 2")
    assert formatter.first_prompt("hello")
    print("MODULES " + json.dumps(sorted(set(sys.modules) - baseline)))
""")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_closure() -> set[str]:
    """Canonical names of the distributions the non-extra requirements pull in, transitively
    (with the extras each requirement asks for), as installed here."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        todo = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = _canonical(req.name)
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(req.name) or []:
            sub = Requirement(line)
            # A requirement applies without an extra, or under an extra asked for here.
            if sub.marker is None or any(sub.marker.evaluate({"extra": e})
                                         for e in {"", *req.extras}):
                todo.append(sub)
    return seen


def declared_site(directory: str) -> set[str]:
    """Links in `directory` to every installed file tree of the declared closure (packages,
    single modules, bundled `.libs`, `.dist-info`): site-packages as `pip install -e .`
    would leave it. → the linked top-level module names."""
    tops: set[str] = set()
    for name in declared_closure():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # a marker-less optional one not installed
            continue
        for file in dist.files or []:
            top = file.parts[0]
            link = os.path.join(directory, top)
            if top == ".." or os.path.lexists(link):
                continue
            os.symlink(dist.locate_file(top), link)
            tops.add(top.split(".")[0] if top.endswith(".py") else top)
    return tops


def test_declared_dependencies_cover_the_train_path(tiny_model_dir, tmp_path):
    site = str(tmp_path / "site")
    os.makedirs(site)
    linked = declared_site(site)
    assert {"jax", "flax", "transformers"} <= linked
    assert "torch" not in linked  # the [test] extra stays out
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([site, ROOT]))
    env.pop("PYTHONHOME", None)
    bare = subprocess.run([sys.executable, "-S", "-c", "import sys, json; print(json.dumps("
                           "sorted(sys.modules)))"], capture_output=True, text=True, env=env,
                          check=True)
    proc = subprocess.run([sys.executable, "-S", "-c", TRAIN_PATH, tiny_model_dir, bare.stdout,
                           os.path.join(ROOT, "configs", "frozen_lake.py")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("MODULES ")][-1]
    modules = json.loads(line[len("MODULES "):])
    top_level = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - OWN_PACKAGES
    # Every module came from the declared closure (nothing else was on the path).
    owners = metadata.packages_distributions()
    closure = declared_closure()
    outside = {m: owners[m] for m in top_level
               if m in owners and not {_canonical(d) for d in owners[m]} & closure}
    assert not outside, f"imported from outside the declared dependencies: {outside}"
    assert "jinja2" in top_level  # the chat template really was rendered
