"""The data-path benchmark's arithmetic (``bench.datapath``): what its report charges to
the router's whole path, and what it puts the non-streaming rate against. Fixed rows, so
a change to a line's sums fails here, not in a figure quoted from a run."""

from bench.datapath import Row, criteria, report, stream_line


def rows() -> list[Row]:
    return [
        Row("non-streaming", "request", "envoy", 2000.0, {"envoy": 100.0, "engine": 300.0}, 0),
        Row("non-streaming", "request", "null-compiled", 900.0,
            {"envoy": 500.0, "narwhal": 80.0, "engine": 550.0}, 0, messages=20.0),
        Row("non-streaming", "request", "narwhal-default", 600.0,
            {"envoy": 600.0, "narwhal": 900.0, "engine": 700.0}, 0),
        Row("streaming", "request", "envoy", 1000.0, {"envoy": 400.0, "engine": 560.0}, 0),
    ]


def test_the_whole_path_is_the_routers_and_the_engine_stands_apart():
    lines = report(rows())
    narwhal = next(line for line in lines if line.strip().startswith("narwhal-default"))
    # envoy 600 + narwhal 900: the engine's 700 is its own column, a ratio to its 300
    # beside Envoy alone
    assert "1500.0 15.00x" in narwhal
    assert narwhal.rstrip().endswith("700.0  2.33x")
    alone = next(line for line in lines if line.strip().startswith("envoy "))
    assert "100.0  1.00x" in alone and alone.rstrip().endswith("300.0  1.00x")


def test_the_non_streaming_rate_is_put_against_envoy_alone_relaying_the_engines_stream():
    lines = stream_line(rows())
    assert lines[0] == ""
    assert "1000/s, 50.0% of its rate with one body" in lines[1]
    assert "the engine 560.0 us a request streamed against 300.0 in one body" in lines[1]
    assert "Envoy 400.0 against 100.0" in lines[1]
    assert lines[2].endswith("null-compiled 90.0%, narwhal-default 60.0%")
    # (500 - 400) / 20: the only path whose messages were counted
    assert lines[3].endswith("per message: null-compiled 20.0, 5.0 us")


def test_without_a_streaming_row_there_is_nothing_to_put_it_against():
    assert stream_line([r for r in rows() if r.workload != "streaming"]) == []


def test_the_throughput_target_is_judged_as_written_and_shown_beside_the_stream():
    line = next(line for line in criteria(rows()) if "throughput" in line)
    # 600/s against 2000/s one-body (the target's 50%): not met, whatever the 60% beside
    assert line.strip().startswith("not met")
    assert line.endswith(": 30.0% (60.0% of Envoy alone's with the engine streaming the "
                         "answer, as it does for Narwhal)")



class _Toy:
    def outer(self) -> int:
        return self.inner() + 1

    def inner(self) -> int:
        return 1


def test_the_decisions_split_times_outermost_calls_while_measuring_and_restores():
    """``bench.messages --decisions``: a decision that calls another (a first token pumps
    the queue) is one call, timed once; nothing is counted outside a measured feed; the
    classes are as they were afterwards, the router's included."""
    from bench.messages import Decisions

    class ToyDecisions(Decisions):
        ENTRY_POINTS = ((_Toy, "outer"), (_Toy, "inner"))

    outer, inner = _Toy.outer, _Toy.inner
    d = ToyDecisions()
    with d.installed():
        assert _Toy.outer is not outer
        assert _Toy().outer() == 2  # not measuring: not counted
        assert d.calls == 0
        with d:
            assert _Toy().outer() == 2  # outer calls inner: one call
            assert _Toy().inner() == 1
        assert d.calls == 2 and set(d.by_entry) == {"_Toy.outer", "_Toy.inner"}
        assert d.seconds == sum(d.by_entry.values()) > 0
    assert _Toy.outer is outer and _Toy.inner is inner
    real = {(cls, name): cls.__dict__[name] for cls, name in Decisions.ENTRY_POINTS}
    with Decisions().installed():
        assert all(cls.__dict__[name] is not m for (cls, name), m in real.items())
    assert all(cls.__dict__[name] is m for (cls, name), m in real.items())


def test_each_real_vllm_admission_path_is_a_valid_config_with_its_settings():
    """``bench.vllm_admission``'s Narwhal paths: the defaults, and the least-work order with
    the prefill token bound (a typo in a setting's name fails config parsing here, not
    minutes into a run)."""
    from bench.vllm_admission import NARWHAL_PATHS, narwhal_config

    from narwhal.config import parse

    engine = {"name": "e", "url": "http://127.0.0.1:8000", "dialect": "vllm"}
    configs = {p: parse(narwhal_config([engine], 3000, p)) for p in NARWHAL_PATHS}
    default, least = configs["narwhal"], configs["least-work"]
    assert (default.admission.queue_order, default.scheduler.max_prefill_tokens_per_engine) \
        == ("fifo", 0)
    assert (least.admission.queue_order, least.scheduler.max_prefill_tokens_per_engine) \
        == ("least-work", 1536)
    assert least.admission.ttft_target_ms == default.admission.ttft_target_ms == 3000
    assert least.admission.queue_limit == 1024  # the path's settings add to the common ones


