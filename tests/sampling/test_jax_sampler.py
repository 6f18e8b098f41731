"""Sampler vs the full (non-cached) forward pass, prefix reuse and row blocks of its sessions,
sampling statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_agentic.models import ModelConfig, Transformer
from jaxrl_agentic.sampling import Sampler

CFG = ModelConfig(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    qk_norm=True,
    attention_bias=False,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(3))


def full_logprobs(model, stream, temperature=1.0):
    """log softmax(logits / T) for every position of `stream`, from the full forward."""
    tokens = jnp.asarray(stream)[None]
    logits = model(tokens, jnp.arange(len(stream))[None])[0] / temperature
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def test_greedy_equals_stepwise_argmax_of_full_forward(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, n).tolist() for n in (3, 11, 6)]
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1)
    out = sampler.generate(prompts, max_new_tokens=9, greedy=True, temperature=0.7)
    for prompt, toks, lps, reason in zip(prompts, out.tokens, out.logprobs, out.stop_reasons,
                                         strict=True):
        # The forward is causal, so one full pass over prompt + generated tokens gives the
        # logits every step of a step-by-step argmax decode would have seen: equal argmaxes
        # at every position are that decode's tokens, by induction over the steps.
        assert len(toks) == 9 and reason == "length"
        ref = full_logprobs(model, list(prompt) + toks, 0.7)
        steps = ref[len(prompt) - 1 : -1]
        assert toks == np.argmax(steps, axis=-1).tolist()
        # logprobs: log-softmax of the full forward's logits/T at the generated tokens
        np.testing.assert_allclose(lps, steps[np.arange(9), toks], atol=1e-5)


def test_sampled_logprobs_match_full_forward(model):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1)
    out = sampler.generate(prompts, max_new_tokens=12, temperature=1.3, top_p=0.9, top_k=20,
                           seed=5)
    for prompt, toks, lps in zip(prompts, out.tokens, out.logprobs, strict=True):
        ref = full_logprobs(model, prompt + toks, 1.3)
        expected = [ref[len(prompt) - 1 + i, t] for i, t in enumerate(toks)]
        assert np.abs(np.asarray(lps) - expected).max() <= 1e-5


def test_rows_stop_independently_on_eos_and_stop_ids(model):
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1)
    free = sampler.generate([[1, 2], [3, 4, 5]], max_new_tokens=8, greedy=True)
    # Make the 3rd greedy token of row 0 the EOS and the 2nd token of row 1 a stop id.
    eos, stop = free.tokens[0][2], free.tokens[1][1]
    # The fixed random model must give distinct tokens here for the test to mean anything.
    assert eos != stop and stop not in free.tokens[0][:3] and eos not in free.tokens[1][:2]
    sampler = Sampler(model, max_total_len=64, eos_token_id=eos)
    out = sampler.generate([[1, 2], [3, 4, 5]], max_new_tokens=8, greedy=True,
                           stop_token_ids=[stop])
    assert out.tokens[0] == free.tokens[0][:3] and out.stop_reasons[0] == "eos"
    assert out.tokens[1] == free.tokens[1][:2] and out.stop_reasons[1] == "stop"


def test_prefix_reuse_matches_fresh_prefill_and_grows_linearly(model):
    rng = np.random.default_rng(1)
    sampler = Sampler(model, max_total_len=512, eos_token_id=-1)
    session = sampler.new_session(2)
    session.extend([0, 1], [rng.integers(0, 96, 5).tolist(), rng.integers(0, 96, 9).tolist()])
    prefill_per_turn = []
    for turn in range(10):
        before = sampler.stats["prefill_tokens"]
        out = session.generate([0, 1], max_new_tokens=6, temperature=1.0, seed=turn)
        prefill_per_turn.append(sampler.stats["prefill_tokens"] - before)
        # A fresh sampler prefilling the whole context must produce the same turn.
        contexts = [session.streams[r][: len(session.streams[r]) - len(out.tokens[r])]
                    for r in (0, 1)]
        fresh = Sampler(model, max_total_len=512, eos_token_id=-1).generate(
            contexts, max_new_tokens=6, temperature=1.0, seed=turn)
        assert fresh.tokens == out.tokens
        for a, b in zip(fresh.logprobs, out.logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        obs = [rng.integers(0, 96, 4).tolist() for _ in range(2)]
        session.extend([0, 1], obs)
    # Turn 0 prefills the prompts (14 tokens); every later turn only the appended observation
    # (4 per row) plus each row's last sampled token (1 per row): linear, not quadratic.
    assert prefill_per_turn[0] == 14
    assert prefill_per_turn[1:] == [10] * 9
    total = sum(prefill_per_turn)
    final_len = sum(len(s) for s in session.streams)
    assert total <= final_len
    quadratic = sum(sum(len(c) for c in [session.streams[0][: 5 + 14 * t],
                                           session.streams[1][: 9 + 14 * t]])
                    for t in range(10))
    assert total < quadratic / 4


def test_a_groups_shared_prompt_is_prefilled_once_and_decodes_as_if_each_was(model):
    """Rows 0, 1, 3 start with one prompt (a group), row 2 with another: with
    `share_prompt_prefill` the first prompt is prefilled once and copied to the other two,
    and every turn's tokens and logprobs are those of prefilling each row."""
    rng = np.random.default_rng(7)
    p, q = rng.integers(0, 96, 13).tolist(), rng.integers(0, 96, 6).tolist()
    outs, samplers = [], []
    for share in (False, True):
        sampler = Sampler(model, max_total_len=128, eos_token_id=-1, decode_threads=1)
        sampler.share_prompt_prefill = share
        session = sampler.new_session(4)
        session.extend(range(4), [p, p, q, p])
        turns = []
        for turn in range(2):
            out = session.generate(range(4), max_new_tokens=5, temperature=1.0, seed=turn,
                                   row_seeds=[10, 11, 12, 13])
            turns.append(out)
            session.extend(range(4), [[turn + r] * 3 for r in range(4)])
        outs.append(turns)
        samplers.append(sampler)
    for plain, shared in zip(*outs, strict=True):
        assert plain.tokens == shared.tokens
        for a, b in zip(plain.logprobs, shared.logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    plain, shared = (s.stats for s in samplers)
    assert shared["prefill_shared_tokens"] == 2 * len(p)
    assert plain["prefill_tokens"] - shared["prefill_tokens"] == 2 * len(p)
    assert plain["prefill_shared_tokens"] == 0


@pytest.fixture(scope="module")
def peaked_model():
    """A model with a sharp next-token distribution, so temperature visibly changes it."""
    m = Transformer(CFG, rngs=nnx.Rngs(3))
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * 10.0
    return m


def _next_token_distribution(model, prompt, temperature):
    return np.exp(full_logprobs(model, prompt, temperature)[-1])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0),
                                                     (1.0, 5, 1.0), (1.5, 0, 0.6)])
