"""Self-play on TextArena's TicTacToe with the tiny default model on CPU, evaluated against a
random opponent (`envs/textarena_games.py`, `rollout/seats.py`).

    pip install -e ".[envs]"
    python -m jaxrl_agentic.train --config configs/textarena_selfplay.py

Training: both seats of every game are the policy (`seats=("policy", "policy")`, the
default of a two-player id), each seat in its own conversation, with TextArena's zero-sum
reward (+1 win, −1 loss, 0 draw) on its last turn; GRPO's baseline is per seat (a seat
against the same seat of its group's games: role-conditioned, as SPIRAL's RAE), so the
first mover's edge is not credited to its moves. Evaluation, on held-out games, the policy
in seat 0 on even groups and in seat 1 on odd ones (`alternate_seats`): 24 against the
policy as the run started (`frozen:start`, the warmed model; tag `vs_start`) and 24 against
`random` (a random move among those the board lists; tag `vs_random`): `eval/<tag>/win_rate`,
`draw_rate`, `loss_rate`, `seat0/win_rate`, `seat1/win_rate`, `invalid_moves`.

Why TicTacToe: a game is short (at most 5 moves a seat, ~1,500 tokens of a seat's
conversation with the tiny model's tokenizer), every observation lists the legal moves
(`Available Moves: '[0]', '[4]'`), so the random opponent is exact and a move is one digit,
and an untrained policy against random is measurable (a random mover wins ~0.58 of its games
as seat 0 and ~0.29 as seat 1). The reply is that digit: the brackets are context
(`reply_prefix="["`, `reply_suffix="]"`) and `max_tokens_per_step=1`, as the single-player
TextArena recipe does. The format warm-up plays seat 0 against random with a random legal
move of each board (`textarena_games.random_listed_move_policy`): the warmed policy reads
the listing before it moves. Another two-player game is one override,
`--config.env_id=textarena:KuhnPoker-v0` (its moves are words: the one-token reply budget
is TicTacToe's own, 8 elsewhere); it is not tuned here.
"""

from jaxrl_agentic.config import env_manager, env_spec, env_specific_settings, tiny_grpo_recipe

GAME = "textarena:TicTacToe-v0"
EVAL_SEATS = {"vs_start": ("policy", "frozen:start"), "vs_random": ("policy", "random")}


def get_config():
    c = tiny_grpo_recipe("textarena_selfplay", "[", "]")
    c.max_steps = 60
    c.eval_steps = 10
    # Every 10 steps, all kept: the Elo table (scripts/analysis/selfplay_elo.py) reads them.
    c.save_steps, c.save_total_limit = 10, 0
    c.eval_before_training = True  # step 0: the warmed policy against random
    # Sampled evaluation: greedy, a policy that prefers one cell plays it on every board.
    c.eval_temperature = 1.0
    # A seat's conversation: ~420 tokens of instructions and board, ~250 a move after.
    c.max_input_length = 2296  # + 8 tokens of a word move (another game)
    c.sequence_length = 2304
    c.micro_batch_max_tokens = 4608
    # A seat makes at most 5 valid moves and as many forgiven invalid ones.
    game = dict(max_turns=10, max_tokens_per_step=1, env_backend="python")
    c.custom_envs = {"game": env_spec(GAME, **game),
                     **{tag: env_spec(GAME, **game, seats=seats, alternate_seats=True)
                        for tag, seats in EVAL_SEATS.items()}}
    for tag in c.custom_envs:  # TicTacToe's move is one digit; another game's is a word
        env_specific_settings(c, tag, {f"custom_envs.{tag}.max_tokens_per_step": 8})
    # 8 games a step in 2 groups of 4: 16 seat trajectories, each seat's GRPO group of 4.
    c.train_env_manager = env_manager(num_env_groups=2, group_size=4, tags=("game",))
    c.mini_batch_size = 16
    c.val_env_manager = env_manager(num_env_groups=48, group_size=1, tags=tuple(EVAL_SEATS))
    return c
