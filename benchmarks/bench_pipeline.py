"""Pipeline efficiency with the real stack: SAO vs asynchronous and synchronous GRPO vs the
engines' own generation capacity, on a heavy-tailed synthetic workload.

One command runs, for each tail weight ``sigma`` (the lognormal sigma of turns, action tokens and
tool latency of the ``longtail`` environment, :mod:`sao_megatron.envs.longtail`), four arms on the
same load, one after the other:

    capacity     the run's SGLang engine(s) alone: a RolloutManager keeps ``--concurrency``
                 episodes in flight, nothing trains; generated tokens/s is the limit
    sync_grpo    ``sao train``: GRPO (group of --group, PPO clip-higher), batch barrier
                 (``algo.synchronous``: the next batch's rollouts start after the update)
    async_grpo   the same, group barrier only (a group trains once all its members finished)
    sao          ``sao train`` defaults: single rollout, learned critic (K = 2), DIS, no barrier

each ``sao train`` arm with real Megatron workers, Ray and the engine(s), the same model, batch
size (trajectories), concurrency and lag bound. From each arm's ``metrics.jsonl``, over the steps
after ``--warmup``: trajectories/s and action tokens/s consumed by the learner (the batch's
trajectories and their action tokens over the steps' wall time), the engines' generation rate
and its fraction of the capacity (``gen_util``), the learner's idle fraction (time waiting for a
batch over wall time), the mean buffer wait (finish -> taken by the learner) and group wait.

Writes ``--out`` (JSON) and prints a markdown table. By default, on this 2-core CPU machine, the
learner and the engine share the cores, so the capacity (measured alone) is not reachable by any
arm that also trains; the ratios between arms are what carries over. ``--pin ENGINE:REST`` (e.g.
``0:1``) gives the roles disjoint cores, as GPUs give them disjoint devices: every thread of
every engine process on the ENGINE cores, everything else (driver and agent loop, Ray, actor,
critic, this process) on the REST cores, in the capacity run and in every arm alike.

    .venv/bin/python benchmarks/bench_pipeline.py --out-dir DIR           # ~55 min on 2 cores
    .venv/bin/python benchmarks/bench_pipeline.py --quick               # smoke size (~5 min)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sao_megatron.config import load_config  # noqa: E402
from sao_megatron.observe import read_metrics  # noqa: E402
from sao_megatron.plan.simulate import Scheme  # noqa: E402

ARMS = ("sync_grpo", "async_grpo", "sao")

ARM_OVERRIDES: dict[str, list[str]] = {
    "sync_grpo": [
        "algo.advantage=grpo",
        "algo.policy_loss=ppo_clip",
        "algo.eps_low=0.2",
        "algo.eps_high=0.28",
        "algo.synchronous=true",
    ],
    "async_grpo": ["algo.advantage=grpo", "algo.policy_loss=ppo_clip", "algo.eps_low=0.2", "algo.eps_high=0.28"],
    "sao": [],
}


def workload(args, sigma: float) -> dict:
    """The ``longtail`` task kwargs of one tail weight."""
    return {
        "turns_median": args.turns,
        "turns_sigma": sigma,
        "max_turns": args.max_turns,
        "tokens_median": args.tokens,
        "tokens_sigma": sigma,
        "max_tokens": args.max_tokens,
        "tool_latency_s": args.tool_latency_s,
        "tool_sigma": sigma,
        "max_tool_latency_s": args.max_tool_latency_s,
        "seed": args.seed,
    }


def overrides(args, sigma: float, arm: str, run_dir: Path) -> list[str]:
    kw = json.dumps(workload(args, sigma)).replace('"', "")
    group = args.group if arm != "sao" else 1
    return [
        "configs/tiny_cpu.yaml",
        "rollout.env=longtail",
        f"rollout.task_kwargs={kw}",
        "rollout.env_kwargs={seed: 0}",
        f"rollout.max_concurrent={args.concurrency}",
        f"rollout.loop.max_turns={args.max_turns}",
        f"rollout.loop.max_new_tokens={args.max_tokens}",
        f"rollout.loop.max_response_tokens={args.max_turns * (args.max_tokens + 16)}",
        f"rollout.loop.max_context_tokens={args.max_turns * (args.max_tokens + 16) + 64}",
        f"rollout.max_total_tokens={max(16384, 2 * args.concurrency * (args.max_turns * (args.max_tokens + 16) + 64))}",
        f"algo.batch_size={args.batch}",
        f"algo.group_size={group}",
        "algo.critic_warmup_steps=0",
        f"algo.max_policy_lag={args.max_lag}",
        f"train.steps={args.steps}",
        "train.sft_steps=0",
        "train.value_pretrain_steps=0",
        "train.eval_every=0",
        "train.eval_prompts=4",
        "train.save_every=0",
        "train.sample_trajectories=0",
        f"run.seed={args.seed}",
        f"run.run_dir={run_dir}",
        *ARM_OVERRIDES[arm],
    ]


class CorePinner:
    """Keeps every thread of every SGLang engine process below this one on ``engine`` cores, and
    this process with everything else below it on ``rest`` (checked every ``period_s``: engines
    that start or restart, and threads they start later, are moved within a period).

    Affinity is per thread on Linux and a new thread inherits its creator's, so each engine
    process's threads are pinned one by one. Only processes this benchmark started (its
    descendants) are touched."""

    ENGINE_MARK = "sglang.launch_server"

    def __init__(self, engine: set[int], rest: set[int], period_s: float = 0.5):
        self.engine, self.rest, self.period_s = engine, rest, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="core-pinner", daemon=True)
        self.engine_threads: set[int] = set()

    @classmethod
    def parse(cls, spec: str) -> CorePinner:
        """``"0:1"`` or ``"0,1:2-3"``: engine cores, then the rest's."""
        try:
            engine, rest = (_cores(part) for part in spec.split(":"))
        except ValueError as e:
            raise ValueError(f"--pin {spec!r}: want ENGINE:REST core lists, e.g. 0:1 or 0-1:2,3 ({e})") from e
        available = os.sched_getaffinity(0)
        if engine & rest or not engine <= available or not rest <= available:
            raise ValueError(
                f"--pin {spec!r}: the two core sets must be disjoint and within this "
                f"process's cores {sorted(available)}"
            )
        return cls(engine, rest)

    def __enter__(self) -> CorePinner:
        import psutil

        for t in psutil.Process().threads():  # inherited by every process and thread started later
            os.sched_setaffinity(t.id, self.rest)
        self.pin_once()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.pin_once()

    def pin_once(self) -> None:
        import psutil

        me = psutil.Process()
        engine_roots = []
        for proc in me.children(recursive=True):
            try:
                if any(self.ENGINE_MARK in part for part in proc.cmdline()):
                    engine_roots.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        for root in engine_roots:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for proc in tree:
                try:
                    tids = [t.id for t in proc.threads()]
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                for tid in tids:
                    try:
                        if os.sched_getaffinity(tid) != self.engine:
                            os.sched_setaffinity(tid, self.engine)
                        self.engine_threads.add(tid)
                    except (ProcessLookupError, PermissionError):
                        continue  # the thread ended between the listing and the call