def test_the_report_tells_refusals_given_up_from_the_queue_by_their_message():
    """``summarize``'s ``gave up``: of the refusals, those whose message (Narwhal's own,
    built here by the function that builds it) says they waited in the queue; a refusal on
    arrival and one for the queue's wait limit do not; the refused clients' wait p90 is
    their time to the answer, in GPU-equivalent seconds."""
    from bench.scheduling import Result, summarize

    from narwhal.core import errors

    def refused(answer_s: float, error: errors.HttpError) -> Result:
        return Result(429, 0.0, answer_s=answer_s,
                      refusal=f"{error.code}: {error.message}")

    results = [Result(200, 0.0, ttft_s=0.5, answer_s=0.1),
               refused(2.0, errors.projected_over_budget(1.5, 1.0, 0.9)),
               refused(0.2, errors.projected_over_budget(1.5, 1.0)),
               refused(0.4, errors.queue_wait_over_limit(3.0, 2.0)),
               Result(503, 0.0, answer_s=0.3)]
    row = summarize(results, 10.0, 1.0, 2.0)
    assert row["refused"] == 0.8 and row["gave_up"] == 0.25
    assert row["refusal_wait90"] == 1.0  # 2.0 s at time scale 2
    assert summarize(results[:1], 10.0, 1.0, 1.0)["gave_up"] is None


def test_the_drift_report_times_the_first_reset_after_the_slowdown_and_windows_arrivals():
    """``bench.vllm_drift``: a reset before the slowdown is not the one found; arrivals are
    counted in the window they arrived in, late by their first token against the budget
    (never having one is late), refusals apart."""
    from bench.scheduling import Result
    from bench.vllm_drift import first_reset, meanwhile, windows

    def sample(t: float, resets: int) -> dict:
        return {"t": t, "engines": [{"drift_resets": resets}]}

    trace = [sample(98.0, 1), sample(99.5, 1), sample(100.5, 1), sample(104.0, 2)]
    assert first_reset(trace, 100.0) == 4.0  # not the warm-up's reset before it
    assert first_reset(trace[:3], 100.0) is None
    results = [Result(200, 95.0, ttft_s=1.0, predicted_s=1.0),  # before
               Result(200, 101.0, ttft_s=3.5, predicted_s=2.0),  # late, +0..+10
               Result(200, 102.0, ttft_s=None),  # admitted, never a first token: late
               Result(429, 103.0),
               Result(200, 115.0, ttft_s=2.0, predicted_s=1.0),  # +10..+30
               Result(200, 140.0, ttft_s=1.0, predicted_s=1.0)]  # after +30
    rows = windows(results, 100.0, 3.0)
    assert [(r["sent"], r["admitted"], r["late"], r["refused"]) for r in rows] == [
        (1, 1, 0, 0), (3, 2, 2, 1), (1, 1, 0, 0), (1, 1, 0, 0)]
    assert rows[1]["err90"] == abs(2.0 - 3.5) / 3.5 and rows[2]["err90"] == 0.5
    # Bounded (the engine fast again at 112): the slow period's arrivals only, around 100.
    rows = windows(results, 100.0, 3.0, end=112.0)
    assert [r["sent"] for r in rows] == [1, 3, 0, 0]
    rows = windows(results, 112.0, 3.0, start=100.0)  # around the speed-up
    assert [r["sent"] for r in rows] == [3, 1, 1, 0]
    # Meanwhile: admitted from a budget before the change (97) until it was found (+2.5).
    assert meanwhile(results, 100.0, 2.5, 3.0) == (2, 2)
    assert meanwhile(results, 100.0, None, 3.0) == (2, 4)  # never found: to the end


def test_the_prefix_report_puts_narwhals_predicted_cached_tokens_beside_the_engines():
    """``bench.vllm_prefix``: the cached share is vLLM's own (its usage) over every answer
    with usage; Narwhal's predicted share is judged over the requests it predicted, against
    what the engines found for those same requests; refusals carry no usage."""
    from bench.scheduling import Result
    from bench.vllm_prefix import cache_report

    told = [Result(200, 0.0, prompt_tokens=1000, cached=768, predicted_cached=768),
            Result(200, 0.0, prompt_tokens=500, cached=0, predicted_cached=128)]
    peer = Result(200, 0.0, prompt_tokens=200, cached=128)  # a peer router: no prediction
    refused = Result(429, 0.0)
    report = cache_report([*told, peer, refused])
    assert report["hit"] == (768 + 128) / 1700
    assert report["predicted_hit"] == (768 + 128) / 1500
    assert report["actual_hit"] == 768 / 1500
    assert report["exact"] == 0.5
    blind = cache_report([peer, refused])
    assert blind["hit"] == 128 / 200 and blind["predicted_hit"] is None


