"""DAPO's filters (overlong penalty, overlong filter, dynamic sampling) and the collapse
diagnostics of a batch, as methods of :class:`~jaxrl_agentic.pipeline.Pipeline`.

They read the pipeline's ``config``, ``sequence_length``, ``train_manager``, ``cursor``,
``tokenizer``, ``rollout`` and ``informative``: :class:`BatchFilters` is the part of the
pipeline that decides which episodes and tokens a step trains on, kept apart from the
step's data flow (``pipeline.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_agentic.algos import diagnostics, filters
from jaxrl_agentic.pipeline.metrics import whole_episodes


class BatchFilters:
    """The step's filters and diagnostics; mixed into ``Pipeline``."""

    def overlong_penalties(self, traj) -> np.ndarray:
        """DAPO's soft overlong punishment of each turn of ``traj``
        (``algos/filters.overlong_penalty``), L_max = the tag's ``max_tokens_per_step``."""
        a = self.config.advantages
        return filters.overlong_penalty(
            [len(u.generated) for u in traj.turns],
            self.config.envs[traj.tag].max_tokens_per_step,
            overlong_penalty_length=a.overlong_penalty_length,
            overlong_penalty=a.overlong_penalty)

    def shape_rewards(self, trajs) -> None:
        """Adds :meth:`overlong_penalties` to each turn's reward (``overlong_penalty_length``
        0 = off). The env metrics (success, return) keep the true rewards; advantages see
        these."""
        if self.config.advantages.overlong_penalty_length:
            for t in trajs:
                for turn, p in zip(t.turns, self.overlong_penalties(t), strict=True):
                    turn.reward += float(p)

    def overlong_penalty_metrics(self, trajs) -> dict[str, float]:
        """``batch/overlong_penalty_mean``: the mean penalty per reply over all episodes
        played (every dynamic-sampling round)."""
        if not self.config.advantages.overlong_penalty_length:
            return {}
        penalties = [p for t in trajs for p in self.overlong_penalties(t)]
        return {"batch/overlong_penalty_mean": float(np.mean(penalties)) if penalties else 0.0}

    def fill_informative_groups(self, trajs) -> tuple[list, list, int]:
        """DAPO's dynamic sampling → (kept trajectories, all played, rounds played).

        A group carries signal as :meth:`informative` says (the estimator's advantages).
        While fewer than ``num_env_groups`` groups carry signal and fewer than
        ``dynamic_sampling_max_rounds`` rounds were played, one more round of
        ``num_env_groups`` new groups (the next seeds) is played with the same params;
        then the first ``num_env_groups`` informative groups are kept. If the rounds run
        out, the step trains on the informative groups it has (none: no update).
        """
        needed = self.train_manager.num_env_groups
        informative = self.informative
        played, kept, rounds = list(trajs), informative(trajs), 1
        while len({t.group_id for t in kept}) < needed and \
                rounds < self.config.rollout.dynamic_sampling_max_rounds:
            more = self.rollout("train", cursor=self.cursor + rounds * needed,
                                round_index=rounds)
            self.shape_rewards(more)
            played += more
            kept += informative(more)
            rounds += 1
        first = set(sorted({t.group_id for t in kept})[:needed])
        return [t for t in kept if t.group_id in first], played, rounds

    def filter_overlong(self, trajs, samples) -> tuple[list, float]:
        """DAPO's overlong filter → (samples with loss, number filtered).

        A sample is truncated when the reply that ends it was cut: that turn stopped at the
        generation budget without EOS or a stop string, or the episode then ended because
        the next prompt would exceed ``max_input_length``, or the sample is longer than
        ``sequence_length`` (the learner would cut it). Its loss mask becomes 0
        (``filters.mask_truncated``), and a sample without loss tokens is left out of the
        batch, where it would only cost compute.
        """
        if not samples:
            return samples, 0.0
        by_id = {t.traj_id: t for t in trajs}
        reasons, prompt_cut = [], []
        for s in samples:
            traj = by_id[s.traj_id]
            last = max(k for k, u in enumerate(traj.turns) if u.context_len < len(s.tokens))
            reasons.append(traj.turns[last].stop_reason)
            prompt_cut.append(traj.truncated_by_length and last == len(traj.turns) - 1)
        cut = filters.truncated_samples(reasons, total_lengths=[len(s.tokens) for s in samples],
                                        sequence_length=self.sequence_length)
        cut |= np.asarray(prompt_cut, bool)
        masks = filters.mask_truncated([s.loss_mask for s in samples], cut)
        kept = [dataclasses.replace(s, loss_mask=m) for s, m in zip(samples, masks, strict=True)
                if m.sum() > 0]
        return kept, float(cut.sum())

    def collapse_metrics(self, trajs) -> dict[str, float]:
        """``batch/group_reward_std``, ``batch/zero_variance_groups`` (of the episode
        scores the advantages see) and ``batch/distinct_replies_per_group`` (an episode's
        replies as one token tuple) over the episodes played (``algos/diagnostics.py``); an
        episode in segments is one (``whole_episodes``)."""
        played = [t for t in whole_episodes(trajs) if t.turns]
        groups = [t.group_id for t in played]
        replies = [tuple(tok for u in t.turns for tok in (*u.generated, -1)) for t in played]
        return {**diagnostics.group_reward_metrics([t.score for t in played], groups),
                **diagnostics.distinct_replies_per_group(replies, groups)}

    def common_replies_text(self, trajs, top_n: int = 5) -> str:
        """The most frequent single replies of `trajs`, decoded (TensorBoard text)."""
        replies = [u.generated for t in trajs for u in t.turns]
        return diagnostics.most_common_replies_text(replies, top_n, self.tokenizer.decode)
