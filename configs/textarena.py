"""TextArena's single-player games with the tiny default model on CPU: the game's own text is
the prompt, the reply its action, its rewards and end the episode's (`envs/textarena_env.py`).

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/textarena.py
    python -m jaxrl_agentic.train --config configs/textarena.py \
        --config.env_id=textarena:GuessTheNumber-v0 \
        --config.custom_envs.game.env_config.game_kwargs='{}' \
        --config.custom_envs.game.max_tokens_per_step=4

`env_id` picks the game (`textarena:<EnvId>`; an unknown id, or one that needs the network
such as Wordle, is a one-line config error; another game takes its own `game_kwargs`). The
default is TextArena's FrozenLake on a 3×3 board with 2 holes (its constructor's `size`,
`num_holes`), whose moves are `[up]`, `[down]`, `[left]`, `[right]`: the brackets are context
and the model writes the word (as the FrozenLake recipe's tags). The game allows 100 moves;
its boxed board costs the tiny tokenizer ~510 tokens, then ~240 a move, so 6 moves (4 reach
the goal) fit 1,984 tokens. Held-out episodes play seeds training never sees.
"""

from jaxrl_agentic.config import env_manager, env_spec, tiny_grpo_recipe


def get_config():
    c = tiny_grpo_recipe("textarena", "[", "]")
    c.max_input_length = 1800
    c.sequence_length = 1984
    c.micro_batch_max_tokens = 2048
    c.custom_envs = {"game": env_spec(
        "textarena:FrozenLake-v0", max_turns=6, max_tokens_per_step=2, format_penalty=0.1,
        env_backend="python", game_kwargs={"size": 3, "num_holes": 2})}
    c.train_env_manager = env_manager(num_env_groups=8, group_size=4, tags=("game",))
    c.val_env_manager = env_manager(num_env_groups=32, group_size=1, tags=("game",))
    return c