def test_sampling_respects_temperature_top_k_top_p(peaked_model, temperature, top_k, top_p):
    model = peaked_model
    prompt = [7, 8, 9]
    n = 2048
    sampler = Sampler(model, max_total_len=16, eos_token_id=-1)
    out = sampler.generate([prompt], num_return_sequences=n, max_new_tokens=1,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    counts = np.bincount([t[0] for t in out.tokens], minlength=96)
    p = _next_token_distribution(model, prompt, temperature)
    order = np.argsort(-p)
    keep = np.zeros(96, bool)
    if top_k:
        keep[order[:top_k]] = True
    elif top_p < 1:
        before = np.cumsum(p[order]) - p[order]
        keep[order[before < top_p]] = True
    else:
        keep[:] = True
    assert counts[~keep].sum() == 0, "sampled a token outside the top-k / top-p set"
    expected = np.where(keep, p, 0) / p[keep].sum()
    assert expected.max() < 0.9 and (expected > 0.01).sum() >= 3  # a distribution worth testing
    # Pearson chi-square over cells with enough expected mass; 6 sigma above its mean.
    cells = expected * n >= 5
    chi2 = (((counts[cells] - n * expected[cells]) ** 2) / (n * expected[cells])).sum()
    dof = cells.sum() - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)
    # and the wrong temperature would have been caught
    if temperature != 1.0:
        wrong = _next_token_distribution(model, prompt, 1.0)
        chi2_wrong = (((counts[cells] - n * wrong[cells]) ** 2) / (n * wrong[cells])).sum()
        assert chi2_wrong > dof + 6 * np.sqrt(2 * dof)
    # reported logprobs are of the untruncated temperature distribution
    toks = np.array([t[0] for t in out.tokens])
    np.testing.assert_allclose([lp[0] for lp in out.logprobs], np.log(p[toks]), atol=1e-5)