def _cores(text: str) -> set[int]:
    cores: set[int] = set()
    for item in text.split(","):
        lo, _, hi = item.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    if not cores:
        raise ValueError("empty core list")
    return cores


def run_arm(args, sigma: float, arm: str, out_dir: Path) -> dict:
    """One ``sao train`` arm; its steady-state figures from ``metrics.jsonl``."""
    run_dir = out_dir / f"sigma{sigma:g}" / arm
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_")}
    cmd = [sys.executable, "-m", "sao_megatron.cli", "train", *overrides(args, sigma, arm, run_dir)]
    t0 = time.perf_counter()
    log = run_dir.parent / f"{arm}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        rc = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.arm_timeout_s
        ).returncode
    if rc != 0:
        raise RuntimeError(f"{arm} (sigma {sigma:g}) exited {rc}; see {log}")
    rows = [r for r in read_metrics(run_dir) if r.get("stage") == "rl"]
    return {"wall_s": time.perf_counter() - t0, "run_dir": str(run_dir), **steady_state(rows, args.warmup)}


def steady_state(rows: list[dict], warmup: int) -> dict:
    """Learner-side rates over the steps after ``warmup`` (>= 1): the window starts when step
    ``warmup`` was logged (after its weight sync), as in :mod:`sao_megatron.plan.simulate`."""
    if warmup < 1 or len(rows) < warmup + 2:
        raise ValueError(f"need warmup >= 1 and more than {warmup + 1} logged RL steps, got {warmup}, {len(rows)}")
    start, window = rows[warmup - 1], rows[warmup:]
    wall = window[-1]["time"] - start["time"]
    trajectories = sum(r["rollout/batch_size"] for r in window)
    tokens = sum(r["rollout/batch_size"] * r["rollout/action_tokens"] for r in window)
    waited = sum(r["time/learner_wait_s"] for r in window)
    generated = sum(r["rollout/tokens_per_s"] * r["time/interval_s"] for r in window)
    out = {
        "steps": len(window),
        "window_s": wall,
        "trajectories_per_s": trajectories / wall,
        "tokens_per_s": tokens / wall,
        "generated_tokens_per_s": generated / wall,
        "learner_idle": waited / wall,
        "buffer_wait_s": statistics.fmean(r["buffer/wait_s"] for r in window),
        "lag_mean": statistics.fmean(r["lag/mean"] for r in window),
        "step_s": statistics.fmean(r["time/step_s"] for r in window),
        "sync_pause_s": statistics.fmean(r.get("time/sync_pause_s", 0.0) for r in window),
        "engine_generating": statistics.fmean(r["rollout/engine_generating"] for r in window),
        "engine_occupancy": statistics.fmean(r["rollout/engine_occupancy"] for r in window),
    }
    for key in ("dropped_stale", "dropped_failed", "dropped_group"):  # run totals (after the window)
        out[key] = window[-1].get(f"buffer/{key}", 0.0)
    groups = [r["buffer/group_wait_s"] for r in window if "buffer/group_wait_s" in r]
    out["group_wait_s"] = statistics.fmean(groups) if groups else 0.0
    return out


