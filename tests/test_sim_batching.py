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
    s.step()
    assert len(s.running) == 2 and len(s.waiting) == 1
    run(s)
    assert all(q.out == 5 for q in seqs)


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
