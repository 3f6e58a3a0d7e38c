"""``sao report RUN_DIR``: PNG plots and a markdown summary from ``metrics.jsonl``.

Panels (those whose metrics exist): reward and accuracy, held-out accuracy, response length
and turns, policy lag (trajectory mean/max and histogram), DIS kept fraction by lag bucket and
advantage sign, ratio quantiles, critic value loss and explained variance, gradient norms,
throughput, engine faults, buffer and learner waits, weight-sync time.
"""

from __future__ import annotations

from pathlib import Path

from sao_megatron.observe import read_metrics

PANELS = [
    ("reward and accuracy", ["rollout/reward", "rollout/accuracy"]),
    ("held-out accuracy", ["eval/accuracy", "eval/mean_accuracy@", "eval/pass@"]),
    ("response length (tokens) and turns", ["rollout/response_tokens", "rollout/action_tokens", "rollout/turns"]),
    ("policy lag (versions)", ["lag/mean", "lag/max", "lag/token_mean"]),
    ("lag histogram (fraction of batch)", ["lag/hist0", "lag/hist1", "lag/hist2", "lag/hist3+"]),
    (
        "DIS kept fraction by token lag",
        ["dis/kept_frac/lag0", "dis/kept_frac/lag1", "dis/kept_frac/lag2", "dis/kept_frac/lag3+"],
    ),
    ("DIS kept fraction by advantage sign", ["actor/kept_frac/adv_pos", "actor/kept_frac/adv_neg", "actor/kept_frac"]),
    ("ratio quantiles", ["actor/ratio/p1", "actor/ratio/p50", "actor/ratio/p99", "actor/ratio/max"]),
    ("critic", ["critic/value_loss", "critic/explained_var", "critic/explained_var_first"]),
    ("gradient norms", ["actor/grad_norm", "critic/grad_norm"]),
    (
        "actor gradient RMS per module group",
        [
            "actor/grad_rms/attention",
            "actor/grad_rms/experts",
            "actor/grad_rms/router",
            "actor/grad_rms/head",
            "actor/grad_rms/embedding",
        ],
    ),
    (
        "critic gradient RMS per module group",
        [
            "critic/grad_rms/experts",
            "critic/grad_rms/router",
            "critic/grad_rms/head",
            "critic/grad_rms/embedding",
            "critic/grad_rms/other",
        ],
    ),
    ("throughput", ["rollout/trajectories_per_s", "rollout/tokens_per_s"]),
    ("engines: generating / occupied", ["rollout/engine_generating", "rollout/engine_occupancy"]),
    ("engine faults (cumulative)", ["rollout/engine_restarts", "rollout/engine_dropped", "rollout/episode_retries"]),
    (
        "waits and sync (s)",
        [
            "time/learner_wait_s",
            "buffer/wait_s",
            "buffer/group_wait_s",
            "time/sync_s",
            "time/sync_pause_s",
            "time/step_s",
        ],
    ),
    ("SFT", ["sft/nll"]),
    ("value pretraining", ["critic/explained_var", "critic/explained_var_first", "critic/value_loss"]),
]


def _series(records: list[dict], stage: str, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get("stage") == stage and isinstance(r.get(key), (int, float)):
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def _find(record_keys: set[str], key: str) -> str | None:
    """Exact key, the first key starting with ``key`` when it ends with ``@`` (``eval/pass@`` finds
    ``eval/pass@16``), or the one metric ending with ``/key`` (algo metrics carry a prefix)."""
    if key in record_keys:
        return key
    if key.endswith("@"):
        return min((k for k in record_keys if k.startswith(key)), default=None)
    matches = sorted(k for k in record_keys if k.endswith("/" + key) and "lag" not in k)
    return matches[0] if matches else None


def plot(run_dir: Path, records: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {k for r in records for k in r}
    out = []
    for i, (title, wanted) in enumerate(PANELS):
        stage = "sft" if title == "SFT" else "value_pretrain" if title == "value pretraining" else "rl"
        if title == "held-out accuracy":
            stage = "eval"
        lines = []
        for key in wanted:
            found = _find(keys, key)
            if found is None:
                continue
            xs, ys = _series(records, stage, found)
            if stage == "eval":
                rl_x, rl_y = _series(records, "rl", found)
                xs, ys = sorted(xs + rl_x), [y for _, y in sorted(zip(xs + rl_x, ys + rl_y, strict=True))]
            if xs:
                lines.append((found, xs, ys))
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for name, xs, ys in lines:
            ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = run_dir / "report" / f"{i:02d}_{title.split(' ')[0].replace('/', '_')}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        out.append(path)
    return out


def summary(records: list[dict]) -> str:
    rl = [r for r in records if r.get("stage") == "rl"]
    evals = [r for r in records if "eval/accuracy" in r]
    keys = [
        "rollout/reward",
        "rollout/accuracy",
        "rollout/response_tokens",
        "rollout/turns",
        "lag/mean",
        "lag/max",
        "critic/explained_var",
        "critic/explained_var_first",
        "critic/value_loss",
        "actor/grad_norm",
        "time/step_s",
        "time/sync_s",
        "time/learner_wait_s",
        "buffer/wait_s",
        "rollout/in_flight_at_take",
    ]
    all_keys = {k for r in rl for k in r}
    keys += sorted(k for k in all_keys if k.startswith("dis/kept_frac/lag") and "adv" not in k)
    kept = _find(all_keys, "kept_frac")
    if kept:
        keys.append(kept)
    lines = ["| metric | first 10 steps | last 10 steps |", "|---|---|---|"]
    for key in keys:
        first = [r[key] for r in rl[:10] if key in r]
        last = [r[key] for r in rl[-10:] if key in r]
        if first or last:
            fmt = lambda xs: f"{sum(xs) / len(xs):.4g}" if xs else "-"  # noqa: E731
            lines.append(f"| {key} | {fmt(first)} | {fmt(last)} |")
    head = [f"RL steps: {len(rl)}"]
    if evals:
        head.append(
            f"held-out accuracy: {evals[0]['eval/accuracy']:.3f} (start of RL, step {evals[0]['step']}) -> "
            f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']})"
        )
        for prefix, what in (("eval/mean_accuracy@", "mean accuracy over {k} samples"), ("eval/pass@", "pass@{k}")):
            key = _find({k for r in evals for k in r}, prefix)
            if key is None:
                continue
            with_key = [r for r in evals if key in r]
            head.append(
                f"held-out {what.format(k=key.split('@')[1])}: {with_key[0][key]:.3f} (step "
                f"{with_key[0]['step']}) -> {with_key[-1][key]:.3f} (step {with_key[-1]['step']})"
            )
    faults = [
        k
        for k in ("rollout/engine_restarts", "rollout/engine_dropped", "rollout/episode_retries")
        if rl and k in rl[-1]
    ]
    if faults:  # cumulative counts: the last step's are the run's
        head.append(
            "engine faults: " + ", ".join(f"{k.split('/')[1].replace('_', ' ')} {rl[-1][k]:.0f}" for k in faults)
        )
    if rl:
        head.append(f"wall time of RL: {rl[-1]['time'] - rl[0]['time'] + rl[0].get('time/step_s', 0):.0f} s")
    return "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"


def write_report(run_dir: str | Path) -> str:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no records; is this a run directory?")
    text = summary(records)
    plots = plot(run_dir, records)
    body = text + "\n" + "\n".join(f"![{p.stem}]({p.relative_to(run_dir)})" for p in plots) + "\n"
    (run_dir / "report.md").write_text(body)
    return f"{text}\nreport: {run_dir / 'report.md'} ({len(plots)} plots in {run_dir / 'report'})"
