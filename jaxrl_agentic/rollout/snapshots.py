"""Earlier versions of the policy, kept for the frozen seats of two-player games
(`envs/textarena_games.py`: `"frozen:<k>"`, `"frozen:start"`).

    pool = PolicySnapshots(keep=2)
    pool.record(0, params_v0)          # a copy: the learner donates its buffers
    pool.record(1, params_v1); pool.record(2, params_v2); pool.record(3, params_v3)
    pool.params_for("frozen:2")        # -> (1, params_v1): two versions before the newest
    pool.params_for("frozen:start")    # -> (0, params_v0): kept whatever `keep` says

The pool holds the first version recorded (the run's start in this process: the policy
before its first update, or the restored checkpoint of a resumed run) and, when `keep` ≥ 1,
the `keep + 1` newest, each a copy on the devices and with the shardings of the params recorded (the
sampler's), so a frozen seat decodes with the same programs as the policy. A version is
recorded at most once. `"frozen:<k>"` is the newest version recorded minus k; while the run
is younger than k versions, the oldest one kept (the start). Memory: `keep + 2` copies of
the sampler's params at most, one for `"frozen:start"` alone (LoRA: the merged params, base
included).
"""

from __future__ import annotations

import threading
from typing import Any

import jax

from jaxrl_agentic.envs.textarena_games import MODEL, frozen_versions_back, is_opponent_model


def copy_params(params: Any) -> Any:
    """A copy of every array of `params`, on its devices with its sharding."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, params)


class PolicySnapshots:
    """{version: params} of the start and the newest `keep + 1` versions (module doc)."""

    def __init__(self, keep: int):
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = int(keep)
        self._versions: dict[int, Any] = {}
        self._start: int | None = None
        self._models: dict[str, Any] = {}  # "model:<path>" -> its params
        self.recording = True
        self._lock = threading.Lock()  # rollout threads read while the learner records

    @classmethod
    def for_kinds(cls, kinds) -> PolicySnapshots | None:
        """A pool deep enough for seat `kinds` (None when none of them is frozen or another
        model)."""
        if not any(map(is_opponent_model, kinds)):
            return None
        backs = [b for b in map(frozen_versions_back, kinds) if b is not None]
        pool = cls(keep=max(backs, default=0))
        pool.recording = bool(backs)  # other models alone: no policy version is read
        return pool

    def add_model(self, kind: str, params: Any) -> None:
        """The params a `"model:<path>"` seat plays with (loaded by the pipeline)."""
        self._models[kind] = params

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    @property
    def _newest_kept(self) -> int:
        """How many of the newest versions `"frozen:<k>"` seats need: k + 1 (none for
        `"frozen:start"` alone)."""
        return self.keep + 1 if self.keep else 0

    def record(self, version: int, params: Any) -> None:
        """Keeps a copy of `params` as `version` (no-op for a version already kept, or when
        no seat would read it)."""
        version = int(version)
        if not self.recording:
            return
        with self._lock:
            if version in self._versions or (self._start is not None
                                              and not self._newest_kept):
                return
        copy = copy_params(params)
        with self._lock:
            self._versions[version] = copy
            if self._start is None:
                self._start = version
            newest = sorted(v for v in self._versions if v != self._start)
            for old in newest[:max(0, len(newest) - self._newest_kept)]:
                del self._versions[old]

    def params_for(self, kind: str) -> tuple[int, Any]:
        """(version, params) a frozen seat of `kind` plays with (module doc); (−1, its
        params) for a `"model:<path>"` seat."""
        if kind.startswith(MODEL):
            if kind not in self._models:
                raise RuntimeError(f"seat {kind!r}: that model was not loaded")
            return -1, self._models[kind]
        back = frozen_versions_back(kind)
        if back is None:
            raise ValueError(f"{kind!r} is not a frozen seat kind")
        with self._lock:
            if not self._versions:
                raise RuntimeError(f"seat {kind!r}: no policy version recorded yet")
            if back == 0:
                return self._start, self._versions[self._start]
            newest = max(self._versions)
            wanted = newest - back
            older = [v for v in self._versions if v <= wanted]
            version = max(older) if older else min(self._versions)
            return version, self._versions[version]
