"""A continuous-batching engine scheduler, after vLLM v1's, without I/O or clocks.

Why it exists: Narwhal must be judged against an engine whose timing it does not
share. Real engines (vLLM v1, SGLang) run in *steps*: every step has a token budget
(``--max-num-batched-tokens``) that running sequences fill first (one token per
decode, or the rest of a chunked prefill), then waiting requests in arrival order;
at most ``--max-num-seqs`` sequences run; the KV cache is a pool of fixed-size blocks,
and when a running sequence cannot get a block the newest running sequence is
preempted and recomputed later; full prompt blocks are cached under chained hashes and
reused by later prompts with the same prefix (automatic prefix caching), least
recently used first out. As in vLLM v1, a sequence's block hashes cover its output too
(the engine hashes every full block of prompt and generated tokens, and caches it once
computed), so a follow-up turn that carries the reply in its prompt hits the reply's
blocks as well as the earlier prompt's. A step costs ``base + per_token * scheduled tokens +
per_ctx * context attended``, so decode load slows prefill and long contexts slow both.

``BatchScheduler.step()`` plans one step and returns its cost and what it produced;
the HTTP layer (``server.py``) sleeps that long and then shows the tokens to clients.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections import OrderedDict, deque
from dataclasses import dataclass, field

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class StepCost:
    """Milliseconds for one step: fixed, per scheduled token, per 1000 context tokens."""

    base_ms: float = 0.0
    per_token_ms: float = 0.0
    per_ktok_ctx_ms: float = 0.0

    def seconds(self, tokens: int, context: int) -> float:
        return (self.base_ms + self.per_token_ms * tokens
                + self.per_ktok_ctx_ms * context / 1000) / 1000


@dataclass(frozen=True, slots=True)
class Profile:
    """A GPU + model pairing; see docs/simulator.md for where the numbers come from."""

    cost: StepCost
    num_gpu_blocks: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256


@dataclass(frozen=True, slots=True)
class Intake:
    """What a request costs before it reaches the scheduler: vLLM's API server reads it,
    renders and tokenizes the prompt and hands it to the engine core, which takes new
    requests in only between steps. A fixed part and a part per prompt token; the
    defaults are vLLM 0.32's as measured (``server.py``'s docstring; the ``narwhal sim``
    flags take them from here)."""

    ms: float = 2.0
    us_per_token: float = 1.0

    def seconds(self, prompt_tokens: int) -> float:
        return (self.ms + self.us_per_token * prompt_tokens / 1000) / 1000


# Llama-3.1-8B (bf16: 16.1 GB of weights; KV 131 kB/token: 32 layers x 8 KV heads x 128
# x K,V x 2 bytes) by roofline on NVIDIA's datasheet figures: base = weights / HBM
# bandwidth x 1.2, per token = 2 x 8.03 GFLOP / (dense bf16 peak x 0.5 utilisation),
# context = KV bytes / HBM bandwidth; KV blocks = (0.9 x memory - weights) / 2.1 MB.
PROFILES: dict[str, Profile] = {
    "h100-llama3-8b": Profile(StepCost(5.8, 0.0325, 0.039), num_gpu_blocks=26_600),
    "a100-llama3-8b": Profile(StepCost(9.5, 0.103, 0.064), num_gpu_blocks=26_600),
    "l4-llama3-8b": Profile(StepCost(64.0, 0.265, 0.437), num_gpu_blocks=2_600),
}


def block_hashes(data: bytes, block_bytes: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: block i's hash covers blocks 0..i."""
    out: list[int] = []
    prev = b""
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        digest = hashlib.blake2b(prev + data[start:start + block_bytes], digest_size=8).digest()
        out.append(int.from_bytes(digest, "big"))
        prev = digest
    return out


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside the engine."""

    prompt: int  # prompt tokens
    max_out: int  # tokens it will generate
    hashes: list[int] = field(default_factory=list)  # full blocks of prompt + reply, chained
    # Tokens computed when each of ``hashes`` is full; empty: every block is 16 tokens
    # (a prompt's, or token IDs). A reply's blocks are cut from its rendered text, whose
    # length in tokens is the generator's, not the prompt's 4 bytes a token.
    full_at: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV exists
    out: int = 0  # tokens generated so far
    pinned: list[int] = field(default_factory=list)  # cached blocks it holds (hashes)
    private: int = 0  # blocks it holds that no one can share
    finished: bool = False
    aborted: bool = False
    cached_tokens: int = 0  # prefix-cache hit at its (last) admission

    def __post_init__(self) -> None:
        if not self.full_at:
            self.full_at = [(i + 1) * BLOCK_SIZE for i in range(len(self.hashes))]

    @property
    def blocks(self) -> int:
        return len(self.pinned) + self.private

    def full_blocks(self, tokens: int) -> int:
        """How many of its hashed blocks the first ``tokens`` tokens fill."""
        return bisect_right(self.full_at, tokens)


@dataclass(slots=True)
class StepResult:
    seconds: float
    tokens: int = 0  # scheduled tokens
    progressed: list[Seq] = field(default_factory=list)  # generated a token this step
    finished: list[Seq] = field(default_factory=list)
    preempted: int = 0
    # The step ran out of room (its token budget, the sequence cap or KV blocks) with work
    # left over: an engine whose steps are all full computes at its limit.
    full: bool = False


class BatchScheduler:
    def __init__(self, cost: StepCost, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, num_gpu_blocks: int = 65_536,
                 prefix_caching: bool = True) -> None:
        self.cost = cost
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_gpu_blocks = num_gpu_blocks
        self.prefix_caching = prefix_caching
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.ref: dict[int, int] = {}  # cached block hash -> sequences holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none (LRU)
        self.private = 0  # blocks held that are not in the cache
        # vLLM's counters (/metrics)
        self.queries = 0
        self.hits = 0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # -- requests --------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self.prompt_tokens += seq.prompt

    def abort(self, seq: Seq) -> None:
        if seq.finished or seq.aborted:
            return
        seq.aborted = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self._free_blocks() / self.num_gpu_blocks

    # -- blocks ----------------------------------------------------------------------
    def _free_blocks(self) -> int:
        """Blocks no sequence holds (cached-but-unheld ones included: they can be evicted)."""
        return self.num_gpu_blocks - len(self.ref) - self.private

    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Give ``seq`` blocks for ``tokens`` tokens; False when the pool is out."""
        need = -(-tokens // BLOCK_SIZE) - seq.blocks
        if need <= 0:
            return True
        if need > self._free_blocks():
            return False
        for _ in range(need):
            if self._free_blocks() - len(self.evictable) <= 0:
                self.evictable.popitem(last=False)  # reuse the least recently used
            seq.private += 1
            self.private += 1
        return True

    def _free(self, seq: Seq) -> None:
        # Tail blocks first, so that they are evicted before the prefix others share (vLLM).
        # A reply's text may fill more hashed blocks than its tokens hold KV blocks (the
        # generator's tokens are longer than the prompt's 4 bytes): those full blocks that
        # no KV block was left to pin are cached as the sequence lets go of its memory.
        if self.prefix_caching:
            full = min(seq.full_blocks(seq.computed), len(seq.hashes))
            for h in reversed(seq.hashes[len(seq.pinned):full]):
                if h not in self.ref and h not in self.evictable:
                    self.evictable[h] = None
        for h in reversed(seq.pinned):
            left = self.ref[h] - 1
            if left:
                self.ref[h] = left
            else:
                del self.ref[h]
                self.evictable[h] = None
        self.private -= seq.private
        seq.pinned, seq.private = [], 0

    def _hit(self, seq: Seq) -> int:
        """Pin the longest cached prefix; return the tokens it covers (never all)."""
        if not self.prefix_caching:
            return 0
        hit = 0
        # The blocks of the tokens it has (a recomputed sequence has its output too).
        for h in seq.hashes[:seq.full_blocks(seq.prompt + seq.out)]:
            if h in self.ref:
                self.ref[h] += 1
            elif h in self.evictable:
                del self.evictable[h]
                self.ref[h] = 1
            else:
                break
            seq.pinned.append(h)
            hit += 1
        # The last token is always computed (its logits sample the next one).
        return min(seq.full_at[hit - 1] if hit else 0, seq.prompt - 1 + seq.out)

    def _cache_full_blocks(self, seq: Seq) -> None:
        """Blocks that became full, prompt or reply, join the cache (vLLM v1)."""
        if not self.prefix_caching:
            return
        full = seq.full_blocks(seq.computed)
        while len(seq.pinned) < min(full, len(seq.hashes)) and seq.private > 0:
            h = seq.hashes[len(seq.pinned)]
            if h in self.ref or h in self.evictable:
                break  # someone else computed the same block: this copy stays private
            self.ref[h] = 1
            seq.pinned.append(h)
            seq.private -= 1
            self.private -= 1

    def _preempt(self, seq: Seq) -> None:
        """Recompute later: its KV goes, its generated tokens stay (vLLM v1)."""
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    # -- one step --------------------------------------------------------------------
    def step(self) -> StepResult:
        budget = self.budget
        scheduled: list[tuple[Seq, int]] = []
        preempted = 0
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted earlier in this step
            n = min(seq.prompt + seq.out - seq.computed, budget)
            if n <= 0:
                break
            while not self._grow(seq, seq.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                scheduled = [(s, k) for s, k in scheduled if s is not victim]
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
        while not preempted and self.waiting and budget > 0 and \
                len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.computed == 0:
                seq.computed = seq.cached_tokens = self._hit(seq)
                self.queries += seq.prompt
                self.hits += min(seq.cached_tokens, seq.prompt)
            n = min(seq.prompt + seq.out - seq.computed, budget)
            if not self._grow(seq, seq.computed + n):
                self._free(seq)  # wait for blocks; do not hold a cache hit meanwhile
                seq.computed = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        tokens = sum(n for _, n in scheduled)
        context = sum(s.computed + n for s, n in scheduled)
        result = StepResult(self.cost.seconds(tokens, context) if scheduled else 0.0,
                            tokens, preempted=preempted, full=budget <= 0 or bool(self.waiting))
        for seq, n in scheduled:
            seq.computed += n
            self._cache_full_blocks(seq)
            if seq.computed >= seq.prompt + seq.out:  # caught up: sample one token
                seq.out += 1
                self.generation_tokens += 1
                result.progressed.append(seq)
                if seq.out >= seq.max_out:
                    seq.finished = True
                    self.running.remove(seq)
                    self._free(seq)
                    result.finished.append(seq)
        return result
