"""Chunked slot decoding (continuous batching) against `Session.generate`: the same replies
token for token whatever the chunk size, the start order or the rows sharing a step."""

import numpy as np
import pytest
from flax import nnx

from jaxrl_agentic.models import Transformer
from jaxrl_agentic.sampling import Sampler, SlotDecoder
from jaxrl_agentic.sampling.buckets import chunk_width
from tests.sampling.test_jax_sampler import CFG

EOS, STOPS, SEED = 5, [7, 8], 1234
LENGTHS = (3, 11, 6, 20, 9, 14)
ROW_IDS = [101, 7, 33, 2, 9, 58]


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(3))


def reference(sampler, prompts, max_new, row_ids=ROW_IDS):
    """One `Session.generate` call for every prompt (the lockstep sampler)."""
    session = sampler.new_session(len(prompts))
    session.extend(range(len(prompts)), prompts)
    return session.generate(range(len(prompts)), max_new_tokens=max_new, seed=SEED,
                            row_seeds=row_ids, stop_token_ids=STOPS)


def staggered(sampler, prompts, max_new, *, slots, chunk, fixed=False, precompile=False,
              on_chunk=None, chunk_grid="1.5x"):
    """The prompts through `slots` slots, each started when a slot is free (reversed order),
    its slot reset first; → {prompt index: reply}. `fixed`: the cache is the whole slot pool
    from the start (as continuous rollouts make it); `on_chunk(block, width)` sees the rows
    each chunk computes; `chunk_grid`: the decoder's grid of chunk rows and read lengths."""
    session = sampler.new_session(slots, sampler.max_total_len if fixed else 0)
    decoder = SlotDecoder(session, max_new_tokens=max_new, chunk=chunk, stop_token_ids=STOPS,
                          chunk_grid=chunk_grid)
    if precompile:
        decoder.precompile(max_prompt=max(LENGTHS))
    if on_chunk is not None:
        program = decoder._program

        def spy(params, cache, logits, fresh, *args, **kwargs):
            on_chunk(args[2], fresh.shape[0])  # the live flags, as the chunk sees them
            return program(params, cache, logits, fresh, *args, **kwargs)

        decoder._program = spy
    todo, free, owner, replies = list(range(len(prompts)))[::-1], list(range(slots)), {}, {}
    while todo or decoder.live_rows:
        starting = []
        while free and todo:
            slot, i = free.pop(), todo.pop(0)
            session.reset_row(slot)
            session.extend([slot], [prompts[i]])
            owner[slot] = i
            starting.append(slot)
            if len(starting) == 2:
                break  # start at most two per round: rows start mid-way through others
        if starting:
            decoder.start(starting, [SEED] * len(starting), [ROW_IDS[owner[s]] for s in starting])
        for slot, reply in decoder.decode().items():
            replies[owner[slot]] = reply
            free.append(slot)
    return replies


@pytest.mark.parametrize("chunk,slots,threads,grid", [(1, 6, 1, "1.5x"), (3, 2, 1, "1.5x"),
                                                     (5, 4, 2, "1.5x"), (3, 5, 1, "pow2")])
def test_slot_replies_equal_one_generate_call(model, chunk, slots, threads, grid):
    sampler = Sampler(model, max_total_len=64, eos_token_id=EOS, decode_threads=threads,
                      min_rows_per_thread=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, n).tolist() for n in LENGTHS]
    ref = reference(sampler, prompts, 24)
    got = staggered(sampler, prompts, 24, slots=slots, chunk=chunk, chunk_grid=grid)
    reasons = set()
    for i in range(len(prompts)):
        assert got[i].tokens == ref.tokens[i], i
        assert got[i].stop_reason == ref.stop_reasons[i], i
        np.testing.assert_allclose(got[i].logprobs, ref.logprobs[i], atol=1e-5)
        reasons.add(ref.stop_reasons[i])
    assert reasons == {"eos", "stop", "length"}  # every way a reply ends is exercised