def test_seeds_reproduce_and_differ(model):
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1)
    a = sampler.generate([[1, 2, 3]] * 4, max_new_tokens=10, seed=1)
    b = sampler.generate([[1, 2, 3]] * 4, max_new_tokens=10, seed=1)
    c = sampler.generate([[1, 2, 3]] * 4, max_new_tokens=10, seed=2)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert len({tuple(t) for t in a.tokens}) > 1  # rows draw independently


def test_buckets_bound_compilations(model):
    sampler = Sampler(model, max_total_len=128, eos_token_id=-1)
    rng = np.random.default_rng(2)
    for batch in (3, 4, 2, 4, 3):  # rows bucket to 2 and 4
        prompts = [rng.integers(0, 96, rng.integers(2, 15)).tolist() for _ in range(batch)]
        sampler.generate(prompts, max_new_tokens=int(rng.integers(5, 8)), seed=0)
    # 2 row buckets × (1 prefill bucket + 1 new-token bucket) = 4 programs.
    assert sampler.compilation_count() == 4
    new_params = jax.tree.map(lambda x: x * 1.01, sampler.params)
    sampler.generate([[1, 2, 3]] * 4, max_new_tokens=6, params=new_params)
    assert sampler.compilation_count() == 4  # a new policy is an argument, not a recompile


def test_accepts_mesh_sharded_params_and_cache(model):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1)
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded = jax.device_put(sampler.params, replicated)
    base = sampler.generate([[1, 2, 3]], max_new_tokens=5, greedy=True)
    session = sampler.new_session(1)
    session.cache = jax.device_put(session.cache, NamedSharding(mesh, PartitionSpec("data")))
    session.extend([0], [[1, 2, 3]])
    out = session.generate([0], max_new_tokens=5, greedy=True, params=sharded)
    assert out.tokens == base.tokens


def test_cache_grows_in_buckets_and_matches_a_full_size_cache(model):
    """A session's cache doubles as its streams grow; tokens equal a max-size cache's."""
    growing = Sampler(model, max_total_len=64, min_cache_bucket=8, eos_token_id=-1)
    full = Sampler(model, max_total_len=64, min_cache_bucket=64, eos_token_id=-1)
    sessions = [growing.new_session(2), full.new_session(2)]
    for session in sessions:
        session.extend([0, 1], [[1, 2, 3, 4, 5], list(range(10, 20))])
    rng = np.random.default_rng(4)
    cache_lengths = []
    for turn in range(4):
        outs = [s.generate([0, 1], max_new_tokens=6, seed=turn) for s in sessions]
        assert outs[0].tokens == outs[1].tokens
        for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        cache_lengths.append(sessions[0].cache.max_len)
        obs = [rng.integers(0, 96, 4).tolist() for _ in range(2)]
        for session in sessions:
            session.extend([0, 1], obs)
    # Longest stream before each turn's decode ends: 16, 26, 36, 46 → buckets, capped at 64.
    assert cache_lengths == [16, 32, 64, 64]
    assert sessions[1].cache.max_len == 64
    # One prefill and one decode program per cache length reached (16, 32, 64).
    assert growing.compilation_count() == 6


