"""A table of bad configs and inputs, each with its expected one-line error and exit code 2."""

import pytest

from jaxrl_agentic import train

RECIPE = "configs/frozen_lake.py"

CASES = [
    # (overrides, expected fragment of the one-line error)
    (["--config.no_such_field=1"], "config.no_such_field: unknown field; allowed: adv_estimator, "),
    (["--config.generation.temprature=0.5"],
     "config.generation.temprature: unknown field; did you mean 'temperature'? allowed: "),
    (["--config.custom_envs.frozen_lake.env_config.slippery=True"],
     "config.custom_envs.frozen_lake.env_config.slippery: unknown field; allowed: "),
    (["--config.max_steps=abc"], "max_steps"),
    (["--config.adv_estimator=ppo"], "config.adv_estimator: 'ppo' is not allowed"),
    (["--config.sample_mode=turn"], "config.sample_mode: 'turn' is not allowed"),
    (["--config.loss_reduction=mean"], "config.loss_reduction"),
    (["--config.lr_scheduler_type=step"], "config.lr_scheduler_type"),
    (["--config.format_warmup.lr_schedule=linear"], "config.format_warmup.lr_schedule"),
    (["--config.format_warmup.replies=('<answer>Up</answer>', '')"],
     "config.format_warmup.replies: must be a list of non-empty reply strings"),
    # whole replies, as the environment reads them: the recipe's prefix/suffix included
    (["--config.format_warmup.replies=('Up', 'Left')"],
     "config.format_warmup.replies: 'Up' is not a whole reply: each starts with reply_prefix "
     "'<answer>' and ends with reply_suffix '</answer>', as the environment reads it (e.g. "
     "'<answer>Up</answer>')"),
    (["--config.sample_mode=step", "--config.adv_estimator=gae"], "cannot be broadcast"),
    (["--config.sample_mode=step", "--config.adv_estimator=reinforce_plus_plus"],
     "cannot be broadcast"),
    (["--config.train_env_manager.group_size=1"], "needs group_size >= 2"),
    (["--config.micro_batch_max_tokens=100"], "config.micro_batch_max_tokens: 100 < sequence_len"),
    (["--config.merge_stepwise=True"], "config.merge_stepwise: applies to sample_mode='step'"),
    (["--config.pretrain=/nonexistent/model"], "model directory not found: /nonexistent/model"),
    (["--config.generation.top_p=1.5"], "config.generation.top_p"),
    (["--config.pg_clip=1.5"], "config.pg_clip: must lie in (0, 1)"),
    (["--config.untie_word_embeddings=maybe"], "untie_word_embeddings"),
    (["--config.align_when_free=maybe"], "align_when_free"),
    (["--config.train_env_manager.tags=('lake',)"], "'lake' is not in custom_envs"),
    (["--config.learning_rate=-1"], "config.learning_rate: must be > 0"),
    (["--config.head_learning_rate=-1"], "config.head_learning_rate: must be >= 0"),
    (["--config.loraplus_lr_ratio=4"], "config.loraplus_lr_ratio: scales the LoRA B adapters"),
    (["--config.lora_train_embedding=True"], "config.lora_train_embedding: trains the embedding"),
    (["--config.lora_train_embedding=yes", "--config.lora_rank=4"],
     "lora_train_embedding"),
    (["--config.loraplus_lr_ratio=0", "--config.lora_rank=4"],
     "config.loraplus_lr_ratio: must be > 0"),
    (["--config.max_policy_lag=-1"], "config.max_policy_lag: must be an integer >= 0"),
    (["--config.in_flight_updates=True", "--config.async_generation_ratio=1"],
     "config.in_flight_updates: bounds the policy lag by max_policy_lag"),

    (["--config.dual_clip=0.5"], "config.dual_clip"),
    (["--config.init_kl_coef=0", "--config.target_kl=0.1"],
     "config.target_kl: an adaptive KL coefficient needs"),
    (["--config.mesh.data=3"],
     "config.mesh: mesh {'data': 3, 'fsdp': 1, 'tensor': 1, 'context': 1} needs 3"),
    (["--config.mesh.sampler_devices=1"], "config.mesh: mesh.sampler_devices=1: must be 0"),
    (["--config.mesh.context=3"], "config.micro_batch_max_tokens: a row of"),
    (["--config.mesh.cpu_devices=-1"], "config.mesh.cpu_devices: must be an integer >= 0"),
    (["--config.distributed.coordinator_address=localhost"],
     "config.distributed.coordinator_address: expected 'host:port'"),
    (["--config.distributed.enabled=True", "--config.distributed.num_processes=2"],
     "config.distributed: set num_processes and process_id together"),
    (["--config.distributed.num_processes=2", "--config.distributed.process_id=0"],
     "config.distributed.enabled: coordinator_address/num_processes are set"),
    (["--config.tis_imp_ratio_cap=2.0"], "config.tis_imp_ratio_cap: needs recompute_old_logprobs"),
    (["--config.async_generation_ratio=-1"], "config.async_generation_ratio: must be >= 0"),
    (["--config.custom_envs.frozen_lake.env_backend=ray"],
     "config.custom_envs.frozen_lake.env_backend: 'ray' is not allowed"),
    # trajectory samples are at most max_input_length + max_tokens_per_step long too
    (["--config.sequence_length=470", "--config.micro_batch_max_tokens=512"],
     "config.sequence_length: 470 < max_input_length + max_tokens_per_step of frozen_lake = "
     "481: trajectory samples would be cut"),
    # a Python environment has no JAX form; the env's own backend is the default
    (["--config.custom_envs.frozen_lake.env_type=calculator",
      "--config.custom_envs.frozen_lake.env_backend=jax"],
     "config.custom_envs.frozen_lake.env_backend: 'calculator' is a Python environment"),
    (["--config.cispo_clip_high=0"], "config.cispo_clip_high: must be > 0"),
    (["--config.resume_from_checkpoint=/nonexistent/ckpt", "--config.max_steps=1"],
     "checkpoint not found: /nonexistent/ckpt"),
    # env_id puts another environment on the recipe's tag: its env_config must fit it
    (["--config.env_id=sokoban"],
     "config.custom_envs.frozen_lake.env_config: sokoban: unknown parameter 'hint_style'"),
]