def independent_blocks(sampler, prompts, max_new, row_ids, *, slots, chunk):
    """`staggered` with the row blocks on their own (`launch` / `collect`): a block whose
    chunk is done hands over its ended replies and takes new prompts while the others
    decode; → {prompt index: reply}."""
    session = sampler.new_session(slots)
    decoder = SlotDecoder(session, max_new_tokens=max_new, chunk=chunk, stop_token_ids=STOPS)
    todo, free, owner, replies = list(range(len(prompts))), list(range(slots)), {}, {}
    while todo or decoder.decoding or decoder.live_rows:
        idle = [slot for slot in free if decoder.idle(slot)]
        starting = []
        while idle and todo:
            slot, i = idle.pop(), todo.pop(0)
            free.remove(slot)
            session.reset_row(slot)
            session.extend([slot], [prompts[i]])
            owner[slot] = i
            starting.append(slot)
        if starting:
            decoder.start(starting, [SEED] * len(starting), [row_ids[owner[s]] for s in starting])
        decoder.launch()
        for slot, reply in decoder.collect().items():
            replies[owner[slot]] = reply
            free.append(slot)
    return replies


@pytest.mark.parametrize("chunk,slots,threads", [(2, 4, 2), (3, 6, 3)])
def test_blocks_decoding_on_their_own_give_the_replies_of_one_generate_call(
        model, chunk, slots, threads):
    sampler = Sampler(model, max_total_len=64, eos_token_id=EOS, decode_threads=threads,
                      min_rows_per_thread=2)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, n).tolist() for n in LENGTHS * 2]
    row_ids = ROW_IDS + [i + 1000 for i in ROW_IDS]
    ref = reference(sampler, prompts, 24, row_ids)
    got = independent_blocks(sampler, prompts, 24, row_ids, slots=slots, chunk=chunk)
    assert sorted(got) == list(range(len(prompts)))
    for i in range(len(prompts)):
        assert got[i].tokens == ref.tokens[i], i
        assert got[i].stop_reason == ref.stop_reasons[i], i
        np.testing.assert_allclose(got[i].logprobs, ref.logprobs[i], atol=1e-5)


def test_start_refuses_a_row_whose_block_is_decoding(model):
    """A launched chunk owns its block's cache until it is collected, done or not."""
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1, decode_threads=2,
                      min_rows_per_thread=2)
    session = sampler.new_session(4)  # rows 0, 1: block 0; rows 2, 3: block 1
    session.extend(range(4), [[1, 2], [3], [4, 5, 6], [7]])
    decoder = SlotDecoder(session, max_new_tokens=8, chunk=2)
    decoder.start([0], [0], [0])
    decoder.launch()
    assert decoder.decoding and not decoder.idle(1) and decoder.idle(2)
    with pytest.raises(ValueError, match="row 1's block is decoding"):
        decoder.start([1], [0], [1])
    with pytest.raises(ValueError, match="in flight"):
        decoder.decode()
    decoder.start([2], [0], [2])  # the other block is free
    replies = {}
    while decoder.decoding or decoder.live_rows:
        decoder.launch()
        replies.update(decoder.collect())
    assert sorted(replies) == [0, 2] and all(len(r.tokens) == 8 for r in replies.values())


def test_a_slot_continues_its_stream_like_generate(model):
    """A second reply in a slot (the next turn) prefills only what is new, as `generate`."""
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1, decode_threads=1)
    turns = [[1, 2, 3], [9, 9], [4]]
    session = sampler.new_session(1)
    expected = []
    for t, ids in enumerate(turns):
        session.extend([0], [ids])
        expected.append(session.generate([0], max_new_tokens=4, seed=t, row_seeds=[5]).tokens[0])
    stats = dict(sampler.stats)
    slots = sampler.new_session(2)
    decoder = SlotDecoder(slots, max_new_tokens=4, chunk=3)
    for t, ids in enumerate(turns):
        slots.extend([1], [ids])
        decoder.start([1], [t], [5])
        while decoder.live_rows:
            finished = decoder.decode()
        assert finished[1].tokens == expected[t]
    assert slots.streams[1] == session.streams[0]
    # Same prefill work: 3 + (1 + 2) + (1 + 1) tokens, the last reply token re-fed each turn.
    assert sampler.stats["prefill_tokens"] - stats["prefill_tokens"] == stats["prefill_tokens"]


