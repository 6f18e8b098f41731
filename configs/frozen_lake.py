"""FrozenLake 4×4 with the tiny default model: turn-level GRPO on shaped rewards,
trajectory-wise samples; the model generates only the action token.

    python -m jaxrl_agentic.train --config configs/frozen_lake.py
"""

from jaxrl_agentic.config import default_config, env_manager, env_spec


def get_config():
    c = default_config()
    c.exp_name = "frozen_lake"
    c.pretrain = "tiny"
    # Each move is judged by the shaped rewards of the next turn or two (γ_s = 0.5), relative
    # to the other moves on the same map: its advantages correlate 0.73 with an oracle's
    # move quality, episode-level GRPO's 0.26.
    c.adv_estimator = "turn_grpo"
    c.step_reward_gamma = 0.5
    # The reply is `<answer>ACTION</answer>`, but the model generates only ACTION (one token,
    # `max_tokens_per_step=1`): the tags are context and parser text. Generated format
    # tokens around the decision stopped policy-gradient learning in
    # scripts/analysis/probe_reply_format.py and in every earlier run of this recipe.
    c.reply_prefix = "<answer>"
    c.reply_suffix = "</answer>"
    c.sample_mode = "trajectory"
    c.max_steps = 200
    c.save_steps = 25
    c.eval_steps = 10
    c.learning_rate = 1e-3
    c.lr_scheduler_type = "cosine"
    c.warmup_steps = 5
    c.min_lr_ratio = 0.1
    c.mini_batch_size = 16
    # One JAX device per core, the rows split over them: the tiny model's programs keep
    # about one core busy each. On 2 cores a pipeline step took 8.7 s instead of 12.3 s
    # (learner 5.7 s instead of 9.1 s), and seeds 0-4 reached 0.8 within 20 minutes four
    # times of five instead of three (docs/benchmarks.md, "One CPU device per core",
    # "Learning across seeds"). No effect on GPU/TPU.
    c.mesh.cpu_devices = 0
    # A KL penalty towards the warmed model (≈ uniform over the four actions) keeps the
    # policy from saturating once it heads for the goal. Saturated (p ≈ 0.98), a move's
    # policy gradient scales with 1 − p, and the hole words in the hint were never learned:
    # at β = 0.05 the greedy move was a function of the goal directions alone, into the
    # hole 20% of the time a safe way existed. β = 0.15 keeps entropy ~0.3 and the policy
    # learns to read the holes (4%): scripts/analysis/frozen_lake_decisions.py.
    c.init_kl_coef = 0.15
    # Attention is dense within a packed row, so shorter rows cost less per real token
    # (512-token rows: ~25% less train time per token than 1024). A 6-turn episode is
    # under 400 tokens.
    c.max_input_length = 480
    c.sequence_length = 512
    c.micro_batch_max_tokens = 512
    c.generation.temperature = 1.0
    # The tiny model ties its input embedding to its output head; untied (the head starts as
    # a copy of the embedding) the stall lifted: eval success at step 200 on seed 0 went
    # from 0.59 (tied) to 0.75, and seed 1 ended at 0.81 (both with hole penalty 1). Seed
    # sweep figures: docs/benchmarks.md, "Learning across seeds".
    c.untie_word_embeddings = True
    # Teach the reply format first (random valid actions), so RL teaches the policy.
    c.format_warmup.steps = 40
    c.format_warmup.learning_rate = 2e-3
    # Shaped rewards: ±0.5 per step towards/away from the goal, −2 for a hole, −1 for an
    # invalid reply, −0.5 for walking into the edge (without it, shaping paid a blocked player
    # more for waiting against the edge than for a detour: 30 of 39 eval failures were such
    # timeouts); success is still only reaching the goal. Short hints: docs/environments.md.
    # The hole penalty was 1: a step towards the goal into a hole then paid +0.5 − 1 = −0.5,
    # no worse than a step away from the goal, and policies that plateaued at 0.6–0.75 had
    # learned the goal directions but not the holes (scripts/analysis/
    # frozen_lake_decisions.py: 22% of the moves next to a hole went into it, on the first
    # turn as on later ones). At 2, seed 0 first reached 0.8 at step 60 instead of never,
    # and seed 2 at step 130; seed 1 still plateaued near 0.75, which the denser training
    # maps below lifted.
    c.custom_envs = {"frozen_lake": env_spec("frozen_lake", max_turns=6, max_tokens_per_step=1,
                                             format_penalty=1.0, cell_separator=" ", hints=True,
                                             hint_style="short", progress_reward=0.5,
                                             hole_penalty=2.0, bump_penalty=0.5,
                                             brief_instructions=True)}
    # Training maps have more holes than the held-out ones (p_frozen 0.7 instead of 0.8), so
    # more of the moves in a batch are the ones that decide success: a goal direction with a
    # hole in it. On the standard maps seed 1 had learned "step aside when a hole is near"
    # and plateaued at 0.73-0.77 (goal Down, hole beside: Left 28 of 35 times); on denser
    # training maps it first reached 0.8 at step 60. With them seeds 0-4 first reached 0.8
    # at steps 100, 60, 130, 150 and 30, and ended at 0.83-0.91 (one core each, stop 39's
    # build); with two cores and one device per core (stop 43), seeds 0, 1, 2, 4 reached
    # 0.8 within 20 minutes and seed 3 plateaued at 0.58-0.77 (docs/benchmarks.md,
    # "Learning across seeds").
    # Eval success is measured on the standard maps: the override is the train manager's,
    # not the tag's.
    # 16 maps of 4 episodes a step instead of 8 of 8 (the same 64 episodes, so the same
    # cost): turn_grpo judges a move by its shaped turn returns against every turn on its
    # map, which 4 episodes estimate as well as 8, while the rare moves that decide success
    # (a goal direction with a hole in it) come from twice as many distinct boards. Seed 3,
    # which plateaued at 0.58-0.77 for 140 steps with 8 x 8, first reached 0.8 at step 30;
    # seeds 0-4 reached it at steps 40, 30, 100, 30, 50 (3.9-9.9 minutes on 2 cores)
    # instead of 100, 50, 170, never, 60 (docs/benchmarks.md, "Learning across seeds").
    c.train_env_manager = env_manager(num_env_groups=16, group_size=4, tags=("frozen_lake",),
                                      env_config={"p_frozen": 0.7})
    # 64 held-out maps: the standard error of eval/success near 0.75 is 0.054 (0.077 at 32).
    c.val_env_manager = env_manager(num_env_groups=64, group_size=1, tags=("frozen_lake",))
    return c
