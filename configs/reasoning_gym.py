"""reasoning-gym tasks with the tiny default model on CPU: one dataset item per episode, the
dataset's own `score_answer` as the reward (`envs/reasoning_gym_env.py`).

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/reasoning_gym.py
    python -m jaxrl_agentic.train --config configs/reasoning_gym.py \\
        --config.env_id=reasoning_gym:basic_arithmetic \\
        --config.custom_envs.task.env_config.dataset_config='{}'

`env_id` picks the dataset (`reasoning_gym:<name>`; an unknown name is a one-line config
error listing close matches) and `dataset_config` its parameters. The default is
`leg_counting` with one animal ("how many legs are there in total if you have 1
grasshopper?"): a short task a random-init tiny model can learn from the reward alone, the
answer one or two tokens between `<answer>` tags given as context, and eight answers in all
(the most common, 6, is right for 29% of the items). The format warm-up answers other items'
answers. Training and held-out items come from disjoint episode seeds; with 37 animals,
held-out seeds repeat the animals seen in training.
"""

from jaxrl_agentic.config import env_manager, env_spec, tiny_grpo_recipe

ONE_ANIMAL = {"min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 1}


def get_config():
    c = tiny_grpo_recipe("reasoning_gym", "<answer>", "</answer>")
    c.max_steps = 300
    c.max_input_length = 256
    c.sequence_length = 320
    c.micro_batch_max_tokens = 512
    c.custom_envs = {"task": env_spec(
        "reasoning_gym:leg_counting", max_turns=1, max_tokens_per_step=4,
        format_penalty=0.1, env_backend="python", dataset_config=ONE_ANIMAL)}
    c.train_env_manager = env_manager(num_env_groups=16, group_size=4, tags=("task",))
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("task",))
    return c