def test_row_blocks_in_parallel_equal_one_session(model):
    """A session split into row blocks generated on threads draws what one cache draws:
    same tokens, same logprobs, over several turns of a multi-turn session."""
    from jaxrl_agentic.sampling import Session, ShardedSession

    blocked = Sampler(model, max_total_len=128, eos_token_id=-1, decode_threads=3,
                      min_rows_per_thread=2)
    single = Sampler(model, max_total_len=128, eos_token_id=-1, decode_threads=1)
    sessions = [blocked.new_session(7), single.new_session(7)]
    assert isinstance(sessions[0], ShardedSession) and len(sessions[0].blocks) == 3
    assert isinstance(sessions[1], Session)
    rng = np.random.default_rng(6)
    first = [rng.integers(0, 96, rng.integers(2, 12)).tolist() for _ in range(7)]
    for session in sessions:
        session.extend(range(7), first)
    seeds = [100 + 7 * r for r in range(7)]
    for turn, rows in enumerate([range(7), [6, 4], [1, 2, 5, 0]]):
        outs = [s.generate(rows, max_new_tokens=5, seed=turn, row_seeds=seeds, top_k=20)
                for s in sessions]
        assert outs[0].tokens == outs[1].tokens
        assert outs[0].stop_reasons == outs[1].stop_reasons
        for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        obs = [rng.integers(0, 96, 3).tolist() for _ in rows]
        for session in sessions:
            session.extend(rows, obs)
    assert sessions[0].streams == sessions[1].streams
    assert [sessions[0].length(r) for r in range(7)] == [len(s) for s in sessions[1].streams]
    # Blocks are rows {0, 1}, {2, 3}, {4, 5, 6}; each prefills on its own, and only when
    # it has rows to generate: 3 calls, then 1 (rows 6, 4), then 3.
    assert blocked.stats["prefill_tokens"] == single.stats["prefill_tokens"]
    assert blocked.stats["prefill_calls"] == 3 + 1 + 3
    with pytest.raises(ValueError, match="row 7: cannot generate from an empty stream"):
        wide = blocked.new_session(8)
        wide.extend(range(7), first)
        wide.generate([0, 7], max_new_tokens=2)
    # Default seed ids (the row index) are global too.
    outs = [s.generate(first, max_new_tokens=6, seed=9) for s in (blocked, single)]
    assert outs[0].tokens == outs[1].tokens


def test_default_threads_follow_the_cpu_and_the_mesh(model):
    import os

    cores = len(os.sched_getaffinity(0))
    assert Sampler(model).decode_threads == cores
    assert Sampler(model, mesh=Mesh(np.array(jax.devices()[:1]), ("data",))).decode_threads \
        == cores
    with pytest.raises(ValueError, match="decode_threads"):
        Sampler(model, decode_threads=0)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (8, 0.7)])
def test_logprobs_under_the_filter_are_those_of_the_kept_set_and_the_learners(
        peaked_model, top_k, top_p):
    """With ``logprob_under_filter`` the sampler reports log q(y) = log p(y) − log Σ_K p
    (a hand numpy reference over the kept set K), and the learner's restricted logprobs
    agree, so the on-policy ratio is 1. Without it the ratio of the learner's restricted
    logprob to the sampler's is off by exactly the log of the kept mass: the bias removed."""
    from pallas_kernels import restricted_token_logprobs

    model, prompt, temperature = peaked_model, [7, 8, 9], 1.3
    kwargs = dict(num_return_sequences=64, max_new_tokens=1, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=3)
    filtered = Sampler(model, max_total_len=16, eos_token_id=-1,
                       logprob_under_filter=True).generate([prompt], **kwargs)
    plain = Sampler(model, max_total_len=16, eos_token_id=-1).generate([prompt], **kwargs)
    assert [t[0] for t in filtered.tokens] == [t[0] for t in plain.tokens]  # same draws
    toks = np.array([t[0] for t in filtered.tokens])
    p = _next_token_distribution(model, prompt, temperature)
    order = np.argsort(-p)
    keep = np.zeros(p.size, bool)
    keep[order[:top_k or p.size]] = True
    kept_p = np.where(keep, p, 0.0)
    before = np.cumsum(kept_p[order]) / kept_p.sum() - kept_p[order] / kept_p.sum()
    keep[order[before >= top_p]] = False
    log_mass = np.log(p[keep].sum())
    assert log_mass < -0.05  # the restriction drops visible mass
    np.testing.assert_allclose([lp[0] for lp in filtered.logprobs],
                               np.log(p[toks]) - log_mass, atol=1e-5)
    np.testing.assert_allclose([lp[0] for lp in plain.logprobs], np.log(p[toks]), atol=1e-5)
    hidden = model.hidden_states(jnp.asarray(prompt)[None], jnp.arange(3)[None])[0, -1:]
    learner = np.asarray(restricted_token_logprobs(
        jnp.repeat(hidden, toks.size, axis=0), model.lm_head_weight(), jnp.asarray(toks),
        temperature, top_k=top_k, top_p=top_p))
    np.testing.assert_allclose(learner, [lp[0] for lp in filtered.logprobs], atol=1e-5)
    np.testing.assert_allclose(learner - [lp[0] for lp in plain.logprobs], -log_mass,
                               atol=1e-5)
