"""`"model:<path>"` seats (`pipeline/opponents.py`): another model's params, read into the
policy's tree, dtypes and shardings; another tokenizer or other shapes are one config
error naming the seat; a missing path is one at validation."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic.config import ConfigError
from jaxrl_agentic.envs.python_env import make_python_env
from jaxrl_agentic.models import load_pretrained
from jaxrl_agentic.pipeline.opponents import load_seat_model
from jaxrl_agentic.rollout.snapshots import PolicySnapshots
from jaxrl_agentic.run_config import ModelSettings
from jaxrl_agentic.runtime.parallel import make_mesh


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    model, tok = load_pretrained(tiny_model_dir, untie_word_embeddings=True)
    return nnx.state(model), tok


def test_a_seat_model_is_read_into_the_policys_tree(policy, tiny_model_dir):
    params, tok = policy
    mesh = make_mesh(devices=jax.local_devices()[:1])
    settings = ModelSettings(untie_word_embeddings=True)
    seat = load_seat_model(f"model:{tiny_model_dir}", params, settings, mesh, tok)
    assert jax.tree.structure(seat) == jax.tree.structure(params)
    for mine, ref in zip(jax.tree.leaves(seat), jax.tree.leaves(params), strict=True):
        assert mine.dtype == ref.dtype and mine.sharding == ref.sharding
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(ref))  # the same weights
    pool = PolicySnapshots.for_kinds(["policy", f"model:{tiny_model_dir}"])
    assert not pool.recording  # no frozen seat: no policy version is copied
    pool.add_model(f"model:{tiny_model_dir}", seat)
    assert pool.params_for(f"model:{tiny_model_dir}")[0] == -1


def test_other_shapes_or_tokenizer_are_one_config_error(policy, tiny_model_dir, tiny_tools_dir):
    params, tok = policy
    mesh = make_mesh(devices=jax.local_devices()[:1])
    with pytest.raises(ConfigError, match="not the policy's shapes") as e:  # a tied head
        load_seat_model(f"model:{tiny_model_dir}", params, ModelSettings(), mesh, tok)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="has another tokenizer than the student"):
        load_seat_model(f"model:{tiny_tools_dir}", params, ModelSettings(), mesh, tok)


def test_a_seat_model_that_does_not_exist_is_one_error(tmp_path):
    with pytest.raises(ValueError, match="^seats: 'model:.*': no such model directory"):
        make_python_env("textarena:TicTacToe-v0",
                        seats=("policy", f"model:{tmp_path / 'nothing'}"))
