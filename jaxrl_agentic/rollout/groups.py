"""Environment groups: which episodes a pipeline step (or an evaluation) plays.

An env manager runs `num_env_groups × group_size` episodes. All members of a group start
from the same seed, hence the same map, so group-relative advantages compare like with like.
Groups are split across env tags by `num_groups_partition` (default: evenly).

Seeds are disjoint by construction: training groups use even seeds 2·(cursor + g), where the
cursor advances by `num_env_groups` every pipeline step (it is checkpointed), and validation
uses odd seeds 2·g + 1 — held-out maps the policy never trained on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play: which seed (map) and which group it belongs to."""

    seed: int
    group_id: int
    member: int  # index within the group (members share the map, not the dynamics noise)


@dataclasses.dataclass(frozen=True)
class EnvManagerConfig:
    num_env_groups: int
    group_size: int
    tags: tuple[str, ...]
    num_groups_partition: tuple[int, ...] = ()

    def __post_init__(self):
        # "<field>: <why>", the typed configs' error format (run_config.py).
        for field in ("num_env_groups", "group_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: must be an integer >= 1, got {value!r}")
        if not self.tags:
            raise ValueError("tags: must name at least one env in custom_envs")
        if self.num_groups_partition and (
                len(self.num_groups_partition) != len(self.tags)
                or sum(self.num_groups_partition) != self.num_env_groups):
            raise ValueError(f"num_groups_partition: needs one entry per tag summing to "
                             f"num_env_groups={self.num_env_groups}, got "
                             f"{self.num_groups_partition} for tags {self.tags}")

    def groups_per_tag(self) -> tuple[int, ...]:
        if self.num_groups_partition:
            return tuple(self.num_groups_partition)
        base, extra = divmod(self.num_env_groups, len(self.tags))
        return tuple(base + (i < extra) for i in range(len(self.tags)))

    @property
    def num_episodes(self) -> int:
        return self.num_env_groups * self.group_size


def plan_episodes(
    manager: EnvManagerConfig, *, split: str, cursor: int = 0
) -> dict[str, list[EpisodeSpec]]:
    """Episodes per tag; group ids are unique across tags within one call."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    plan: dict[str, list[EpisodeSpec]] = {}
    group = 0
    for tag, n_groups in zip(manager.tags, manager.groups_per_tag(), strict=True):
        episodes = plan.setdefault(tag, [])
        for _ in range(n_groups):
            seed = 2 * (cursor + group) if split == "train" else 2 * group + 1
            episodes.extend(EpisodeSpec(seed=seed, group_id=group, member=m)
                            for m in range(manager.group_size))
            group += 1
    return plan


def tags_in_order(plan: dict[str, Sequence[EpisodeSpec]]) -> list[str]:
    return [tag for tag, episodes in plan.items() if episodes]
