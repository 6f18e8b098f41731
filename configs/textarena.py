"""TextArena's single-player games with the tiny default model on CPU: the game's own text is
the prompt, the reply its action, its rewards and end the episode's (`envs/textarena_env.py`).

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/textarena.py
    python -m jaxrl_agentic.train --config configs/textarena.py \\
        --config.env_id=textarena:GuessTheNumber-v0 \\
        --config.custom_envs.game.env_config.game_kwargs='{}' \\
        --config.custom_envs.game.max_turns=10 --config.custom_envs.game.max_tokens_per_step=4

`env_id` picks the game (`textarena:<EnvId>`; an unknown id, or one that needs the network
such as Wordle, is a one-line config error; another game takes its own `game_kwargs`, turn
limit and reply length). The default is TextArena's ThreeCardMonte with one shuffle (its
constructor's `steps`): the ball starts under one of three cups, two cups are swapped, and
the reply `[k]` guesses where the ball is (1 for the right cup, 0 otherwise): a small game
whose ~170-token episodes make a step cost about a second, where a random-init tiny model
can learn from the reward alone. The brackets are context; the model writes the digit. A
forgiven invalid guess gets a second turn. Held-out episodes play seeds training never
sees. (TextArena's FrozenLake, 3×3, costs ~510 tokens of instructions and ~240 a move: ~27 s
a step on one core, too slow to learn within minutes.)
"""

from jaxrl_agentic.config import env_manager, env_spec, tiny_grpo_recipe


def get_config():
    c = tiny_grpo_recipe("textarena", "[", "]")
    c.max_steps = 300
    c.max_input_length = 320
    c.sequence_length = 384
    c.micro_batch_max_tokens = 512
    c.custom_envs = {"game": env_spec(
        "textarena:ThreeCardMonte-v0", max_turns=2, max_tokens_per_step=2, format_penalty=0.1,
        env_backend="python", game_kwargs={"steps": 1})}
    c.train_env_manager = env_manager(num_env_groups=16, group_size=4, tags=("game",))
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("game",))
    return c
