"""One pipeline step, as data flows (see docs/architecture.md):

    rollout (all env tags) → advantages → samples (+ prefix merge) → learner updates

`Pipeline` holds the long-lived pieces — sampler, rollout runners, learner (and critic), the
learning-rate plan with its chunk estimate, the env-group seed cursor — and exposes
`train_step()`,
`evaluate()` and a checkpointable `host_state()`. Everything random is derived from the
run seed and the step number, or lives in the learner's state, so a run restored from a
checkpoint continues exactly.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_agentic.algos import advantages as adv
from jaxrl_agentic.algos import filters
from jaxrl_agentic.algos.estimators import (
    get_advantage_estimator,
    turn_advantages,
)
from jaxrl_agentic.algos.kl import kl_estimate
from jaxrl_agentic.algos.schedules import ChunkEstimator, LearningRatePlan
from jaxrl_agentic.config import ConfigError
from jaxrl_agentic.data import updates_per_step
from jaxrl_agentic.data.samples import build_samples, trajectory_sample
from jaxrl_agentic.data.trajectory import stamp_versions
from jaxrl_agentic.envs.textarena_games import MODEL
from jaxrl_agentic.models import load_pretrained, lora
from jaxrl_agentic.models.hf_io import read_model_config
from jaxrl_agentic.pipeline.batch_filters import BatchFilters
from jaxrl_agentic.pipeline.distillation import distill, load_teacher, teacher_model_config
from jaxrl_agentic.pipeline.metrics import mean_of, trajectory_metrics, version_lag_metrics
from jaxrl_agentic.pipeline.opponents import load_seat_model
from jaxrl_agentic.pipeline.run_checks import (
    check_python_env_options,
    check_same_model_everywhere,
)
from jaxrl_agentic.pipeline.run_plan import max_total_len, run_memory_plan
from jaxrl_agentic.pipeline.samples import token_estimator_samples
from jaxrl_agentic.rollout.conversation import ChatFormatter
from jaxrl_agentic.rollout.groups import plan_episodes
from jaxrl_agentic.rollout.producer import RolloutProducer
from jaxrl_agentic.rollout.runner import make_runner
from jaxrl_agentic.rollout.snapshots import PolicySnapshots, copy_params
from jaxrl_agentic.run_config import as_run_config
from jaxrl_agentic.runtime import memory_plan as plans
from jaxrl_agentic.runtime import timing
from jaxrl_agentic.runtime.parallel import (
    SamplerPlacement,
    allgather_objects,
    make_mesh,
    param_partition_spec,
    process_share,
)
from jaxrl_agentic.sampling import Sampler, make_sampler_backend
from jaxrl_agentic.training.critic import Critic
from jaxrl_agentic.training.learner import Learner, full_params
from jaxrl_agentic.training.off_policy import comparable_masks


class Pipeline(BatchFilters):
    """``config``: the run's :class:`RunConfig` (a flat ``ConfigDict`` is mapped onto it
    once, here). ``devices``: the learner's devices (default: all, less any reserved for the
    sampler by ``mesh.sampler_devices``); tests pass a subset to compare meshes in one
    process. ``run_policy``: how a distillation teacher or a seat model that is a training
    run is restored (``run_loading.run_policy``; the entry points pass it)."""

    def __init__(self, config, *, model_dir: str | None = None, devices=None, log=print,
                 run_policy=None):
        self.config = cfg = as_run_config(config)
        self.log, self._run_policy = log, run_policy
        check_python_env_options(cfg)  # before any weight is read: a typo costs no start-up
        if model_dir is None:
            from jaxrl_agentic.warmup import check_warmup_replies

            check_warmup_replies(cfg)
        try:  # the device count is only known now: a mismatch is still a config error
            self.placement = SamplerPlacement(cfg.mesh.sampler_devices, learner_devices=devices)
            self.mesh = mesh = make_mesh(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp,
                                         tensor=cfg.mesh.tensor, context=cfg.mesh.context,
                                         devices=self.placement.learner_devices)
        except ValueError as e:
            raise ConfigError(f"config.mesh: {e}") from None
        self.train_manager = cfg.train.manager
        self.val_manager = cfg.val.manager
        rollout = cfg.rollout
        self.memory_plan = self._memory_plan(model_dir or cfg.model.directory())
        log(self.memory_plan.table())
        if self.memory_plan.total > plans.MALLOC_RELEASE_SHARE * self.memory_plan.budget:
            plans.return_freed_memory_to_os()  # before any weight is read (runtime/memory_plan.py)
        try:  # before any weight is read or warmed up: a state that cannot fit fails now
            plans.check_memory_plan(self.memory_plan, warn=log)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None
        if model_dir is None:
            model_dir = cfg.model.directory()
            if cfg.format_warmup.steps > 0:
                from jaxrl_agentic.warmup import warmed_model_dir

                model_dir = warmed_model_dir(model_dir, cfg)
        self.model_dir = model_dir
        if jax.process_count() > 1:
            check_same_model_everywhere(model_dir)

        def shardings(path, shape):  # parameters are read straight into their shards
            return NamedSharding(mesh, param_partition_spec(path, shape, mesh.shape))

        model, tokenizer = load_pretrained(model_dir, dtype=cfg.model.dtype,
                                           param_dtype=cfg.model.param_dtype,
                                           shardings=shardings,
                                           untie_word_embeddings=cfg.model.untie_word_embeddings)
        if cfg.model.lora.enabled:  # adapters on the loaded weights; the base stays frozen
            lora.add_lora(model, cfg.model.lora, seed=cfg.run.seed)
        self.tokenizer = tokenizer
        self.formatter = ChatFormatter(tokenizer, system_prompt=rollout.system_prompt or None,
                                       reply_prefix=rollout.reply_prefix,
                                       reply_suffix=rollout.reply_suffix)
        # The learner's start (the sampler reads the same arrays): under LoRA the adapters,
        # trained, and the rest, frozen.
        if cfg.model.lora.enabled:
            self.graphdef, params, frozen = lora.split_trainable(model)
        else:
            (self.graphdef, params), frozen = nnx.split(model), None
        self.sampler = make_sampler_backend(
            rollout.sampler_backend, model, tokenizer, max_total_len=max_total_len(cfg),
            mesh=mesh if self.placement.colocated else self.placement.mesh,
            logprob_under_filter=rollout.logprob_under_sampling_filter,
            precompile_slots=rollout.precompile)
        if isinstance(self.sampler, Sampler):  # a group's first prompt: prefilled once
            self.sampler.share_prompt_prefill = cfg.learner.packing.share_group_prefix
        if rollout.batching == "continuous" and not isinstance(self.sampler, Sampler):
            field, fix = (("in_flight_updates", "leave it False") if rollout.in_flight_updates
                          else ("rollout_batching", "use 'turn'"))
            raise ConfigError(f"config.{field}: 'continuous' decodes through the JAX "
                              f"sampler's slot programs; sampler_backend "
                              f"{rollout.sampler_backend!r} is not a Sampler; {fix}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.config = cfg = cfg.with_pad_token_id(pad_id)
        self.learner_cfg = cfg.learner
        self.critic = None
        if cfg.critic is not None:  # from the policy's backbone
            self.critic = Critic(self.graphdef, full_params(params, frozen), cfg.critic, mesh)
        self.teacher = (load_teacher(cfg.distillation, self.learner_cfg, mesh, tokenizer,
                                     run_policy=run_policy, log=log)
                        if cfg.distillation.enabled else None)
        self.learner = Learner(self.graphdef, params, self.learner_cfg, mesh, frozen=frozen,
                               teacher=self.teacher if cfg.distillation.dense else None)
        self.sampler.set_params(None)  # the learner owns the params from here on
        # One runner per tag with the tag's own env_config; a manager that overrides env
        # parameters (`env_manager(env_config=...)`) gets its own runners for its tags.
        self.runners = {tag: self.build_runner(tag, dict(env.env_config))
                        for tag, env in cfg.envs.items()}
        self.split_runners = {}
        for split in ("train", "val"):
            runners = self.split_runners[split] = {}
            for tag in cfg.split(split).manager.tags:
                if not cfg.split(split).env_config:
                    runners[tag] = self.runners[tag]
                    continue
                try:
                    runners[tag] = self.build_runner(tag, cfg.split_env_config(split, tag))
                except ValueError as e:  # an unknown or invalid parameter, named by make()
                    raise ConfigError(f"config.{split}_env_manager.env_config: {e}") from None
        self.snapshots = self._attach_snapshots()
        schedule = cfg.schedule
        self.lr_plan = LearningRatePlan(
            learning_rate=schedule.learning_rate, lr_scheduler_type=schedule.lr_scheduler_type,
            warmup_steps=schedule.warmup_steps, min_lr_ratio=schedule.min_lr_ratio,
            max_steps=cfg.run.max_steps, ppo_epochs=cfg.learner.ppo_epochs,
            trajectories_per_step=self.trajectories_per_step(),
            mini_batch_size=cfg.learner.mini_batch_size,
            chunks=ChunkEstimator.from_config(schedule.estimated_chunks_per_traj,
                                              cfg.advantages.sample_mode, cfg.max_turns))
        self.step = 0
        self.cursor = 0
        self.producer = None  # rollouts made ahead in threads (async or in-flight)
        for field in ("async_generation_ratio", "in_flight_updates"):
            if getattr(rollout, field) and jax.process_count() > 1:
                # Threads issuing collectives in a different order on each host deadlock.
                raise ConfigError(f"config.{field}: not supported with several processes "
                                  "(distributed.enabled)")

    def trajectories_per_step(self) -> int:
        """Trajectories one step's rollout gives: an episode's, or one per policy seat of a
        two-player game (self-play: two), which the schedule's chunk estimate counts."""
        plan = plan_episodes(self.train_manager, split="train", cursor=0)
        return sum(len(episodes) * getattr(self.split_runners["train"][tag],
                                           "trajectories_per_episode", 1)
                   for tag, episodes in plan.items())

    def build_runner(self, tag: str, env_config: dict):
        """The rollout runner of env tag `tag` with environment parameters `env_config`."""
        env, rollout = self.config.envs[tag], self.config.rollout
        return make_runner(
            env.env_type, env_config, self.sampler, self.formatter, tag=tag,
            max_turns=env.max_turns, max_input_length=rollout.max_input_length,
            generation=env.generation, format_penalty=env.format_penalty,
            backend=env.backend, run_seed=self.config.run.seed,
            step_timeout_s=env.step_timeout_s, max_workers=env.max_workers,
            batching=rollout.batching, slots=rollout.slots,
            decode_chunk=rollout.decode_chunk_tokens, history=env.history)

    def _attach_snapshots(self):
        """One pool of earlier policy versions (`rollout/snapshots.py`) for every runner
        whose games have frozen seats; None when none has."""
        runners = [r for split in self.split_runners.values() for r in split.values()]
        kinds = list(dict.fromkeys(k for r in runners for k in getattr(r, "frozen_kinds", ())))
        pool = PolicySnapshots.for_kinds(kinds)
        for kind in (k for k in kinds if k.startswith(MODEL)):
            pool.add_model(kind, load_seat_model(
                kind, self.sampler_params(), self.config.model, self.mesh, self.tokenizer,
                run_policy=self._run_policy))
        for r in runners:
            if getattr(r, "frozen_kinds", ()):
                r.snapshots = pool
        return pool

    def record_snapshot(self) -> None:
        """The policy as it is now, kept for frozen seats (on this thread: the learner's)."""
        if self.snapshots is not None:
            self.snapshots.record(int(self.learner.state.step), self.sampler_params())

    def _memory_plan(self, model_dir: str):
        """The run's ``memory_plan`` per device, from the model's config.json alone."""
        model = self.config.model
        cpu = jax.default_backend() == "cpu"
        return run_memory_plan(
            self.config, read_model_config(model_dir, model.dtype, model.param_dtype,
                                           model.untie_word_embeddings),
            self.mesh, plans.device_budget(),
            host_devices=jax.local_device_count() if cpu else 1,
            teacher=teacher_model_config(self.config.distillation))

    @property
    def sequence_length(self) -> int:
        """A sample's most tokens: the learner computes no further."""
        return self.config.learner.packing.sequence_length

    # ---- rollouts ---------------------------------------------------------------------------
    def sampler_params(self):
        """The policy as the sampler reads it: the learner's params in place when colocated,
        else a replica on the sampler's devices, refreshed once per learner version."""
        version = int(self.learner.state.step)
        if getattr(self, "_sampler_version", None) != version:
            self._sampler_params = self.placement.params_for_sampler(self.learner.params,
                                                                     self.mesh)
            self._sampler_version = version
        return self._sampler_params

    @timing.spanned("rollout/other")
    def rollout(self, split: str, *, greedy: bool = False, step: int | None = None,
                cursor: int | None = None, params=None, round_index: int = 0,
                temperature: float | None = None):
        """Plays the episodes of pipeline step `step` (default: the current one) with
        `params` (default: the current policy). With several processes each plays a
        contiguous share of every tag's episodes and all processes then hold all
        trajectories (in episode order), so everything after the rollout is computed
        identically everywhere. `round_index` r > 0 (dynamic sampling's extra rounds of a
        step): trajectory and group ids continue after rounds 0..r−1's, so they stay unique
        within the step and the sampling noise (keyed by episode id) is new."""
        step = self.step if step is None else step
        cursor = self.cursor if cursor is None else cursor
        m = self.train_manager if split == "train" else self.val_manager
        plan = plan_episodes(m, split=split, cursor=cursor)
        params = self.sampler_params() if params is None else params
        trajs, next_id = [], round_index * m.num_episodes
        for tag, episodes in plan.items():
            # Sampling noise is a function of (run seed, step, split, episode id): resumable
            # exactly, and the same whichever process plays the episode.
            seed = self.config.run.seed * 1_000_003 + step * 2 + (split == "val")
            start, stop = process_share(len(episodes))
            if stop > start:
                trajs.extend(self.split_runners[split][tag].run(
                    episodes[start:stop], sample_seed=seed, traj_id_start=next_id + start,
                    params=params, greedy=greedy, temperature=temperature))
            next_id += len(episodes)
        shares = allgather_objects(trajs)
        trajs = sorted((t for share in shares for t in share), key=lambda t: t.traj_id)
        for t in trajs:
            t.group_id += round_index * m.num_env_groups
        return trajs

    # ---- advantages and samples ---------------------------------------------------------------
    @timing.spanned("samples")
    def make_samples(self, trajs):
        """Advantages → samples (``build_samples``), shaped, with a teacher's distillation
        advantages, and their counts."""
        a = self.config.advantages
        if get_advantage_estimator(a.estimator).level == "token":
            samples, stats = token_estimator_samples(
                trajs, adv_estimator=a.estimator, settings=a.settings, critic=self.critic)
        else:
            samples, stats = build_samples(trajs, self.turn_advantages(trajs),
                                           sample_mode=a.sample_mode,
                                           merge_stepwise=a.merge_stepwise)
        samples = self._shape_advantages(samples)
        if self.teacher is not None:  # after the shaping (pipeline/distillation.py says why)
            samples, judged = distill(samples, self.teacher, self.config.distillation,
                                      self.sequence_length)
            stats = {**stats, **judged}
        return samples, stats

    def turn_advantages(self, trajs) -> list[np.ndarray]:
        """Per-turn advantages of `trajs` under the run's outcome or step estimator."""
        a = self.config.advantages
        return turn_advantages(trajs, adv_estimator=a.estimator,
                               reward_norm_by=a.reward_norm_by, settings=a.settings)

    def informative(self, trajs) -> list:
        """The trajectories of `trajs` whose group carries signal (``algos/filters.py``):
        some member has a non-zero advantage from the run's estimator, computed on `trajs`;
        for the token-level estimators, the group's episode scores differ (DAPO's rule)."""
        if not trajs:
            return []
        groups = [t.group_id for t in trajs]
        if get_advantage_estimator(self.config.advantages.estimator).level == "token":
            keep = filters.dynamic_sampling_keep([t.score for t in trajs], groups)
        else:
            keep = filters.groups_with_signal(self.turn_advantages(trajs), groups)
        return [t for t, k in zip(trajs, keep, strict=True) if k]

    def _shape_advantages(self, samples):
        """Optional whitening over the batch's loss tokens, then optional clipping."""
        a = self.config.advantages
        if a.whiten and samples:
            white = adv.whiten([s.advantages for s in samples], [s.loss_mask for s in samples])
            samples = [dataclasses.replace(s, advantages=a) for s, a in zip(samples, white,
                                                                            strict=True)]
        if a.clip > 0:
            samples = [dataclasses.replace(s, advantages=np.clip(s.advantages, -a.clip, a.clip))
                       for s in samples]
        return samples

    # ---- one pipeline step ----------------------------------------------------------------------
    @timing.spanned("pipeline_other")
    def train_step(self) -> tuple[dict[str, float], list, list]:
        """One pipeline step → (metrics, trajectories played, samples trained on).

        The samples come from all trajectories played, less, with ``dynamic_sampling``, the
        groups without reward variance (and any beyond ``num_env_groups`` informative ones).
        """
        cfg = self.config
        t0 = time.perf_counter()
        self.record_snapshot()
        trajs, t_rollout, off_policy = self.train_rollout()
        self.shape_rewards(trajs)
        played, rounds = trajs, 1
        if cfg.rollout.dynamic_sampling:
            start = time.perf_counter()
            trajs, played, rounds = self.fill_informative_groups(trajs)
            t_rollout += time.perf_counter() - start
        metrics = {"step": float(self.step + 1), **trajectory_metrics(played, "env/"),
                   **off_policy, **self.overlong_penalty_metrics(played),
                   **self.collapse_metrics(played)}
        if cfg.rollout.dynamic_sampling:
            metrics["batch/dynamic_sampling_rounds"] = float(rounds)
            metrics["batch/groups_played"] = float(len({t.group_id for t in played}))
            metrics["batch/groups_kept"] = float(len({t.group_id for t in trajs}))
        # Non-finite sampler logprobs mean non-finite parameters: nothing can be learned
        # from this batch. Skip the update and count it (train.py stops after 3 in a row).
        bad_turns = sum(not np.isfinite(u.logprobs).all() for t in trajs for u in t.turns)
        metrics["rollout/nonfinite_logprobs"] = float(bad_turns)
        samples, sample_stats = [], {"batch/sequences_before_merge": 0.0,
                                     "batch/sequences_after_merge": 0.0}
        if not bad_turns:
            if cfg.advantages.kl_in_reward:
                metrics.update(self.fold_kl_into_rewards(trajs))
            samples, sample_stats = self.make_samples(trajs)
            if cfg.advantages.overlong_filter:
                samples, metrics["batch/overlong_filtered"] = self.filter_overlong(trajs,
                                                                                   samples)
        metrics.update(sample_stats)
        t1 = time.perf_counter()
        if samples:
            updates = updates_per_step(len(samples), cfg.learner.mini_batch_size,
                                       cfg.learner.ppo_epochs)
            lrs = self.lr_plan.learning_rates(self.step, updates)
            if self.critic is not None:  # values for this step were computed before updating
                with timing.span("critic"):
                    metrics.update(self.critic.step(samples))
            with timing.span("learner"):
                metrics.update(self.learner.step(samples, lrs))
            metrics["critic/advantages_mean"] = mean_of(
                float(s.advantages[s.loss_mask > 0].mean()) for s in samples
                if s.loss_mask.sum() > 0)
        else:
            updates = 0
            metrics["optim/nonfinite_updates"] = float(bad_turns > 0)
        # A skipped batch says nothing about samples per trajectory.
        trained = len(trajs) if not bad_turns and trajs else 0
        self.lr_plan.record(updates, sample_stats["batch/sequences_after_merge"], trained)
        metrics["optim/estimated_chunks_per_traj"] = self.lr_plan.chunks.chunks_per_traj
        metrics["optim/planned_updates"] = float(
            self.lr_plan.projected_total_updates(steps_done=self.step + 1))
        t_train = time.perf_counter() - t1
        self.step += 1
        self.cursor += self.train_manager.num_env_groups * rounds
        if self.producer is not None:
            self.producer.publish(self.step, self.published_params())
        metrics["time/rollout"] = t_rollout
        metrics["time/train"] = t_train
        metrics["time/step"] = time.perf_counter() - t0
        metrics["perf/tokens_per_s"] = metrics.get("tokens/real", 0.0) / max(
            metrics["time/step"], 1e-9)
        return metrics, played, samples

    # ---- asynchronous rollouts ------------------------------------------------------------------
    def published_params(self):
        """The params the producer may use while the learner goes on. Colocated, a copy of
        what the train step donates (overwrites): the trained params (under LoRA the
        adapters alone; the frozen base is never donated, so it is shared)."""
        if not self.placement.colocated:
            return self.sampler_params()  # a replica on the sampler's devices
        return full_params(copy_params(self.learner.state.params), self.learner.engine.frozen)

    def train_rollout(self) -> tuple[list, float, dict[str, float]]:
        """(trajectories for this step, seconds of rollout, off-policy metrics).

        `async_generation_ratio = 0`: played now with the current params. `n ≥ 1`: taken
        from the producer thread, which plays step j with the newest params published
        (version ≥ j − n) while the learner trains. `in_flight_updates`: from the producer's
        threads, whose rollouts take each new version at their next chunk, admitted so that
        no token lags more than `max_policy_lag` versions (`rollout/producer.py`). Every
        token's version is recorded (`Turn.versions`); trajectories past the bound are
        dropped and counted (a safety net: admission keeps them within it).
        """
        rollout = self.config.rollout
        in_flight = rollout.in_flight_updates
        ratio = rollout.max_policy_lag if in_flight else rollout.async_generation_ratio
        if ratio == 0 and not in_flight:
            start = time.perf_counter()
            trajs = self.rollout("train")
            seconds = time.perf_counter() - start
            stamp_versions(trajs, self.step)
            return trajs, seconds, {"off_policy/staleness_mean": 0.0,
                                    "off_policy/staleness_max": 0.0,
                                    **version_lag_metrics(trajs, self.step),
                                    "off_policy/dropped": 0.0, "time/wait_for_rollout": seconds}
        if self.producer is None:
            # The env-group cursor advances by num_env_groups per step, so the seeds of
            # step j are known in advance (the thread must not read self.step/self.cursor,
            # which this thread changes).
            base_step, base_cursor = self.step, self.cursor
            groups = self.train_manager.num_env_groups

            def produce(step, params):
                return self.rollout("train", step=step, params=params,
                                    cursor=base_cursor + (step - base_step) * groups)

            self.producer = RolloutProducer(produce, ratio=ratio, first_step=self.step,
                                            version=self.step, params=self.published_params(),
                                            in_flight=in_flight)
            if self.step > 0:  # resumed: the producer's queue is not in the checkpoint
                self.log(f"async resume at step {self.step}: steps {self.step}.."
                         f"{self.step + ratio - 1} are played with the restored policy "
                         f"(staleness 0) where the uninterrupted run used one up to {ratio} "
                         "versions older; seeds, sampling noise and data order continue "
                         "exactly")
        produced, waited = self.producer.take(self.step)
        staleness = self.step - produced.version
        stamp_versions(produced.trajectories, produced.version)
        # Cannot happen with the producer's admission; never train on it.
        trajs = [t for t in produced.trajectories
                 if self.step - t.token_versions().min(initial=self.step) <= ratio]
        dropped = len(produced.trajectories) - len(trajs)
        return trajs, produced.seconds, {
            "off_policy/staleness_mean": float(staleness) if trajs else 0.0,
            "off_policy/staleness_max": float(staleness) if trajs else 0.0,
            **version_lag_metrics(trajs, self.step),
            "off_policy/dropped": float(dropped), "time/wait_for_rollout": waited}

    def close(self) -> None:
        """Stops the producer threads (if any) once their rollouts in progress end, and says
        how many episodes they played that were not trained on (a resumed run plays those
        steps again: nothing is lost, nothing counted twice)."""
        if self.producer is not None:
            unused = self.producer.close()
            self.producer = None
            if unused:
                self.log(f"rollouts: {unused} episodes played ahead of step {self.step} were "
                         "not trained on (a resumed run plays their steps again)")

    @timing.spanned("samples")
    def fold_kl_into_rewards(self, trajs) -> dict[str, float]:
        """r'_turn = r_turn − β · Σ_{tokens of its reply} k(logπ_old − logπ_ref).

        The env-side metrics (success, return) were computed before and keep the true
        rewards; advantages see the penalised ones. β is the KL controller's coefficient.
        """
        played = [t for t in trajs if t.turns]
        if not played:
            return {}
        samples = [trajectory_sample(t, 0.0) for t in played]
        ref = self.learner.sample_logprobs(samples, reference=True)
        # The reference is 0 beyond sequence_length (not computed) and a sampler logprob
        # can be the out-of-support sentinel: those tokens carry no KL, and are not counted.
        masks = comparable_masks(samples, ref, self.sequence_length)
        coef = float(self.learner.state.kl.coef)
        estimator = self.config.advantages.kl_estimator
        total_kl, tokens = 0.0, 0
        for traj, sample, ref_lp, mask in zip(played, samples, ref, masks, strict=True):
            per_token = np.where(mask, np.asarray(kl_estimate(sample.old_logprobs, ref_lp,
                                                              estimator)), 0.0)
            for turn in traj.turns:
                span = slice(turn.context_len, turn.context_len + len(turn.generated))
                turn_kl = float(per_token[span].sum())
                turn.reward -= coef * turn_kl
                total_kl += turn_kl
                tokens += int(mask[span].sum())
        return {"actor/reward_kl": total_kl / max(tokens, 1), "kl/coef": coef}

    @timing.spanned("eval")
    def evaluate(self) -> tuple[dict[str, float], list]:
        """The held-out episodes, greedy (`eval_temperature` 0) or sampled at
        `eval_temperature` (RAGEN's validation samples at 0.5)."""
        t = self.config.rollout.eval_temperature
        self.record_snapshot()
        trajs = self.rollout("val", greedy=t == 0, temperature=t or None)
        return trajectory_metrics(trajs, "eval/"), trajs

    # ---- checkpointable host state --------------------------------------------------------------
    def host_state(self) -> dict:
        return {
            "step": self.step,
            "cursor": self.cursor,
            "lr_plan": self.lr_plan.to_dict(),
            "learner_np_rng": self.learner.np_rng.bit_generator.state,
            "critic_np_rng": None if self.critic is None else
            self.critic.np_rng.bit_generator.state,
        }

    def load_host_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.cursor = int(state["cursor"])
        self.lr_plan.load_dict(state["lr_plan"])
        self.learner.np_rng.bit_generator.state = state["learner_np_rng"]
        if self.critic is not None:
            self.critic.np_rng.bit_generator.state = state["critic_np_rng"]

    def train_states(self) -> dict:
        """The device states a checkpoint holds (under LoRA not the frozen base, which is
        not part of the learner's state: the run reads it from its model again)."""
        states = {"learner": self.learner.state}
        if self.critic is not None:
            states["critic"] = self.critic.state
        return states

    def load_train_states(self, states: dict) -> None:
        self.learner.state = states["learner"]
        if self.critic is not None:
            self.critic.state = states["critic"]

    def export_model(self):
        """An nnx model with the current parameters (for HF export; LoRA's adapters merged
        into the weights they adapt)."""
        return lora.merge_adapters(self.adapted_model())

    def adapted_model(self):
        """An nnx model with the current parameters on the host (LoRA's adapters apart)."""
        return nnx.merge(self.graphdef, jax.device_get(self.learner.params))
