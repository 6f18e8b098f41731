"""A self-play step trains one trajectory per policy seat: the LR schedule's chunk estimate
is sized from both seats' trajectories, not from the games alone."""

from jaxrl_agentic import train
from jaxrl_agentic.pipeline import Pipeline
from jaxrl_agentic.run_config import build_run_config
from tests.test_train import tiny_overrides


def test_self_play_schedules_both_seats_trajectories(tmp_path):
    c = train.parse_config(["train", *tiny_overrides("textarena_selfplay", str(tmp_path))])
    with c.unlocked():  # one game against random beside the self-play tag
        c.custom_envs.vs_random.env_config = {"seats": ("policy", "random")}
        c.train_env_manager.tags = ("game", "vs_random")
    pipeline = Pipeline(build_run_config(c))
    try:
        games = c.train_env_manager.num_env_groups * c.train_env_manager.group_size
        # Groups split over the tags: half self-play (2 trajectories a game), half one seat.
        assert pipeline.trajectories_per_step() == 2 * (games // 2) + games // 2
        assert pipeline.lr_plan.trajectories_per_step == pipeline.trajectories_per_step()
        trajs = pipeline.rollout("train")
        assert len(trajs) == pipeline.trajectories_per_step()
    finally:
        pipeline.close()
