"""The docs name what exists.

* Every command line in README.md and docs/ that runs `python scripts/<...>.py` or
  `python -m jaxrl_agentic.<module>` names a file or module that exists, and each of its
  `--flag`s is one that program's argument parser accepts (the parsers are read in one
  subprocess that runs each program until it asks argparse to parse).
* Every `--config.<field>` override the docs name, and every field of
  docs/configuration.md's tables, exists in `config.default_config()` (or in the recipe the
  command runs); environment parameters under `env_config` are checked against the
  environment's params.
* Every in-repository link to a heading (`file.md#anchor`) and every reference written as
  docs/<page>.md, "Section" names a heading that exists.
* Every field of the policy-loss sums (`pallas_kernels.PPOLossSums`,
  `algos.losses.PolicyLossSums`) that docs/extending.md, kernels.md and algorithms.md name
  is a field of that class (a loss written from the docs builds its return value from them).

The checker functions are tested on wrong strings too, so a check that stopped reporting
would fail here.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCS = [p for p in DOCS if p.exists()]

COMMAND = re.compile(r"python3?\s+(?:-m\s+(jaxrl_agentic(?:\.\w+)+)|(scripts/[\w/.-]+\.py))")
OVERRIDE = re.compile(r"--config\.([A-Za-z_][\w.]*)")
STOP_TOKENS = {"|", "||", "&&", ";", ">", ">>", "2>", "#"}


# ----------------------------------------------------------------------------- extraction


def _paragraphs(text: str):
    """(kind, text) pieces of a markdown file: "code" for each line of a fenced or indented
    code block (backslash continuations joined), "prose" for each paragraph (its lines
    joined, so an inline code span may wrap)."""
    pieces, prose, in_fence, pending = [], [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if prose:
                pieces.append(("prose", " ".join(prose)))
                prose = []
            in_fence = not in_fence
            continue
        code = in_fence or (line.startswith("    ") and not prose and line.strip())
        if code:
            line = pending + line.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            pieces.append(("code", " ".join(line.split())))
        elif line.strip():
            prose.append(line.strip())
        elif prose:
            pieces.append(("prose", " ".join(prose)))
            prose = []
    if prose:
        pieces.append(("prose", " ".join(prose)))
    return pieces


def doc_commands(text: str) -> list[str]:
    """The command lines of a markdown text that run a script or a jaxrl_agentic module,
    each from `python` to its end (a code line, or an inline code span)."""
    commands = []
    for kind, piece in _paragraphs(text):
        spans = [piece] if kind == "code" else re.findall(r"`([^`]+)`", piece)
        for span in spans:
            for m in COMMAND.finditer(span):
                rest = span[m.start():]
                nxt = COMMAND.search(rest, 1)  # two commands in one span: split them
                commands.append(rest[: nxt.start()] if nxt else rest)
    return commands


@dataclasses.dataclass
class Command:
    target: str  # "scripts/....py" or "jaxrl_agentic.<module>"
    flags: list[str]  # --flags before a bare "--"
    overrides: list[str]  # --config.<path> (without the value)
    recipe: str | None  # --config <file>


def parse_command(line: str) -> Command:
    m = COMMAND.match(line)
    target = m.group(1) or m.group(2)
    tokens = line[m.end():].split()
    flags, overrides, recipe, after_separator = [], [], None, False
    for i, raw in enumerate(tokens):
        token = raw.strip("[]{}(),;'\"")
        if raw in STOP_TOKENS or raw.startswith("#"):
            break
        if token == "--":
            after_separator = True
            continue
        if not token.startswith("--"):
            continue
        name, _, value = token.partition("=")
        if name.startswith("--config."):
            if re.fullmatch(r"--config\.[A-Za-z_][\w.]*", name):  # not a placeholder
                overrides.append(name[len("--config."):])
        elif not after_separator:
            flags.append(name)
            if name == "--config":
                value = value or (tokens[i + 1].strip("[]'\"") if i + 1 < len(tokens) else "")
                if value.endswith(".py") and "<" not in value:
                    recipe = value
    return Command(target, flags, overrides, recipe)


# ----------------------------------------------------------------------------- programs


def target_path(target: str) -> Path | None:
    """The file a command target runs, or None if it does not exist."""
    if target.startswith("scripts/"):
        path = ROOT / target
        return path if path.is_file() else None
    parts = target.split(".")
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"),
                      ROOT.joinpath(*parts, "__main__.py")):
        if candidate.is_file():
            return candidate
    return None


_CAPTURE = r'''
import argparse, contextlib, io, json, os, runpy, sys

class Parsed(BaseException):
    pass

original = argparse.ArgumentParser.parse_known_args

def parse_known_args(self, args=None, namespace=None):
    if not self.add_help:  # a pre-parser read before the imports (e.g. --cpu-devices)
        return original(self, [], namespace)
    raise Parsed(self)

argparse.ArgumentParser.parse_known_args = parse_known_args
found = {}
for target in json.loads(sys.argv[1]):
    sys.argv = [target]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if target.endswith(".py"):
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        found[target] = "no parser"
    except Parsed as parsed:
        parser = parsed.args[0]
        found[target] = sorted({o for a in parser._actions for o in a.option_strings})
    except BaseException as e:
        found[target] = f"{type(e).__name__}: {e}"
print("\n" + json.dumps(found))
'''


def _string_flags(path: Path) -> set[str]:
    """Flags a program without an argparse parser reads itself: the `--name`s in its
    string constants, and `--config` where it parses an ml_collections recipe."""
    source = path.read_text()
    flags = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            flags.update(re.findall(r"(?<![\w-])--[a-z][\w-]*", node.value))
    if "parse_config(" in source or "DEFINE_config_file(" in source:
        flags.add("--config")
    return flags


@functools.cache
def accepted_flags(targets: tuple[str, ...]) -> dict[str, set[str]]:
    """{target: the flags it accepts}, for existing targets. Programs with an argparse
    parser are run (in one subprocess) until they call it; the others are read."""
    run = [t for t in targets if "ArgumentParser(" in target_path(t).read_text()]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CAPTURE, json.dumps(run)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    flags = {}
    for target in targets:
        if target in run:
            got = parsed[target]
            assert isinstance(got, list), f"{target}: its parser was not reached ({got})"
            flags[target] = set(got)
        else:
            flags[target] = _string_flags(target_path(target))
    return flags


def command_errors(line: str, flags_of) -> list[str]:
    """What is wrong with one doc command line: a missing program or an unknown flag.
    `flags_of(target)` gives the flags a target accepts."""
    command = parse_command(line)
    if target_path(command.target) is None:
        return [f"{command.target}: no such script or module"]
    accepted = flags_of(command.target)
    return [f"{command.target}: {flag} is not accepted (it takes {', '.join(sorted(accepted))})"
            for flag in command.flags if flag not in accepted]


# ----------------------------------------------------------------------------- config fields


@functools.cache
def _config(recipe: str | None):
    from jaxrl_agentic.config import default_config, recipe_config

    return default_config() if recipe is None else recipe_config(str(ROOT / recipe))


@functools.cache
def env_params(env_type: str) -> set[str] | None:
    """The parameter names of a JAX environment (None: not a JAX environment)."""
    from jaxrl_agentic.envs import registry

    if env_type not in registry.registered_envs("jax"):
        return None
    _, params = registry.make(env_type)
    return {f.name for f in dataclasses.fields(params)}


def _spec(cfg, tag: str):
    from jaxrl_agentic.config import env_spec
    from jaxrl_agentic.envs import registry

    if tag in cfg.custom_envs:
        return cfg.custom_envs[tag]
    return env_spec(tag) if tag in registry.registered_envs("jax") else None


def _check_env_config(cfg, env_types, key: str, where: str) -> str | None:
    for env_type in env_types:
        names = env_params(env_type)
        if names is not None and key not in names:
            return f"{where}: {env_type} has no parameter {key!r}"
    return None


def config_path_error(path: str, recipe: str | None = None) -> str | None:
    """Why `--config.<path>` is not a field of the recipe's config (default_config() when
    `recipe` is None), or None. A tag under `custom_envs` that the config lacks is checked
    as `env_spec(<tag>)`; keys under an `env_config` as the environment's parameters."""
    cfg = _config(recipe)
    parts = path.split(".")
    if parts[0] == "custom_envs" and len(parts) > 1:
        spec = _spec(cfg, parts[1])
        if spec is None:
            return f"custom_envs.{parts[1]}: no such tag or environment"
        if len(parts) == 2:
            return None
        if parts[2] == "env_config" and len(parts) > 3:
            return _check_env_config(cfg, [spec.env_type], parts[3], path)
        node, parts, done = spec, parts[2:], ["custom_envs", parts[1]]
    elif parts[0] in ("train_env_manager", "val_env_manager") and parts[1:2] == ["env_config"]:
        if len(parts) == 2:
            return None
        types = [cfg.custom_envs[t].env_type for t in cfg[parts[0]].tags if t in cfg.custom_envs]
        return _check_env_config(cfg, types, parts[2], path)
    else:
        node, done = cfg, []
    for part in parts:
        if not hasattr(node, "keys") or part not in node.keys():
            return f"{'.'.join(done + [part])}: not a config field"
        node = node[part]
        done.append(part)
    return None