def test_start_refuses_a_row_that_is_mid_reply(model):
    sampler = Sampler(model, max_total_len=64, eos_token_id=-1, decode_threads=1)
    session = sampler.new_session(2)
    session.extend([0], [[1, 2]])
    decoder = SlotDecoder(session, max_new_tokens=8, chunk=2)
    decoder.start([0], [0], [0])
    decoder.decode()
    assert decoder.live_rows == [0]
    with pytest.raises(ValueError, match="row 0 is mid-reply"):
        decoder.start([0], [0], [0])


def test_chunks_compute_only_the_live_rows_and_compile_nothing_after_precompile(model):
    """A chunk runs the live rows' width bucket of the block (`chunk_width`), not the
    block: the replies stay those of one `generate` call. After `precompile`, a run over a
    fixed-size cache (every stream length, every start count) compiles no program."""
    # Cache buckets from 16: attention picks its read length at run time.
    sampler = Sampler(model, max_total_len=64, eos_token_id=EOS, decode_threads=1,
                      min_cache_bucket=16)
    assert sampler.key_extents(64) == (16, 32, 64)  # the prefill's
    assert sampler.key_extents(64, "1.5x") == (16, 24, 32, 48, 64)  # the chunk's
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, n).tolist() for n in LENGTHS]
    ref = reference(sampler, prompts, 24)
    widths = []

    def on_chunk(live, width):
        widths.append((int(np.asarray(live).sum()), width))

    session_rows = 8  # capacity 8: chunks of 1-6 live rows run 1, 2, 3, 4, 6 or 8 rows
    before = sampler.compilation_count()
    got = staggered(sampler, prompts, 24, slots=session_rows, chunk=3, fixed=True,
                    precompile=True, on_chunk=on_chunk)
    compiled = sampler.compilation_count() - before
    for i in range(len(prompts)):
        assert got[i].tokens == ref.tokens[i], i
        np.testing.assert_allclose(got[i].logprobs, ref.logprobs[i], atol=1e-5)
    # The compact chunk's inputs hold the live rows then padding: live count ≤ width.
    assert all(live <= width == chunk_width(live, session_rows) for live, width in widths)
    assert {3, 6} & {w for _, w in widths}, widths  # widths between powers of two ran
    # Everything that ran was compiled by precompile: widths 1, 2, 3, 4, 6 and the full
    # block, and a compact prefill of 1, 2, 4, 8 rows × tails of 16, 32 tokens.
    assert compiled == 6 + 4 * 2, compiled
    # The rows computed are counted: Σ steps × width over the chunks.
    assert sampler.stats["decode_row_steps"] > 0
    again = sampler.compilation_count()
    staggered(sampler, prompts[::-1], 24, slots=session_rows, chunk=3, fixed=True,
              precompile=True)
    assert sampler.compilation_count() == again
    # Nor does anything else compile: three prompts started at once make a compact prefill
    # of 4 rows, a shape the runs above did not feed; its inputs go to the device without a
    # program (`jnp.asarray` of a NumPy array compiled a copy per new shape).
    from jaxrl_agentic.runtime.compile_events import CompileEvents

    with CompileEvents() as events:
        staggered(sampler, prompts[:3], 24, slots=session_rows, chunk=3, fixed=True,
                  precompile=True)
    assert events.programs == [], events.programs
