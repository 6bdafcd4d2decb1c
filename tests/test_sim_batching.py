"""The simulator's continuous-batching scheduler, step by step (no clock, no I/O)."""

from __future__ import annotations

import pytest

from narwhal.sim.batching import BLOCK_SIZE, BatchScheduler, Seq, StepCost, block_hashes

COST = StepCost(base_ms=10, per_token_ms=0.1, per_ktok_ctx_ms=1)


def run(s: BatchScheduler, steps: int = 10_000) -> list:
    out = []
    for _ in range(steps):
        if not s.busy():
            return out
        out.append(s.step())
    raise AssertionError("did not drain")


def test_step_cost_counts_tokens_and_context():
    s = BatchScheduler(COST, max_num_batched_tokens=2048)
    s.add(Seq(prompt=1000, max_out=1))
    r = s.step()
    assert r.tokens == 1000
    assert r.seconds == pytest.approx((10 + 0.1 * 1000 + 1 * 1000 / 1000) / 1000)
    assert r.finished and r.progressed


def test_chunked_prefill_and_decodes_share_the_budget():
    s = BatchScheduler(COST, max_num_batched_tokens=512)
    decoding = Seq(prompt=10, max_out=100)
    s.add(decoding)
    s.step()  # its prefill: first token
    long = Seq(prompt=1200, max_out=2)
    s.add(long)
    sizes = []
    while long.out == 0:
        r = s.step()
        sizes.append(r.tokens)
    # one decode token per step, the rest of the budget to the chunked prefill
    assert sizes == [512, 512, 1 + 1200 - 2 * 511]
    assert decoding.out == 4


def test_prefill_waits_in_arrival_order():
    s = BatchScheduler(COST, max_num_batched_tokens=1000)
    a, b = Seq(prompt=1500, max_out=1), Seq(prompt=100, max_out=1)
    s.add(a)
    s.add(b)
    r1 = s.step()
    assert r1.tokens == 1000 and not r1.progressed  # a's first chunk; b must wait
    r2 = s.step()
    assert r2.progressed == [a, b] and r2.tokens == 600  # a's rest and b in one step


def test_max_num_seqs_keeps_the_rest_waiting():
    s = BatchScheduler(COST, max_num_seqs=2)
    seqs = [Seq(prompt=16, max_out=5) for _ in range(3)]
    for q in seqs:
        s.add(q)
    first = s.step()
    assert len(s.running) == 2 and len(s.waiting) == 1
    assert first.full  # a request left waiting: the cap, not the budget, filled it
    steps = run(s)
    assert all(q.out == 5 for q in seqs)
    # once the third runs, nothing waits and 3 tokens fill no 2048-token step
    assert not steps[-1].full


def test_a_step_is_full_when_its_budget_runs_out():
    s = BatchScheduler(COST, max_num_batched_tokens=64)
    s.add(Seq(prompt=100, max_out=2))
    chunk, last, decode = run(s)
    assert (chunk.tokens, chunk.full) == (64, True)  # nothing waits, the budget is spent
    assert (last.tokens, last.full) == (36, False)
    assert (decode.tokens, decode.full) == (1, False)


def test_prefix_cache_hits_skip_cached_blocks():
    data = bytes(range(256)) * 8  # 2048 bytes
    hashes = block_hashes(data, 4 * BLOCK_SIZE)
    s = BatchScheduler(COST)
    first = Seq(prompt=512, max_out=1, hashes=hashes)
    s.add(first)
    assert s.step().tokens == 512
    second = Seq(prompt=512, max_out=1, hashes=hashes)
    s.add(second)
    r = s.step()
    assert r.tokens == 1  # every block cached but the last token's
    assert second.cached_tokens == 511
    assert s.queries == 1024 and s.hits == 511
    other = Seq(prompt=512, max_out=1, hashes=block_hashes(b"x" + data[1:], 4 * BLOCK_SIZE))
    s.add(other)
    assert s.step().tokens == 512  # chained: a different first block misses every block


def test_lru_eviction_when_blocks_run_out():
    s = BatchScheduler(COST, num_gpu_blocks=4)
    a = Seq(prompt=32, max_out=1, hashes=block_hashes(b"a" * 128, 64))
    s.add(a)
    run(s)
    assert len(s.evictable) == 2 and s.kv_usage == 0.0
    b = Seq(prompt=48, max_out=1, hashes=block_hashes(b"b" * 192, 64))
    s.add(b)
    run(s)
    assert len(s.evictable) == 4  # one of a's blocks was reused: its tail, freed first
    c = Seq(prompt=32, max_out=1, hashes=block_hashes(b"a" * 128, 64))
    s.add(c)
    run(s)
    assert c.cached_tokens == 16  # a's first block survived