def configuration_table_fields(text: str) -> list[str]:
    """The config paths of docs/configuration.md's field tables: a table whose first header
    cell is "field"; names relative to the section for `custom_envs.<tag>` (as
    `custom_envs.frozen_lake.<name>`) and the env managers (`train_env_manager.<name>`)."""
    fields, heading, in_table = [], "", False
    for line in text.splitlines():
        if line.startswith("#"):
            heading, in_table = line, False
        elif line.startswith("| field"):
            in_table = True
        elif in_table and line.startswith("|") and not line.startswith("|---"):
            first = line.split("|")[1]
            for name in re.findall(r"`([\w.]+)`", first):
                if "`custom_envs.<tag>`" in heading:
                    name = f"custom_envs.frozen_lake.{name}"
                elif "`train_env_manager`" in heading:
                    name = f"train_env_manager.{name}"
                fields.append(name)
        elif not line.startswith("|"):
            in_table = False
    return fields


# ----------------------------------------------------------------------------- loss sums

SUMS_DOCS = ("docs/extending.md", "docs/kernels.md", "docs/algorithms.md")
SUMS_SENTENCE = re.compile(r"PPOLossSums|PolicyLossSums|diagnostics|\bsums\b", re.I)


@functools.cache
def sums_vocabulary() -> tuple[dict[str, frozenset], frozenset, tuple[str, ...]]:
    """(each sums class's fields, the names the sums sit beside: the loss's arguments and
    the config's fields, the beginnings a sums field's name has: `pg`, `clip`, `appr`, …)."""
    import inspect

    from jaxrl_agentic.algos.losses import PolicyLossSums, policy_loss
    from jaxrl_agentic.config import default_config
    from pallas_kernels import PPOLossSums, masked_ppo_loss

    fields = {"PPOLossSums": frozenset(PPOLossSums._fields),
              "PolicyLossSums": frozenset(PolicyLossSums._fields)}
    beside = frozenset({*inspect.signature(masked_ppo_loss).parameters,
                        *inspect.signature(policy_loss).parameters, *default_config().keys()})
    stems = tuple(sorted({f.split("_")[0][:4] for f in PPOLossSums._fields}))
    return fields, beside, stems