async def _capacity(args, sigma: float, model_dir: Path, out_dir: Path, window_s: float) -> dict:
    """The engines alone on the same load (:func:`_window`) at ``--concurrency`` episodes in flight
    (the asynchronous arms' load) and at ``--batch`` (the synchronous arm's); at ``--concurrency``
    again under 1..``--probe-hogs`` busy processes (their ratio to the unloaded rate is the
    engines' speed while the learner computes); then the decode probe."""
    from sao_megatron.driver.engines import start_engines
    from sao_megatron.envs.registry import make_task
    from sao_megatron.rollout.agent_loop import AgentLoop
    from sao_megatron.rollout.client import EngineClient
    from sao_megatron.tokenizer import load_tokenizer

    run_dir = out_dir / f"sigma{sigma:g}" / "capacity"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg = load_config(overrides(args, sigma, "sao", run_dir)[0], overrides(args, sigma, "sao", run_dir)[1:])
    # Random weights from the first arm's engine directory (config and tokenizer): the workload
    # fixes every action's length (min = max new tokens), so the weights do not change the load.
    engines = await start_engines(cfg, model_dir, run_dir, load_format="dummy")
    try:
        clients = [await EngineClient(e.url).__aenter__() for e in engines]
        tokenizer = load_tokenizer()
        loops = [AgentLoop(c, tokenizer, cfg.rollout.loop, engine_name=f"engine{i}") for i, c in enumerate(clients)]
        task = make_task("longtail", **cfg.rollout.task_kwargs)
        levels = sorted({args.concurrency, args.batch}, reverse=True)  # async arms' load, the sync arm's
        rates = {}
        for level in levels:
            rates[str(level)] = await _window(loops, task, cfg, level, window_s)
        loaded = {
            str(h): await _window(loops, task, cfg, args.concurrency, window_s / 2, hogs=h)
            for h in range(1, args.probe_hogs + 1)
        }
        probe = await _probe(clients[0], args.concurrency)
        probe["engine_speed_with_busy_procs"] = {
            h: w["generated_tokens_per_s"] / rates[str(args.concurrency)]["generated_tokens_per_s"]
            for h, w in loaded.items()
        }
        for c in clients:
            await c.__aexit__(None, None, None)
    finally:
        for e in engines:
            await asyncio.to_thread(e.stop)
    top = rates[str(args.concurrency)]
    return {**top, "at_concurrency": rates, "probe": probe}