# Ids of other libraries: close matches, and the games that need the network refused.
ENV_ID_CASES = [
    ("configs/textarena.py", "textarena:FrozenLak-v0", "close matches: FrozenLake-v0"),
    ("configs/textarena.py", "textarena:Wordle-v0", "Wordle-v0"),
    ("configs/reasoning_gym.py", "reasoning_gym:basic_arithmetc",
     "reasoning_gym:basic_arithmetic"),
]


@pytest.mark.parametrize("overrides, fragment", CASES)
def test_bad_config_is_one_line_exit_2(overrides, fragment, capsys, tmp_path):
    argv = ["train", f"--config={RECIPE}", f"--config.output_dir={tmp_path}", *overrides]
    assert train.main(argv) == train.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error: ") and fragment in err, err


@pytest.mark.parametrize("recipe, env_id, fragment", ENV_ID_CASES)
def test_an_unknown_id_of_another_library_is_one_line_exit_2(recipe, env_id, fragment, capsys,
                                                             tmp_path):
    argv = ["train", f"--config={recipe}", f"--config.output_dir={tmp_path}",
            f"--config.env_id={env_id}"]
    assert train.main(argv) == train.EXIT_BAD_INPUT
    # The recipe's "devices:" line may come first: the error is one line, the last.
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: config.") and fragment in err, err


def test_missing_config_flag(capsys):
    assert train.main(["train"]) == train.EXIT_BAD_INPUT
    assert "--config is required" in capsys.readouterr().err