def sums_field_errors(name: str, text: str) -> list[str]:
    """Names a text gives the loss sums' fields that the classes do not have: those in
    `PPOLossSums(...)` / `PolicyLossSums(...)`, the left side of a code line's `x = Σ …`, and
    each backticked name of a sentence about the sums (naming a sums class, sums or the
    diagnostics) that begins as a field does and is no argument of the loss or config field."""
    fields, beside, stems = sums_vocabulary()
    known = frozenset().union(*fields.values())

    def wrong(field: str) -> bool:
        return field.startswith(stems) and field not in known | beside

    errors = []
    for cls, args in re.findall(r"\b(PPOLossSums|PolicyLossSums)\(([^)]*)\)", text):
        for arg in args.split(","):
            m = re.match(r"\s*(\w+)\s*(=|$)", arg)
            if m and m.group(1) not in fields[cls]:
                errors.append(f"{name}: {cls}({m.group(1)}): not a field of {cls}")
    for kind, piece in _paragraphs(text):
        if kind == "code":
            errors += [f"{name}: {f} = Σ …: not a field of the sums"
                       for f in re.findall(r"(\w+) = Σ", piece) if wrong(f)]
            continue
        for sentence in re.split(r"(?<=\.)\s+", piece):
            if SUMS_SENTENCE.search(sentence):
                errors += [f"{name}: `{f}`: not a field of the sums"
                           for f in re.findall(r"`(\w+)`", sentence) if wrong(f)]
    return errors


