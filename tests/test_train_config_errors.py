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
    (["--config.mesh.data=3"], "config.mesh: mesh {'data': 3, 'fsdp': 1, 'tensor': 1} needs 3"),
    (["--config.mesh.sampler_devices=1"], "config.mesh: mesh.sampler_devices=1: must be 0"),
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
