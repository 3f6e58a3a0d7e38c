"""The pipeline simulator (``sao_megatron.plan.simulate``): exact cases, limits and orderings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sao_megatron.envs.longtail import LongTailTask
from sao_megatron.plan.simulate import EngineModel, LearnerModel, capacity, fit_prefill_s, simulate


def flat(tokens: int, turns: int, latency: float):
    return lambda i, g: ([tokens] * turns, [latency] * (turns - 1))


def longtail(sigma: float, seed: int = 0):
    task = LongTailTask(
        turns_median=3,
        turns_sigma=sigma,
        max_turns=12,
        tokens_median=24,
        tokens_sigma=sigma,
        max_tokens=128,
        tool_latency_s=0.3,
        tool_sigma=sigma,
        max_tool_latency_s=5.0,
        seed=seed,
    )
    return task.shape


def test_sync_scheme_matches_the_closed_form():
    """One engine, identical episodes, per-sequence cost 0: a batch's rollouts take exactly
    turns * (request + tokens * step) + tool latencies, then the learner step (its sync inside)."""
    engine = EngineModel(step_s=0.01, per_seq_s=0.0, request_s=0.05)
    learner = LearnerModel(step_s=0.7, sync_pause_s=0.2)
    r = simulate(
        "sync", engine, learner, flat(20, 3, 0.3), batch_size=8, group_size=4, max_concurrent=64, steps=6, warmup=1
    )
    period = 3 * (0.05 + 20 * 0.01) + 2 * 0.3 + 0.7
    assert r.trajectories_per_s == pytest.approx(8 / period, rel=1e-9)
    assert r.tokens_per_s == pytest.approx(8 * 60 / period, rel=1e-9)
    assert r.learner_idle == pytest.approx((period - 0.7) / period, rel=1e-9)
    assert r.lag_hist == {0: 1.0} and r.dropped_stale == 0


def test_free_learner_sao_runs_at_the_engines_capacity():
    engine = EngineModel(step_s=0.02, per_seq_s=0.001, request_s=0.01)
    shape = longtail(1.0)
    cap = capacity(engine, shape, max_concurrent=32, seconds=300)
    r = simulate(
        "sao",
        engine,
        LearnerModel(step_s=0.0),
        shape,
        batch_size=16,
        max_concurrent=32,
        steps=40,
        warmup=5,
        max_lag=None,
    )
    assert r.generated_tokens_per_s == pytest.approx(cap, rel=0.05)
    # decoding 32 sequences at once cannot beat that rate, and the tools keep some idle
    assert cap < engine.tokens_per_s(32)


def test_with_a_heavy_tail_sao_beats_async_grpo_beats_sync():
    engine = EngineModel(step_s=0.02, per_seq_s=0.001, request_s=0.01)
    learner = LearnerModel(step_s=0.5, sync_pause_s=0.1, engine_speed=1.0)
    shape = longtail(1.0)
    rates = {
        scheme: simulate(
            scheme,
            engine,
            learner,
            shape,
            batch_size=16,
            group_size=1 if scheme == "sao" else 4,
            max_concurrent=32,
            steps=40,
            warmup=5,
        ).tokens_per_s
        for scheme in ("sync", "async_grpo", "sao")
    }
    assert rates["sync"] < rates["async_grpo"] <= rates["sao"] * 1.05, rates
    assert rates["sao"] / rates["sync"] > 1.5, rates


def test_lag_bound_drops_stale_trajectories_and_slow_engines_make_lag():
    engine = EngineModel(step_s=0.02, per_seq_s=0.001, request_s=0.01)
    fast_learner = LearnerModel(step_s=0.05)
    shape = longtail(1.5)
    loose = simulate(
        "sao", engine, fast_learner, shape, batch_size=4, max_concurrent=64, steps=60, warmup=5, max_lag=None
    )
    tight = simulate("sao", engine, fast_learner, shape, batch_size=4, max_concurrent=64, steps=60, warmup=5, max_lag=1)
    assert loose.lag_mean > 1.0 and loose.dropped_stale == 0
    assert max(tight.lag_hist) <= 1 and tight.dropped_stale > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scheme": "sao", "group_size": 4}, "single rollouts"),
        ({"scheme": "sync", "batch_size": 6}, "multiple"),
        ({"scheme": "nope"}, "unknown scheme"),
        ({"scheme": "sao", "steps": 3, "warmup": 3}, "must exceed"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    args = {
        "batch_size": 8,
        "group_size": 4 if kwargs["scheme"] != "sao" else 1,
        "max_concurrent": 16,
    } | kwargs
    scheme = args.pop("scheme")
    with pytest.raises(ValueError, match=match):
        simulate(scheme, EngineModel(0.01, 0.0), LearnerModel(0.1), flat(4, 2, 0.1), **args)


def test_engine_fit_recovers_its_parameters():
    truth = EngineModel(step_s=0.03, per_seq_s=0.002)
    fit = EngineModel.from_probe(1, truth.tokens_per_s(1), 32, truth.tokens_per_s(32))
    assert fit.step_s == pytest.approx(0.03) and fit.per_seq_s == pytest.approx(0.002)


def test_sao_simulate_prints_the_schemes_and_the_best_split_of_the_30b_plan(capsys):
    from sao_megatron.cli import main

    rc = main(["simulate", "configs/qwen3_30b_a3b_math.yaml", "--steps", "8", "--warmup", "2", "--lag-bound", "5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"sync", "async_grpo", "sao"} <= set(rows)
    assert "32 (configured)" in out and "best within the bound: actor" in out
    tokens = {s: float(rows[s].split("|")[3].replace(",", "")) for s in ("sync", "sao")}
    assert tokens["sao"] > tokens["sync"] > 0, tokens
    # the policy-lag distribution: shares at lag 0, 1, 2, 3+ summing to 1; sync trains on-policy
    shares = {s: [float(v) for v in rows[s].split("|")[7].split("/")] for s in ("sync", "async_grpo", "sao")}
    assert all(len(v) == 4 and sum(v) == pytest.approx(1, abs=0.02) for v in shares.values()), shares
    assert shares["sync"][0] == 1.0 and shares["sao"][0] < 1.0, shares


def test_lag_shares_and_quantiles_of_a_histogram():
    from sao_megatron.plan.simulate import SimResult

    r = SimResult("sao", 10, 1.0, 1.0, 1.0, 1.0, 0.0, {0: 0.5, 1: 0.3, 3: 0.15, 6: 0.05}, 0, 1.0)
    assert r.lag_shares() == pytest.approx([0.5, 0.3, 0.0, 0.2])
    assert r.lag_shares(top=1) == pytest.approx([0.5, 0.5])
    assert [r.lag_quantile(q) for q in (0.5, 0.8, 0.9, 0.95, 1.0)] == [0, 1, 3, 3, 6]
    assert r.lag_mean == pytest.approx(0.3 + 0.45 + 0.3)


def test_the_per_turn_engine_time_is_fitted_to_a_measured_capacity():
    truth = EngineModel(step_s=0.02, per_seq_s=0.001, request_s=0.01, prefill_s=0.015)
    shape = longtail(1.0)
    measured = capacity(truth, shape, max_concurrent=16, seconds=300)
    fitted = fit_prefill_s(EngineModel(0.02, 0.001, 0.01), shape, measured, max_concurrent=16, seconds=300)
    assert fitted.prefill_s == pytest.approx(0.015, rel=0.1)
    assert capacity(fitted, shape, max_concurrent=16, seconds=300) == pytest.approx(measured, rel=0.02)
    # a prefill blocks every sequence's decoding: at a higher load it costs more throughput
    assert (
        capacity(truth, shape, max_concurrent=64, seconds=300)
        < capacity(EngineModel(0.02, 0.001, 0.01), shape, max_concurrent=64, seconds=300) * 0.9
    )


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize(
    "name",
    [
        "pipeline_cpu.json",  # the roles share the 2 cores
        "pipeline_cpu_pinned_toolbound.json",  # disjoint cores (--pin 0:1), tool-bound engine
        "pipeline_cpu_pinned.json",  # disjoint cores, compute-bound engine, one tail weight
    ],
)
def test_predictions_are_within_15_percent_of_the_measured_cpu_runs(name):
    """A committed real-stack measurement (``benchmarks/bench_pipeline.py``, see
    docs/PERFORMANCE.md): every arm's learner tokens/s and the engines' capacity at the synchronous
    arm's load, re-predicted here from the run's calibration (engine probe, capacity at the
    asynchronous load, measured step times, the engines' speed while learning fitted on the other
    tail weights), are within 15% of what was measured."""
    from benchmarks.bench_pipeline import ARMS, predict_all

    results = {
        sigma: {k: v for k, v in record.items() if k != "predicted"}
        for sigma, record in json.loads((RESULTS / name).read_text())["results"].items()
    }
    errors = {}
    for sigma, predicted in predict_all(results).items():
        record = results[sigma]
        capacity = record["capacity"]["at_concurrency"][str(record["args"]["batch"])]["generated_tokens_per_s"]
        errors[f"sigma {sigma} capacity at the batch's load"] = (
            predicted["capacity"][str(record["args"]["batch"])] / capacity - 1
        )
        for arm in ARMS:
            errors[f"sigma {sigma} {arm}"] = predicted[arm]["tokens_per_s"] / record[arm]["tokens_per_s"] - 1
    assert len(errors) == 4 * len(results) >= 4, errors
    assert all(abs(e) <= 0.15 for e in errors.values()), {k: f"{100 * v:+.1f}%" for k, v in errors.items()}