# ----------------------------------------------------------------------------- headings


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def headings(path: Path) -> tuple[str, ...]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return tuple(m.group(1) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, flags=re.M))


def link_errors(path: Path, text: str) -> list[str]:
    """Links `[..](file.md#anchor)` / `(#anchor)` whose file or heading does not exist."""
    errors = []
    for target, frag in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        page = (path.parent / target).resolve() if target else path
        if not page.is_file():
            errors.append(f"{path.name}: link to missing {target}")
        elif frag not in {anchor(h) for h in headings(page)}:
            errors.append(f"{path.name}: no heading #{frag} in {page.name}")
    return errors


SECTION_REFERENCE = re.compile(r"(docs/[\w/]+\.md)`?,?\s+\(?\"([^\"]+)\"")


def section_reference_errors(name: str, text: str) -> list[str]:
    """References written as docs/<page>.md, "Section" (or with the section in brackets)
    whose page has no heading containing that section."""
    errors = []
    for page, section in SECTION_REFERENCE.findall(text):
        path = ROOT / page
        if not path.is_file():
            errors.append(f"{name}: {page} does not exist")
        elif not any(section in h for h in headings(path)):
            errors.append(f"{name}: {page} has no section {section!r}")
    return errors


# ----------------------------------------------------------------------------- the tests


def _all_commands() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in doc_commands(p.read_text())]