def test_missing_recipe_file(capsys):
    assert train.main(["train", "--config=configs/nope.py"]) == train.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nope.py" in err, err


@pytest.mark.parametrize("backend", ["python", "jax"])
def test_the_python_adapters_own_settings_are_not_the_environments(backend):
    """`step_delay_s` (a slow tool stand-in) is a setting of the Python adapter of a JAX
    environment (`python_env.jax_env_factory`), not a parameter of the environment: valid
    with the Python backend, the environment's own unknown-parameter error with the JAX one."""
    from jaxrl_agentic.config import ConfigError, validate

    c = train.parse_config(["train", f"--config={RECIPE}",
                            f"--config.custom_envs.frozen_lake.env_backend={backend}"])
    with c.unlocked():
        c.custom_envs.frozen_lake.env_config.step_delay_s = 0.1
    if backend == "python":
        validate(c)
    else:
        with pytest.raises(ConfigError, match="unknown parameter 'step_delay_s'"):
            validate(c)


# A Python environment of a recipe's own whose factory builder takes any option and hands
# it to the environment's constructor (so that a typo reaches only the episodes).
OWN_ENV_RECIPE = '''
from jaxrl_agentic.config import default_config, env_manager, env_spec
from jaxrl_agentic.envs import register
from jaxrl_agentic.envs.python_env import PyStep, PythonTextEnv, text_state_hash


class Counting(PythonTextEnv):
    max_steps_in_episode = 2

    def __init__(self, *, format_penalty, target=3):
        self.target = target

    def reset(self, seed):
        return "Say a number."

    def step(self, reply):
        return PyStep(observation="again", reward=0.0, terminated=False,
                      action_is_valid=True, action_is_effective=True, success=False)

    def state_hash(self):
        return text_state_hash("s")


def counting(**options):
    return lambda spec, run_seed: Counting(**options)


register("counting_test_env", counting, backend="python", replace=True)


def get_config():
    c = default_config()
    c.pretrain = "tiny"
    c.format_warmup.steps = 0
    c.max_steps = 1
    c.custom_envs = {"count": env_spec("counting_test_env", max_turns=1,
                                       max_tokens_per_step=4, targt=5)}
    c.train_env_manager = env_manager(num_env_groups=1, group_size=2, tags=("count",))
    c.val_env_manager = env_manager(num_env_groups=1, group_size=1, tags=("count",))
    return c
'''

# The calculator (a built-in Python environment) with a typo'd option.
CALCULATOR_TYPO_RECIPE = '''
import os

from jaxrl_agentic.config import recipe_config


def get_config():
    c = recipe_config(os.path.join({root!r}, "configs", "tool_calculator.py"))
    c.custom_envs.calculator.env_config.extra_tool = ("percent_of",)
    return c
'''


@pytest.mark.parametrize("recipe, fragment", [
    (CALCULATOR_TYPO_RECIPE, "config.custom_envs.calculator.env_config: calculator: "),
    (OWN_ENV_RECIPE, "config.custom_envs.count.env_config: counting_test_env: ")],
    ids=["calculator", "own_env"])
def test_a_python_environments_unknown_option_is_one_line_exit_2(recipe, fragment, tmp_path,
                                                                 capsys):
    """Checked by building one environment before anything else starts: not a traceback
    (the calculator), not every episode failing while the run exits 0 (an own factory)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "recipe_with_a_typo.py"
    path.write_text(recipe.replace("{root!r}", repr(root)))
    argv = ["train", f"--config={path}", f"--config.output_dir={tmp_path / 'out'}"]
    assert train.main(argv) == train.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("error: " + fragment), err
    assert "unexpected keyword argument" in err
    if "calculator" in fragment:  # its builder names its options: the closest is shown
        assert err.endswith("'extra_tool'; did you mean 'extra_tools'?"), err
    else:
        assert err.endswith("'targt'"), err