def test_each_prefix_policy_is_a_valid_config_with_its_prefix_knowledge(tmp_path):
    """``bench.vllm_prefix``'s Narwhal policies parse, and differ only as documented: the
    defaults and least-work subscribe to the engines' KV events, the blind one neither
    subscribes nor keeps an index; all carry the model's tokenizer."""
    from bench.vllm_prefix import Pool, narwhal_config
    from integration.vllm.engine import kv_server

    from narwhal.config import parse

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    pool = Pool([kv_server(f"e{i}", tmp_path, tmp_path) for i in range(2)])
    for i, engine in enumerate(pool.engines):
        engine.port = 8000 + i
    configs = {p: narwhal_config(pool, p, 3000, tokenizer)
               for p in ("narwhal", "narwhal-noprefix", "least-work")}
    for policy, raw in configs.items():
        config = parse(raw)
        subscribed = [bool(e.get("kv_events")) for e in raw["engines"]]
        assert subscribed == [policy != "narwhal-noprefix"] * 2, policy
        assert (config.scheduler.prefix_index_blocks == 0) == (policy == "narwhal-noprefix")
        assert config.sizing.tokenizer == str(tokenizer)
        assert (config.admission.queue_order == "least-work") == (policy == "least-work")


def test_the_prefix_workload_fits_the_models_context():
    """Every request of ``bench.vllm_prefix``'s conversations, its prompt in the model's
    own tokens (ChatML adds a few a message) and its ``max_tokens``, fits the 2,048-token
    context: vLLM refuses one that does not, which would count as an error, not load."""
    import random
    import tempfile
    from pathlib import Path

    from bench.vllm_prefix import tenants, workload
    from integration.vllm.model import MAX_MODEL_LEN, build
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(build(Path(tempfile.mkdtemp()), "small") / "tokenizer.json"))
    sizes = [len(tok.encode(t).ids) for t in tenants(32)]
    assert min(sizes) >= 300 and max(sizes) <= 1000  # the documented range, in tokens
    work, longest, turns = workload(1, 32), 0, 0
    for i in range(3000):
        messages, body = work.request(i)
        turns = max(turns, len(messages))
        prompt = sum(len(tok.encode(m["content"]).ids) + 6 for m in messages)
        longest = max(longest, prompt + body["max_tokens"])
        work.answered(messages, " ".join(random.Random(i).choices(["tusk", "pod"],
                                                                   k=body["max_tokens"])))
    assert turns == 6  # conversations do grow to their limit: three user turns
    assert longest < MAX_MODEL_LEN


def test_the_retrying_client_reads_the_hints_as_the_openai_client_does():
    """``bench.vllm_retries``: ``retry-after-ms`` first (the ``ms`` clients), else
    ``Retry-After``; the backoff without a hint (0.5 s, then 1 s, less up to 25%); no retry
    on ``x-should-retry: false``, a status the client does not retry, or a hint past two
    minutes; checked against the official client's own reading of the same headers."""
    import random

    import httpx
    import openai
    from bench.scheduling import Result
    from bench.vllm_retries import retry_delay

    rng = random.Random(1)
    refused = Result(429, 0.0, retry_after="1", retry_after_ms="1230", refusal=(
        "ttft_budget_exceeded: Projected time to first token 4230 ms exceeds the 3000 ms "
        "budget by 1230 ms; retry later"))
    assert retry_delay(refused, "ms", 0, rng) == 1.23
    assert retry_delay(refused, "seconds", 0, rng) == 1.0
    assert retry_delay(refused, "overrun", 0, rng) == 1.23
    client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="x")
    headers = httpx.Headers({"retry-after": "1", "retry-after-ms": "1230"})
    assert client._parse_retry_after_header(headers) == retry_delay(refused, "ms", 0, rng)
    full = Result(429, 0.0, retry_after="1", retry_after_ms="1000",
                  refusal="queue_full: Admission queue is full; retry")
    assert retry_delay(full, "overrun", 0, rng) == 1.0  # no overrun said: Retry-After
    for taken, base in ((0, 0.5), (1, 1.0)):
        delay = retry_delay(refused, "none", taken, rng)
        assert delay is not None and 0.75 * base <= delay <= base
    assert retry_delay(Result(429, 0.0, retry_after="2"), "ms", 0, rng) == 2.0
    assert retry_delay(Result(429, 0.0, should_retry="false"), "ms", 0, rng) is None
    assert retry_delay(Result(429, 0.0, retry_after="121"), "ms", 0, rng) is None
    assert retry_delay(Result(400, 0.0), "ms", 0, rng) is None
    assert retry_delay(Result(503, 0.0, retry_after="1"), "seconds", 0, rng) == 1.0