def test_the_checkers_report_wrong_commands_fields_and_links(tmp_path):
    # Extraction: a wrapped inline span, a fenced line with a comment, a continued line.
    text = ("Run `python scripts/bench/bench_packing.py\n--repeats 3` now.\n\n"
            "```\npython -m jaxrl_agentic.train --config configs/frozen_lake.py  # note\n"
            "python scripts/bench/bench_learner.py --sizes 25m \\\n    --repeats 3\n```\n")
    assert doc_commands(text) == [
        "python scripts/bench/bench_packing.py --repeats 3",
        "python -m jaxrl_agentic.train --config configs/frozen_lake.py # note",
        "python scripts/bench/bench_learner.py --sizes 25m --repeats 3"]
    command = parse_command("python scripts/analysis/real_shape_step.py --model M [--row 8192] "
                            "-- --config.seed=1 --x")
    assert command.flags == ["--model", "--row"] and command.overrides == ["seed"]

    flags = {"scripts/bench/bench_packing.py": {"--repeats", "--micro-batch-max-tokens"}}
    assert command_errors("python scripts/bench/bench_packing.py --repeats 3", flags.get) == []
    assert command_errors("python scripts/bench/bench_packing.py --repeat 3", flags.get)
    assert command_errors("python scripts/bench/bench_pack.py --repeats 3", flags.get)
    assert command_errors("python -m jaxrl_agentic.trainer --config c.py", flags.get)

    assert config_path_error("generation.temperature") is None
    assert config_path_error("generation.temprature")
    assert config_path_error("custom_envs.sokoban.env_config.push_potential") is None
    assert config_path_error("custom_envs.sokoban.env_config.push_potentials")
    assert config_path_error("train_env_manager.env_config.p_frozen") is None
    assert config_path_error("train_env_manager.env_config.p_frozn")
    assert config_path_error("custom_envs.frozen_lake.max_turn")

    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Some section\n\n[ok](#some-section) [bad](#missing)\n")
    assert link_errors(page, page.read_text()) == ["page.md: no heading #missing in page.md"]
    assert section_reference_errors("x", 'see docs/benchmarks.md, "No such section"')
    assert not section_reference_errors("x", 'see docs/benchmarks.md, "Sokoban"')


def test_doc_commands_name_existing_programs_and_accepted_flags():
    commands = _all_commands()
    assert len(commands) > 20, "the command extraction found almost nothing"
    targets = tuple(sorted({parse_command(c).target for _, c in commands
                            if target_path(parse_command(c).target)}))
    flags = accepted_flags(targets)
    errors = [f"{doc}: {e}  [{line}]" for doc, line in commands
              for e in command_errors(line, flags.get)]
    assert not errors, "\n".join(errors)


def test_doc_commands_run_recipes_that_exist():
    errors = [f"{doc}: {cmd.recipe} does not exist" for doc, line in _all_commands()
              if (cmd := parse_command(line)).recipe and not (ROOT / cmd.recipe).is_file()]
    assert not errors, "\n".join(errors)


def test_config_overrides_in_the_docs_are_config_fields():
    errors = []
    for doc, line in _all_commands():
        command = parse_command(line)
        recipe = command.recipe if command.recipe and (ROOT / command.recipe).is_file() else None
        errors += [f"{doc}: --config.{p}: {e}" for p in command.overrides
                   if (e := config_path_error(p, recipe))]
    for path in DOCS:  # overrides named anywhere in the prose
        for p in OVERRIDE.findall(path.read_text()):
            p = p.rstrip(".")
            if (e := config_path_error(p)) and all(config_path_error(p, r) for r in _recipes()):
                errors.append(f"{path.relative_to(ROOT)}: --config.{p}: {e}")
    assert not errors, "\n".join(errors)


def _recipes() -> list[str]:
    return [f"configs/{p.name}" for p in sorted((ROOT / "configs").glob("*.py"))]


def test_configuration_tables_list_config_fields():
    fields = configuration_table_fields((ROOT / "docs" / "configuration.md").read_text())
    assert len(fields) > 80, "the table parser found almost nothing"
    errors = [f"docs/configuration.md: {f}: {e}" for f in fields if (e := config_path_error(f))]
    assert not errors, "\n".join(errors)


def test_the_loss_sums_fields_the_docs_name_exist():
    assert sums_field_errors("x", "-> PPOLossSums(pg_loss, kl, clipped)") == [
        "x: PPOLossSums(clipped): not a field of PPOLossSums"]
    assert sums_field_errors("x", "Sums:\n\n    approx_kl_old = Σ [w>0]·(old − logp)\n")
    assert sums_field_errors("x", "The diagnostics (`dual_clipped`, `ratio`) are counts.")
    assert sums_field_errors("x", "PPOLossSums: `pg`, `kl`.")
    assert not sums_field_errors("x", "The sums: `pg_loss`, `clip_high` is `None` with "
                                      "`pg_clip_high=0`, `w` and `D`.")
    errors = [e for doc in SUMS_DOCS for e in sums_field_errors(doc, (ROOT / doc).read_text())]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_to_headings_resolve(path):
    assert not link_errors(path, path.read_text())


def test_section_references_name_existing_headings():
    files = [*DOCS, *ROOT.glob("configs/*.py"), *ROOT.glob("scripts/**/*.py"),
             *ROOT.glob("jaxrl_agentic/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py"),
             *ROOT.glob("tests/**/*.py")]
    errors = []
    for path in files:
        if path.name == "test_docs.py":
            continue
        text = path.read_text()
        if path.suffix == ".py":
            text = re.sub(r"\n\s*#\s?", " ", text)  # a reference in a comment may wrap
        text = re.sub(r"\s+", " ", text)  # and one in prose or a docstring too
        errors += section_reference_errors(path.relative_to(ROOT).as_posix(), text)
    assert not errors, "\n".join(errors)


LINE_LIMIT = 600  # a page or a module that fits on a few screens


def files_over_line_limit(paths, limit: int = LINE_LIMIT) -> list[str]:
    """'<path>: <n> lines' for each file with more than `limit` lines."""
    errors = []
    for path in map(Path, paths):
        n = len(path.read_text().splitlines())
        if n > limit:
            name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            errors.append(f"{name}: {n} lines (limit {limit})")
    return errors


def test_benchmarks_page_and_modules_stay_within_the_line_limit(tmp_path):
    # The checker reports a file one line over the limit and passes one at it.
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * 4)
    short.write_text("x = 1\n" * 3)
    assert files_over_line_limit([long, short], limit=3) == [f"{long}: 4 lines (limit 3)"]

    modules = sorted([*ROOT.glob("jaxrl_agentic/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")])
    assert len(modules) > 50, "the module glob found almost nothing"
    errors = files_over_line_limit([ROOT / "docs" / "benchmarks.md", *modules])
    assert not errors, "\n".join(errors)
