"""reasoning-gym tasks with the tiny default model on CPU: one dataset item per episode, the
dataset's own `score_answer` as the reward (`envs/reasoning_gym_env.py`).

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/reasoning_gym.py
    python -m jaxrl_agentic.train --config configs/reasoning_gym.py \
        --config.env_id=reasoning_gym:leg_counting \
        --config.custom_envs.task.env_config.dataset_config='{}'

`env_id` picks the dataset (`reasoning_gym:<name>`; an unknown name is a one-line config
error listing close matches) and `dataset_config` its parameters. The default is one-digit
addition, subtraction and multiplication of two terms ("Calculate 4 - 1."), where a tiny
model can learn: the answer is one or two tokens, written between `<answer>` tags given as
context. Training and held-out items come from disjoint episode seeds (held-out seeds may
repeat a question: this small task has 360).
"""

from jaxrl_agentic.config import env_manager, env_spec, tiny_grpo_recipe

SMALL_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                    "operators": ("+", "-", "*"), "allow_parentheses": False,
                    "allow_negation": False}


def get_config():
    c = tiny_grpo_recipe("reasoning_gym", "<answer>", "</answer>")
    c.max_input_length = 256
    c.sequence_length = 320
    c.micro_batch_max_tokens = 512
    c.custom_envs = {"task": env_spec(
        "reasoning_gym:basic_arithmetic", max_turns=1, max_tokens_per_step=4,
        format_penalty=0.1, env_backend="python", dataset_config=SMALL_ARITHMETIC)}
    c.train_env_manager = env_manager(num_env_groups=16, group_size=4, tags=("task",))
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("task",))
    return c
