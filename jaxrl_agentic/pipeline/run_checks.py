"""Checks a run makes before it trains: the options of its Python environments build one
environment each, and every process loads the same model files."""

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


def check_python_env_options(cfg) -> None:
    """Builds one environment of every Python environment the run plays, with its options,
    so that an option it does not take (a typo such as ``extra_tool=``) is one config error
    line now, not a traceback during the start or an error in every episode (a factory that
    hands its options to the environment's constructor on the worker threads).

    ``cfg`` is the typed run-config tree. For each tag of ``cfg.envs`` registered on the
    Python backend (a JAX environment's params are checked by ``config.validate``; another
    library's ids by their builder there), and for each split's ``env_config`` overrides of
    its manager's tags (``cfg.split_env_config``): the factory builder is called with the
    options as the runner calls it, then the factory with a first episode (seed 0, group 0,
    member 0; ``reset`` is not called). A TypeError or ValueError of either is a ConfigError
    that names the recipe field the user wrote: "config.custom_envs.<tag>.env_config:
    <env_type>: <message>", or for a manager's overrides
    "config.<split>_env_manager.env_config: <tag>: <message>".
    """
    from jaxrl_agentic.envs.python_env import make_python_env
    from jaxrl_agentic.envs.registry import registered_env
    from jaxrl_agentic.rollout.groups import EpisodeSpec

    def python_env(tag):
        entry = registered_env(cfg.envs[tag].env_type)
        return entry is not None and entry.backend == "python"

    checks = [(f"config.custom_envs.{tag}.env_config: {env.env_type}", tag,
               dict(env.env_config)) for tag, env in cfg.envs.items() if python_env(tag)]
    for split in ("train", "val"):
        if cfg.split(split).env_config:
            checks += [(f"config.{split}_env_manager.env_config: {tag}", tag,
                        cfg.split_env_config(split, tag))
                       for tag in cfg.split(split).manager.tags if python_env(tag)]
    for where, tag, env_config in checks:
        env = cfg.envs[tag]
        try:
            factory = make_python_env(env.env_type, format_penalty=env.format_penalty,
                                      **env_config)
            factory(EpisodeSpec(seed=0, group_id=0, member=0), cfg.run.seed)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {e}{_closest_option(e, env.env_type)}") from None


def _closest_option(error: Exception, env_type: str) -> str:
    """``"; did you mean 'x'?"`` for an unexpected keyword argument of a factory builder
    whose options are named in its signature ("" otherwise, e.g. one that takes
    ``**options``)."""
    import difflib
    import inspect
    import re

    from jaxrl_agentic.envs.registry import registered_env

    given = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    try:
        parameters = inspect.signature(registered_env(env_type).factory).parameters.values()
    except (TypeError, ValueError):
        return ""
    names = [p.name for p in parameters
             if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if given is None or any(p.kind == p.VAR_KEYWORD for p in parameters):
        return ""
    close = difflib.get_close_matches(given.group(1), names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
