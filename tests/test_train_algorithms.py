"""The losses, filters and off-policy corrections of docs/algorithms.md train end to end:
two steps of the default recipe (at test size) through the CLI, each run combining several
variants, with finite metrics and the collapse diagnostics logged."""

import glob
import math
import os

import pytest

from jaxrl_agentic import train
from tests.test_train import read_metrics, tiny_overrides

VARIANTS = {
    "gspo_dapo_sequence_tis": [
        "--config.policy_loss=gspo", "--config.pg_clip_high=0.28",
        "--config.dynamic_sampling=True", "--config.dynamic_sampling_max_rounds=2",
        # the recipe's one-token replies (the tag is context): valid actions without the
        # format warm-up, so returns differ within groups
        "--config.custom_envs.frozen_lake.max_tokens_per_step=1",
        "--config.recompute_old_logprobs=True", "--config.tis_imp_ratio_cap=2.0",
        "--config.tis_level=sequence", "--config.tis_mode=mask",
    ],
    "cispo_dr_grpo_geometric_tis_top_k": [
        "--config.policy_loss=cispo", "--config.pg_clip_high=0.28",
        "--config.loss_reduction=seq_mean_token_sum_norm",
        "--config.recompute_old_logprobs=True", "--config.tis_imp_ratio_cap=1.5",
        "--config.tis_level=geometric", "--config.generation.top_k=20",
        "--config.logprob_under_sampling_filter=True",
        "--config.overlong_filter=True", "--config.overlong_penalty_length=4",
    ],
}
# Logged every step, and by every step that updates (a step whose samples were all
# filtered, or whose groups all lack reward variance, has nothing to update on).
DIAGNOSTICS = ("batch/group_reward_std", "batch/zero_variance_groups",
               "batch/distinct_replies_per_group")
UPDATE_METRICS = ("actor/pg_loss", "actor/entropy", "actor/clipfrac_low", "actor/clipfrac_high",
                  "actor/ratio", "off_policy/tis_weight_mean", "off_policy/tis_weight_max",
                  "off_policy/tis_capped_frac")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_trains_two_steps_with_finite_metrics(variant, tmp_path):
    out = str(tmp_path / "out")
    assert train.main(["train", *tiny_overrides("frozen_lake", out), *VARIANTS[variant]]) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert all(math.isfinite(v) for v in r.values()), r
        for key in DIAGNOSTICS:
            assert key in r, key
    updated = [r for r in records if "actor/pg_loss" in r]
    assert updated, "no step updated the policy"
    for key in UPDATE_METRICS:
        assert key in updated[0], key
    for r in records:
        if "--config.dynamic_sampling=True" in VARIANTS[variant]:
            assert 1 <= r["batch/dynamic_sampling_rounds"] <= 2
            assert r["batch/groups_kept"] <= 2 <= r["batch/groups_played"]
        if "--config.overlong_filter=True" in VARIANTS[variant]:
            assert "batch/overlong_filtered" in r and "batch/overlong_penalty_mean" in r
    # The most common replies reach TensorBoard as text (the tag is stored in the event).
    events = glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
    assert any(b"batch/common_replies" in open(e, "rb").read() for e in events)