async def _window(loops, task, cfg, concurrency: int, seconds: float, hogs: int = 0) -> dict:
    """``concurrency`` episodes kept in flight; after the first ``concurrency`` finished, the action
    tokens of the episodes finishing within ``seconds`` (never a draining tail). ``hogs``: that
    many single-thread busy processes (a learner rank each) run through the window: the rate the
    engines and the agent loop keep while the learner computes on the same cores."""
    from sao_megatron.rollout.manager import PromptCursor, RolloutManager

    marks: list[tuple[float, int]] = []

    def finished(traj) -> None:
        marks.append((time.monotonic(), traj.num_action_tokens))

    manager = RolloutManager(
        loops,
        task,
        "longtail",
        finished,
        max_concurrent=concurrency,
        env_kwargs=dict(cfg.rollout.env_kwargs),
        cursor=PromptCursor(),
    )
    stop = asyncio.Event()
    running = asyncio.create_task(manager.run(stop))
    while len(marks) < concurrency:  # warm-up: the first wave of episodes
        await asyncio.sleep(0.1)
    procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        start = time.monotonic()
        await asyncio.sleep(seconds)
        end = time.monotonic()
    finally:
        for proc in procs:  # started here: stopped here, by pid
            proc.kill()
            proc.wait()
    stop.set()
    await running
    await manager.drain(cancel=True)
    window = [n for t, n in marks if start < t <= end]
    return {
        "episodes": len(window),
        "window_s": end - start,
        "trajectories_per_s": len(window) / (end - start),
        "generated_tokens_per_s": sum(window) / (end - start),
    }


HOG = "import torch\ntorch.set_num_threads(1)\nx = torch.randn(384, 384)\nwhile True:\n    x = torch.tanh(x @ x)"


async def _probe(client, concurrency: int, tokens: int = 32) -> dict:
    """The decode model of :class:`~sao_megatron.plan.simulate.EngineModel`: one-token request
    latency and the per-iteration time at 1 and at ``concurrency`` sequences (``tokens`` each,
    started together)."""
    from sao_megatron.rollout.client import SamplingParams

    prompt = [2] + [40 + 7 * k % 400 for k in range(14)]

    async def wall(n: int, new_tokens: int) -> float:
        sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        await asyncio.gather(*(client.generate(prompt, sampling) for _ in range(n)))
        return time.perf_counter() - t0

    await wall(concurrency, tokens)  # warm-up
    one = statistics.median([await wall(1, 1) for _ in range(5)])
    single = statistics.median([await wall(1, tokens) for _ in range(3)])
    per_iter_1 = (single - one) / (tokens - 1)
    request_s = max(0.0, one - per_iter_1)

    def per_iter(seconds: float) -> float:
        return max(1e-6, (seconds - request_s) / tokens)

    many = per_iter(statistics.median([await wall(concurrency, tokens) for _ in range(3)]))
    return {"request_s": request_s, "n1": 1, "rate1": 1 / per_iter_1, "n2": concurrency, "rate2": concurrency / many}


SCHEME: dict[str, Scheme] = {"sync_grpo": "sync", "async_grpo": "async_grpo", "sao": "sao"}


def _calibrated(record: dict):
    """(engine model, episode shapes) of one tail weight's record: the decode probe's model with the
    per-turn engine time fitted so that the simulated capacity at ``--concurrency`` equals the
    measured one."""
    from sao_megatron.envs.longtail import LongTailTask
    from sao_megatron.plan.simulate import EngineModel, fit_prefill_s

    args, probe = record["args"], record["capacity"]["probe"]
    shape = LongTailTask(**record["workload"]).shape

    probed = EngineModel.from_probe(probe["n1"], probe["rate1"], probe["n2"], probe["rate2"], probe["request_s"])
    c = args["concurrency"]
    measured = record["capacity"]["at_concurrency"][str(c)]["generated_tokens_per_s"]
    return fit_prefill_s(probed, shape, measured, max_concurrent=c), shape


def _simulate_arm(record: dict, engine, shape, arm: str, speed: float):
    from sao_megatron.plan.simulate import LearnerModel, simulate

    args, m = record["args"], record[arm]
    learner = LearnerModel(step_s=m["step_s"], sync_pause_s=m["sync_pause_s"], engine_speed=speed)
    return simulate(
        SCHEME[arm],
        engine,
        learner,
        shape,
        batch_size=args["batch"],
        group_size=1 if arm == "sao" else args["group"],
        max_concurrent=args["concurrency"],
        max_lag=args["max_lag"],
        steps=args["steps"],
        warmup=args["warmup"],
    )


def _fit_speed(record: dict, engine, shape, arm: str) -> float:
    """The engines' speed while ``arm``'s learner computes at which the simulated arm consumes the
    measured tokens/s (bisection over (0, 1])."""
    measured = record[arm]["tokens_per_s"]
    lo, hi = 0.02, 1.0
    if _simulate_arm(record, engine, shape, arm, hi).tokens_per_s <= measured:
        return hi
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _simulate_arm(record, engine, shape, arm, mid).tokens_per_s < measured else (lo, mid)
    return (lo + hi) / 2


