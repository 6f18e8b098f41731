"""The params of `"model:<path>"` seats (`envs/textarena_games.py`): another model plays a
seat of a two-player game through the policy's sampler.

A seat model must have the policy's tokenizer (it reads and writes the same token ids) and
its shapes (the sampler's programs are the policy's: the same parameter tree, each leaf of
the same shape); either mismatch is one `ConfigError` line naming the seat. `<path>` is
what `teacher.pretrain` takes: a Hugging Face directory, a `.gguf` file or a training run's
output directory (its latest checkpoint, restored by `run_policy`). Its weights are read
into the policy's shardings in the run's compute and parameter dtypes. Under LoRA the
sampler reads adapter leaves a plain model does not have: a config error.
"""

from __future__ import annotations

import os

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_agentic.config import ConfigError
from jaxrl_agentic.envs.textarena_games import MODEL
from jaxrl_agentic.pipeline.distillation import check_same_tokenizer, teacher_model_dir
from jaxrl_agentic.run_paths import is_teacher_run
from jaxrl_agentic.runtime.parallel import param_partition_spec


def _shapes(params) -> dict:
    return {jax.tree_util.keystr(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def load_seat_model(kind: str, policy_params, model_settings, mesh, tokenizer, *,
                    run_policy=None):
    """The params `kind` ("model:<path>") plays with, checked against the policy's (module
    doc)."""
    from jaxrl_agentic.models.hf_io import load_pretrained, load_tokenizer

    source = os.path.expanduser(kind[len(MODEL):])
    field = f"seats: {kind!r}"
    if model_settings.lora.enabled:
        raise ConfigError(f"{field}: a seat model cannot be played beside a LoRA policy (the "
                          "sampler reads adapter leaves it does not have); use a frozen seat")
    check_same_tokenizer(load_tokenizer(teacher_model_dir(source)), tokenizer, source,
                         field=field, role="the seat model")
    if is_teacher_run(source):
        if run_policy is None:
            raise ConfigError(f"{field} is a training run; a Pipeline built in code restores "
                              "it with Pipeline(config, run_policy=run_loading.run_policy)")
        params = nnx.state(run_policy(source)[0])
    else:
        def shardings(path, shape):
            return NamedSharding(mesh, param_partition_spec(path, shape, mesh.shape))

        model, _ = load_pretrained(teacher_model_dir(source), dtype=model_settings.dtype,
                                   param_dtype=model_settings.param_dtype,
                                   shardings=shardings,
                                   untie_word_embeddings=model_settings.untie_word_embeddings)
        params = nnx.state(model)
    want, got = _shapes(policy_params), _shapes(params)
    if want != got:
        differ = sorted(set(want) ^ set(got)) or [k for k in want if want[k] != got[k]]
        raise ConfigError(f"{field}: not the policy's shapes ({len(got)} parameters against "
                          f"{len(want)}; first difference {differ[0]}); a seat model must "
                          "have the policy's architecture")
    # The policy's leaf types and placement: the sampler's programs take these params.
    return jax.tree.map(lambda mine, ref: jax.device_put(mine.astype(ref.dtype),
                                                         ref.sharding), params, policy_params)