def test_kv_pressure_preempts_the_newest_and_recomputes_it():
    s = BatchScheduler(COST, num_gpu_blocks=6, max_num_batched_tokens=4096)
    old, new = Seq(prompt=40, max_out=40), Seq(prompt=40, max_out=40)
    s.add(old)
    s.add(new)
    results = run(s)
    assert sum(r.preempted for r in results) >= 1 and s.preemptions >= 1
    assert old.out == new.out == 40 and old.finished and new.finished
    assert s.private == 0 and not s.ref  # everything freed


def test_abort_frees_blocks():
    s = BatchScheduler(COST)
    q = Seq(prompt=100, max_out=50)
    s.add(q)
    s.step()
    assert s.kv_usage > 0
    s.abort(q)
    assert s.kv_usage == 0 and not s.busy()


def test_a_batch_of_one_prompt_is_its_one_prompt_as_in_vllm():
    from narwhal.sim.generate import SimOptions, make_plan

    ids = make_plan({"model": "narwhal-sim", "prompt": [[5, 6, 7]], "max_tokens": 2}, SimOptions(),
                    None, None)
    assert ids.prompt_token_ids == [5, 6, 7] and ids.prompt_tokens == 3
    text = make_plan({"model": "narwhal-sim", "prompt": ["narwhal tusk"], "max_tokens": 2}, SimOptions(),
                     None, None)
    flat = make_plan({"model": "narwhal-sim", "prompt": "narwhal tusk", "max_tokens": 2}, SimOptions(),
                     None, None)
    assert text.prompt_text == flat.prompt_text == "narwhal tusk"
    assert text.prompt_tokens == flat.prompt_tokens


def test_a_reply_is_cached_and_a_follow_up_carrying_it_hits_its_blocks():
    # vLLM v1 hashes every full block of a sequence, output included, and caches it once
    # computed: a follow-up turn whose prompt carries the reply hits the reply's blocks.
    data = bytes(range(256)) * 4  # 64 tokens of prompt, 64 of reply: 8 blocks of 16
    hashes = block_hashes(data, 8 * BLOCK_SIZE)
    s = BatchScheduler(COST)
    first = Seq(prompt=64, max_out=64, hashes=hashes)
    again = Seq(prompt=64, max_out=64, hashes=hashes)
    s.add(first)
    run(s)
    # The same prompt again (the same reply to come): only the prompt's blocks are known
    # at admission, so only they can hit, less the last token's.
    s.add(again)
    s.step()
    assert again.cached_tokens == 63
    run(s)
    follow = Seq(prompt=160, max_out=1, hashes=block_hashes(data + b"\xff" * 32 * 8, 8 * BLOCK_SIZE))
    s.add(follow)
    s.step()
    # Every block of prompt and reply but the last: the last sampled token is never
    # computed, so the block that holds it is never full in the cache.
    assert follow.cached_tokens == 112


def test_a_replys_text_blocks_are_cached_even_where_its_tokens_hold_fewer_kv_blocks():
    # Text replies are cut into the prompt's 64-byte blocks, and the generator's tokens
    # are longer than 4 bytes: more hashed blocks than KV blocks. The ones left unpinned
    # join the cache as the sequence ends; KV accounting stays by tokens.
    prompt = b"p" * 64
    reply = b"r" * 8 * 40  # 40 tokens of 8 bytes: 5 blocks of text, 3 KV blocks of reply
    hashes = block_hashes(prompt + reply, 64)
    full_at = [16] + [16 + 8 * (i + 1) for i in range(5)]
    s = BatchScheduler(COST)
    q = Seq(prompt=16, max_out=40, hashes=hashes, full_at=full_at)
    s.add(q)
    run(s)
    assert s.private == 0 and not s.ref
    assert set(hashes[:5]) <= set(s.evictable)  # the last needs the never-computed token
    assert hashes[5] not in s.evictable
    follow = Seq(prompt=100, max_out=1, hashes=hashes[:5])
    s.add(follow)
    s.step()
    assert follow.cached_tokens == 5 * 16


def test_the_engine_hashes_a_chat_reply_as_the_follow_up_renders_it():
    from narwhal.sim.generate import SimOptions, make_plan
    from narwhal.sim.server import _hashes

    body = {"model": "narwhal-sim", "max_tokens": 200, "messages": [
        {"role": "system", "content": "be brief " * 40}, {"role": "user", "content": "hi " * 30}]}
    plan = make_plan(body, SimOptions(), None, None)
    reply = "".join(t.piece for t in plan.choices[0])
    hashes, full_at = _hashes(plan)
    follow = make_plan({**body, "messages": [*body["messages"], {"role": "assistant", "content": reply},
                                             {"role": "user", "content": "more " * 30}]},
                       SimOptions(), None, None)
    follow_hashes, _ = _hashes(follow)
    prompt_blocks = len(plan.prompt_text.encode()) // 64
    reply_blocks = len(hashes) - prompt_blocks
    assert reply_blocks >= 3 and full_at[prompt_blocks] > plan.prompt_tokens
    assert full_at == sorted(full_at) and full_at[-1] <= plan.prompt_tokens + len(plan.choices[0])
    assert follow_hashes[:len(hashes)] == hashes  # prompt and reply, block for block