def predict_all(results: dict[str, dict]) -> dict[str, dict]:
    """The simulator's prediction of every measured arm (``results``: the JSON's, by tail weight).

    Calibration, per tail weight: the capacity run (the decode probe; the per-turn engine time
    fitted to the capacity at ``--concurrency``) and each arm's measured mean step time and engine
    pause. The engines' speed while the learner computes (on this machine the learner shares the
    2 cores with the engine and the agent loop; on GPUs it is 1) is fitted per asynchronous arm on
    the *other* tail weights' runs of that arm and averaged (leave-one-out), so no arm's prediction
    uses its own throughput. Predicted: the capacity at ``--batch`` and every arm's throughput,
    idle time and lag."""
    from sao_megatron.plan.simulate import capacity

    calibrated = {sigma: _calibrated(record) for sigma, record in results.items()}
    fitted = {
        (sigma, arm): _fit_speed(record, *calibrated[sigma], arm)
        for sigma, record in results.items()
        for arm in ("async_grpo", "sao")
        if arm in record
    }
    out: dict[str, dict] = {}
    for sigma, record in results.items():
        engine, shape = calibrated[sigma]
        pred: dict[str, dict] = {
            "engine": {
                "step_s": engine.step_s,
                "per_seq_s": engine.per_seq_s,
                "request_s": engine.request_s,
                "prefill_s": engine.prefill_s,
            },
            "capacity": {
                c: capacity(engine, shape, max_concurrent=int(c)) for c in record["capacity"]["at_concurrency"]
            },
            "engine_speed_while_learning": {},
        }
        for arm in SCHEME:
            if arm not in record:
                continue
            others = [v for (s, a), v in fitted.items() if a == arm and s != sigma]
            speed = statistics.fmean(others) if others else 1.0
            pred["engine_speed_while_learning"][arm] = speed
            r = _simulate_arm(record, engine, shape, arm, speed)
            pred[arm] = {
                "trajectories_per_s": r.trajectories_per_s,
                "tokens_per_s": r.tokens_per_s,
                "generated_tokens_per_s": r.generated_tokens_per_s,
                "learner_idle": r.learner_idle,
                "lag_mean": r.lag_mean,
            }
        out[sigma] = pred
    return out


def capacity_arm(args, sigma: float, model_dir: Path, out_dir: Path, window_s: float) -> dict:
    return asyncio.run(_capacity(args, sigma, model_dir, out_dir, window_s))


def cached(path: Path, measure) -> dict:
    """``measure()``, kept in ``path``: a rerun with the same ``--out-dir`` resumes where it stopped
    (delete the directory to measure again)."""
    if path.exists():
        return json.loads(path.read_text())
    result = measure()
    path.write_text(json.dumps(result, indent=1))
    return result