def test_the_retry_report_follows_each_user_request_through_its_attempts():
    """A chain served on its first attempt, one refused then served (its wait runs from the
    first attempt to the retry's first token), one refused to the end."""
    from bench.scheduling import Result
    from bench.vllm_retries import Chain, report

    first = Chain([Result(200, 0.0, ttft_s=1.0)])
    retried = Chain([Result(429, 10.0), Result(200, 10.5, ttft_s=2.0)], [0.5])
    late = Chain([Result(429, 20.0), Result(429, 20.3), Result(200, 21.0, ttft_s=4.0)],
                 [0.3, 0.7])
    given_up = Chain([Result(429, 30.0), Result(429, 31.0), Result(429, 32.0)], [1.0, 1.0])
    r = report([first, retried, late, given_up], duration=10.0, budget_s=3.0)
    assert r["chains"] == 0.4 and r["attempts"] == 0.9
    assert r["refused_first"] == 0.75
    assert r["recovered"] == 2 / 3 and r["recovered_in_budget"] == 1 / 3
    assert retried.waited_s() == 2.5 and late.waited_s() == 5.0
    assert r["retries"] == 5 and r["retries_admitted"] == 2 / 5
    assert r["in_budget"] == 2 / 3  # of the admitted attempts: 1.0 s, 2.0 s, 4.0 s
    assert r["goodput"] == 0.2 and r["served"] == 0.75


def test_the_interactive_share_is_drawn_from_the_seed_alone():
    """``--interactive``: the same requests name the objective whatever the policy (each
    cell's seeds are the same), in about the share asked for."""
    from bench.scheduling import INTERACTIVE, objective_of

    seeds = range(100_000, 104_000)
    picked = [objective_of(s, 0.25) for s in seeds]
    assert picked == [objective_of(s, 0.25) for s in seeds]
    assert set(picked) == {INTERACTIVE, ""}
    assert 0.22 < picked.count(INTERACTIVE) / len(picked) < 0.28
    assert {objective_of(s, 0.0) for s in seeds} == {""}


def test_the_heavy_share_is_drawn_from_the_seed_alone_apart_from_the_objective():
    """``--heavy``: every request names one of two fairness IDs, the same whatever the
    policy, in about the share asked for, and drawn apart from ``--interactive``'s
    objective (the heavy client's requests are no likelier to be interactive)."""
    from bench.scheduling import HEAVY, INTERACTIVE, LIGHT, flow_of, objective_of

    seeds = range(100_000, 104_000)
    flows = [flow_of(s, 0.75) for s in seeds]
    assert flows == [flow_of(s, 0.75) for s in seeds]
    assert set(flows) == {HEAVY, LIGHT}
    assert 0.72 < flows.count(HEAVY) / len(flows) < 0.78
    heavy = [s for s, f in zip(seeds, flows, strict=True) if f == HEAVY]
    share = sum(objective_of(s, 0.25) == INTERACTIVE for s in heavy) / len(heavy)
    assert 0.21 < share < 0.29
    assert {flow_of(s, 0.0) for s in seeds} == {""}


def test_each_drawn_class_is_reported_apart():
    """``apart``: the classes a run drew, each with its own results, for both benchmarks;
    one without results is left out, and without the flags there are none."""
    from bench.scheduling import HEAVY, INTERACTIVE, LIGHT, Result, apart

    def result(objective: str, flow: str) -> Result:
        r = Result(200, 0.0)
        r.objective, r.flow = objective, flow
        return r

    results = [result(INTERACTIVE, HEAVY), result("", HEAVY), result("", HEAVY)]
    got = {tag: len(part) for tag, part in apart(results, 0.25, 0.75)}
    assert got == {"int": 1, "rest": 2, HEAVY: 3}  # no light request: no light row
    assert LIGHT not in got and apart(results, 0.0, 0.0) == []


def test_the_class_options_come_back_in_the_reproduce_line_as_given():
    """``class_arguments``/``class_flags``: what a run was given is what it prints to
    rerun it; an option not given is left out."""
    import argparse

    from bench.scheduling import class_arguments, class_flags

    parser = argparse.ArgumentParser()
    class_arguments(parser, "here", "there")
    assert class_flags(parser.parse_args(["--heavy", "0.75"])) == " --heavy 0.75"
    assert class_flags(parser.parse_args(["--interactive", "0.2", "--heavy", "0.5"])) == (
        " --interactive 0.2 --heavy 0.5")
    assert class_flags(parser.parse_args([])) == ""