def table(results: dict) -> str:
    lines = [
        "| tail sigma | arm | learner traj/s | learner tokens/s | vs capacity | gen. util | learner idle "
        "| buffer wait s | group wait s | lag | vs sync | simulated tokens/s (error) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sigma, arms in results.items():
        cap, pred = arms["capacity"], arms["predicted"]
        c = str(arms["args"]["concurrency"])
        err = pred["capacity"][c] / cap["generated_tokens_per_s"] - 1
        lines.append(
            f"| {sigma} | capacity (engines alone, {cap['window_s']:.0f} s) | {cap['trajectories_per_s']:.2f} | "
            f"{cap['generated_tokens_per_s']:.0f} | 1.00 | 1.00 | - | - | - | - | - | "
            f"{pred['capacity'][c]:.0f} ({100 * err:+.0f}%) |"
        )
        sync = arms["sync_grpo"]["tokens_per_s"]
        for arm in ARMS:
            a = arms[arm]
            err = pred[arm]["tokens_per_s"] / a["tokens_per_s"] - 1
            lines.append(
                f"| {sigma} | {arm} | {a['trajectories_per_s']:.2f} | {a['tokens_per_s']:.0f} | "
                f"{a['tokens_per_s'] / cap['generated_tokens_per_s']:.2f} | "
                f"{a['generated_tokens_per_s'] / cap['generated_tokens_per_s']:.2f} | {a['learner_idle']:.2f} | "
                f"{a['buffer_wait_s']:.1f} | {a['group_wait_s']:.1f} | {a['lag_mean']:.2f} | "
                f"{a['tokens_per_s'] / sync:.2f} | {pred[arm]['tokens_per_s']:.0f} ({100 * err:+.0f}%) |"
            )
    return "\n".join(lines)


def measure(
    args,
    arms: list[str],
    sigmas: list[float],
    windows: dict[float, float],
    out_dir: Path,
    out: Path,
    results: dict[str, dict],
) -> None:
    """Every arm and the capacity of every tail weight (cached per arm under ``out_dir``) into
    ``results``, written to ``out`` after each tail weight."""
    for sigma in sigmas:
        res: dict[str, dict] = {}
        for arm in arms:
            print(f"sigma {sigma:g}: {arm} ...", flush=True)
            res[arm] = cached(out_dir / f"sigma{sigma:g}" / f"{arm}.json", partial(run_arm, args, sigma, arm, out_dir))
            print(
                f"  {json.dumps({k: round(v, 3) for k, v in res[arm].items() if isinstance(v, float)})}",
                flush=True,
            )
            if len(res) == 1:  # the engines alone, from the first arm's engine directory
                print(f"sigma {sigma:g}: capacity ...", flush=True)
                model_dir = Path(res[arm]["run_dir"]) / "hf" / "engine"
                res["capacity"] = cached(
                    out_dir / f"sigma{sigma:g}" / "capacity.json",
                    partial(capacity_arm, args, sigma, model_dir, out_dir, windows[sigma]),
                )
                print(f"  {json.dumps(res['capacity'])}", flush=True)
        res["workload"], res["args"] = workload(args, sigma), vars(args)
        results[f"{sigma:g}"] = res
        out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tails",
        default="0.25,1.0,1.5",
        help="comma-separated lognormal sigmas (turns, tokens, tool latency)",
    )
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="RL steps left out of the rates")
    p.add_argument("--batch", type=int, default=16, help="trajectories per learner step")
    p.add_argument("--group", type=int, default=4, help="GRPO group size")
    p.add_argument("--concurrency", type=int, default=32, help="episodes in flight (rollout.max_concurrent)")
    p.add_argument("--max-lag", type=int, default=4)
    p.add_argument("--turns", type=float, default=3.0, help="median turns per episode")
    p.add_argument("--max-turns", type=int, default=12)
    p.add_argument("--tokens", type=float, default=24.0, help="median action tokens per turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tool-latency-s", type=float, default=0.3, help="median tool latency")
    p.add_argument("--max-tool-latency-s", type=float, default=5.0)
    p.add_argument(
        "--capacity-s",
        default="60,60,150",
        help="capacity window (s) per tail weight, or one for all: a heavier tail needs a longer one",
    )
    p.add_argument("--probe-hogs", type=int, default=2, help="busy processes the engine speed is probed under")
    p.add_argument(
        "--pin",
        default="",
        metavar="ENGINE:REST",
        help="disjoint cores for the engines and for everything else, e.g. 0:1 (see above)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--arm-timeout-s", type=float, default=1800.0)
    p.add_argument("--out-dir", default="/tmp/sao-bench-pipeline")
    p.add_argument("--out", default="", help="JSON results (default: <out-dir>/pipeline.json)")
    p.add_argument("--quick", action="store_true", help="smoke size: one tail, 5 steps, batch 8")
    args = p.parse_args()
    if args.quick:
        args.tails, args.steps, args.batch, args.concurrency, args.capacity_s = "1.0", 5, 8, 16, "30"
        args.warmup = 1
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else out_dir / "pipeline.json"
    arms = [a for a in args.arms.split(",") if a]
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    sigmas = [float(x) for x in args.tails.split(",")]
    given = [float(x) for x in str(args.capacity_s).split(",")]
    if len(given) not in (1, len(sigmas)):
        p.error(f"--capacity-s: give one window or one per tail weight ({len(sigmas)}), got {args.capacity_s!r}")
    windows = dict(zip(sigmas, given * len(sigmas) if len(given) == 1 else given, strict=True))
    try:
        pinner = CorePinner.parse(args.pin) if args.pin else None
    except ValueError as e:
        p.error(str(e))
    with pinner or contextlib.nullcontext():
        measure(args, arms, sigmas, windows, out_dir, out, results)
    if set(ARMS) <= set(arms):
        for sigma, pred in predict_all(results).items():
            results[sigma]["predicted"] = pred
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "wall_s": time.perf_counter() - t0,
        "args": vars(args),
    }
    out.write_text(json.dumps({**meta, "results": results}, indent=1))
    print(table(results) if set(ARMS) <= set(arms) else json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
