"""Slurm end to end over several nodes: ``sao submit`` -> launch/slurm/sao.sbatch -> one Ray cluster.

Runs only with ``SAO_SLURM_MULTINODE_TEST=1`` on the five-node cluster that
``.ci/slurm_multinode.sh`` builds on one machine: nodes n1..n5 are network namespaces with
addresses 10.200.0.1..5 on a private bridge, one CPU each as Ray sees them. With one Ray CPU per
trainer rank the tiny run's 2-rank actor world must form across n1+n2, the critic runs on n3, and
the SGLang engine is one TP=2 engine spanning n4+n5 (``rollout.nodes_per_engine=2``: one SGLang
process per node, node 0 serving HTTP, the two meeting at n4's address). Evidence comes from each node's own logs: every
trainer rank prints ``[sao-rank] ... on host nN addresses <its node's IPs>``
(``workers.rank.init_rank``), actor rank 0 prints the weight-sync group address and the engine
URLs it broadcasts to (``workers.actor``), each SGLang process logs the address it serves on or
the weight-sync groups its rank joined, and Ray's per-node
logs name each node's IP.

One job runs the tiny run over the five nodes, the way a preempted run does: ``sao submit``
(requeueable, ``sao train --resume-if-present``), stopped after its first RL step by the
``USR1`` Slurm sends before the time limit (the launcher forwards it to the driver, which
checkpoints and exits), then ``scontrol requeue``: Slurm restarts it on its five nodes, it resumes
from that checkpoint by itself, completes and reports. The restarted attempt's logs are the
evidence above; the run state is the uninterrupted run's, step by step (synchronous, lag 0: step k
trains prompts B(k-1)..Bk-1 for batch size B).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sao_megatron.config import load_config
from tests.launch.test_slurm import JOB_TIMEOUT_S, TINY, _assert_ray_gone, _env, _logs, _submit, _wait

pytestmark = pytest.mark.skipif(
    os.environ.get("SAO_SLURM_MULTINODE_TEST") != "1",
    reason="needs the five-node Slurm cluster of .ci/slurm_multinode.sh (SAO_SLURM_MULTINODE_TEST=1)",
)

NET = "10.200.0."
NODE_IP = {f"n{i}": f"{NET}{i}" for i in range(1, 6)}
# The actor in two pipeline stages, one per node: each stage's rank sends its own weights.
GROUPS = [
    "cluster.actor_nodes=2",
    "cluster.critic_nodes=1",
    "cluster.rollout_nodes=2",
    "actor.parallel.world_size=2",
    "actor.parallel.pipeline_parallel=2",
    "critic.parallel.world_size=1",
    "rollout.tensor_parallel=2",
    "rollout.nodes_per_engine=2",
    "cluster.cpus_per_rank=1",
]
# Synchronous and lag 0: the prompt sequence per step is deterministic (the requeued run is compared with it).
RUN = [
    *TINY,
    *GROUPS,
    "algo.critic_warmup_steps=1",  # the actor trains at steps 2 and 3: weights synced after each
    "algo.synchronous=true",
    "algo.max_policy_lag=0",
    "train.steps=3",
    "train.save_every=1",
]
RANK_LINE = re.compile(r"\[sao-rank\] rank (\d+) of (\d+) on host (\S+) addresses (\S+)")
SYNC_LINE = re.compile(
    r"\[sao-weight-sync\] \w+ group \S+ at ([\d.]+):\d+ \(trainer rank (\d+), stage (\d+)\) -> engines (.+)"
)


def _multinode_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Like the one-node tests, but Ray must advertise each node's own address, not 127.0.0.1."""
    env = _env(tmp_path, **extra)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    # Ray's temp dir on node-local scratch (each node sees its own directory at this path).
    env["SAO_RAY_TMP"] = f"{os.environ['SAO_NODE_TMP']}/{Path(env['SAO_RAY_TMP']).name}"
    return env


def _last_attempt(path: Path) -> str:
    """A rank's log from its last process on (the logs are appended to across a job's restarts;
    ``sao_megatron.logs.redirect_process_output`` starts each process's part with a header)."""
    text = path.read_text(errors="replace")
    return text[text.rfind("---- pid ") :]


def _ranks(run_dir: Path, role: str, world_size: int) -> dict[int, tuple[str, set[str]]]:
    """rank -> (hostname, its node's addresses), from each rank's own log (the last attempt)."""
    out = {}
    for path in sorted((run_dir / "logs").glob(f"{role}_rank*.log")):
        for rank, world, host, addresses in RANK_LINE.findall(_last_attempt(path)):
            assert int(world) == world_size, path
            out[int(rank)] = (host, set(addresses.split(",")))
    return out


def _per_step_prompts(state: dict) -> dict[int, set]:
    """step -> the (split, index, member) trained at it, from a run state."""
    steps: dict[int, set] = {}
    for step, split, index, member in state["trained_prompts"]:
        steps.setdefault(step, set()).add((split, index, member))
    return steps


def _uninterrupted(steps: int) -> dict[int, set]:
    """What an uninterrupted synchronous run trains at steps 1..``steps`` (the cursor's order)."""
    algo = load_config(RUN[0], RUN[1:]).algo
    prompts, members = algo.batch_size // algo.group_size, algo.group_size
    return {
        k: {("train", i, m) for i in range(prompts * (k - 1), prompts * k) for m in range(members)}
        for k in range(1, steps + 1)
    }


@dataclass
class RequeuedRun:
    run_dir: Path
    job_id: str
    job: dict[str, str]
    """``scontrol show job`` once the restarted job ended."""
    stopped: dict
    """The run state the stopped attempt left (its checkpoint)."""
    stopped_logs: str
    logs: str

    @property
    def job_dir(self) -> Path:
        """The restarted attempt's launcher logs (``sao.sbatch``: ``job-<id>-restart<N>``)."""
        return self.run_dir / "slurm" / f"job-{self.job_id}-restart{self.job['Restarts']}"


@pytest.fixture(scope="module")
def requeued_run(tmp_path_factory) -> RequeuedRun:
    """The acceptance run, shared by the tests below: stopped by USR1 after its first RL step, then
    requeued; it resumes and completes."""
    tmp_path = tmp_path_factory.mktemp("multinode")
    run_dir = tmp_path / "run"
    env = _multinode_env(tmp_path, SAO_TRAIN="sao train --report")
    t0 = time.monotonic()
    job_id = _submit([*RUN, f"run.run_dir={run_dir}"], env)
    state = run_dir / "checkpoint" / "state.json"

    def after_first_rl_step(job: dict[str, str]) -> bool:
        return state.exists() and json.loads(state.read_text()).get("step", 0) >= 1

    _wait(job_id, JOB_TIMEOUT_S, until=after_first_rl_step, poll_s=0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    job = _wait(job_id, 300)
    stopped_logs = _logs(run_dir, job_id)
    assert job["JobState"] in ("COMPLETED", "FAILED"), f"{job}\n{stopped_logs}"  # the driver's exit status decides
    stopped = json.loads(state.read_text())
    _assert_ray_gone(env)
    stopped_s = time.monotonic() - t0

    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)

    def restarted(job: dict[str, str]) -> bool:
        if job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime":  # requeue defers the start
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=30)
        return False

    job = _wait(job_id, JOB_TIMEOUT_S, until=restarted)
    logs = _logs(run_dir, job_id)
    assert job["JobState"] == "COMPLETED" and int(job.get("Restarts", "0")) >= 1, f"{job}\n{logs}"
    _assert_ray_gone(env)
    print(
        f"\nslurm multi-node run: job {job_id} stopped at step {stopped['step']} after {stopped_s:.0f} s, "
        f"requeued, COMPLETED after {time.monotonic() - t0:.0f} s (submit to COMPLETED)"
    )
    return RequeuedRun(run_dir, job_id, job, stopped, stopped_logs, logs)


def test_usr1_before_the_time_limit_makes_sao_train_checkpoint_and_stop(requeued_run):
    """``--signal=B:USR1@120`` reaches the batch shell; the launcher forwards it to the real driver
    (SIGINT), which checkpoints in ``finally:`` and exits, having trained the uninterrupted run's
    prompts for its steps."""
    run, steps = requeued_run, requeued_run.stopped["step"]
    stopped = (run.run_dir / "slurm" / f"job-{run.job_id}" / "train.log").read_text(errors="replace")
    assert "received SIGUSR1" in run.stopped_logs, run.stopped_logs
    assert "stopped by a signal" in stopped, stopped[-3000:]
    assert 1 <= steps < 3 and _per_step_prompts(run.stopped) == _uninterrupted(steps), run.stopped


def test_requeued_job_resumes_and_trains_the_same_prompts(requeued_run):
    """Slurm restarts the requeued job on its five nodes; it resumes from the latest complete
    checkpoint by itself and trains, step by step, the prompts of an uninterrupted run."""
    run = requeued_run
    train_log = (run.job_dir / "train.log").read_text(errors="replace")
    assert "resuming from the complete checkpoint" in train_log, train_log[-3000:]
    assert f"Slurm restart count {run.job['Restarts']}" in train_log, train_log[-3000:]
    state = json.loads((run.run_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and _per_step_prompts(state) == _uninterrupted(3), run.logs
    keys = [tuple(k[1:]) for k in state["trained_prompts"]]
    assert len(keys) == len(set(keys)), "a prompt was trained twice"


def test_tiny_run_over_five_nodes_completes_and_reports(requeued_run):
    run = requeued_run
    assert (run.run_dir / "report.md").exists(), run.logs
    assert "report.md" in (run.job_dir / "train.log").read_text()
    topology = (run.job_dir / "topology.env").read_text().replace("\\", "")  # printf %q escapes commas
    assert f"SAO_HEAD_ADDRESS={NODE_IP['n1']}:" in topology, topology
    for line in (
        "SAO_NUM_NODES=5",
        "SAO_ACTOR_NODELIST=n1,n2",
        "SAO_CRITIC_NODELIST=n3",
        "SAO_ROLLOUT_NODELIST=n4,n5",
    ):
        assert line in topology, topology


def test_every_node_ran_its_own_ray_daemon(requeued_run):
    """Ray's own per-node logs: the head on n1, a worker on each other node, each at its address."""
    run = requeued_run
    expected = {
        "ray-head-n1.log": "n1",
        "ray-actor-n2.log": "n2",
        "ray-critic-n3.log": "n3",
        "ray-rollout-n4.log": "n4",
        "ray-rollout-n5.log": "n5",
    }
    for name, node in expected.items():
        text = (run.job_dir / name).read_text(errors="replace")
        assert f"Local node IP: {NODE_IP[node]}" in text, f"{name}:\n{text[-2000:]}"


def test_role_worlds_formed_across_their_own_nodes(requeued_run):
    """One rank per node: the 2-rank actor world met across the two nodes of its group (its
    collectives then trained it, so the gloo rendezvous crossed nodes); the critic on its node."""
    run = requeued_run
    for role, nodes in (("actor", {"n1", "n2"}), ("critic", {"n3"})):
        ranks = _ranks(run.run_dir, role, len(nodes))
        assert sorted(ranks) == list(range(len(nodes))), (role, ranks, run.logs)
        assert {host for host, _ in ranks.values()} == nodes, (role, ranks)
        for host, addresses in ranks.values():
            assert addresses == {NODE_IP[host]}, (role, ranks)


def test_engine_spans_the_rollout_nodes_and_weights_sync_across_nodes(requeued_run):
    """The TP=2 engine runs one SGLang process per rollout node: node 0's (n4 or n5, as Ray placed
    it) serves HTTP, the other node's holds tensor-parallel rank 1. Each pipeline stage's actor rank (one on n1, one on n2) forms its
    own broadcast group on its node; both engine ranks join both groups (ranks 1 and 2 of 3), on
    their own nodes, and receive every update over them, the requests posted by actor rank 0."""
    run = requeued_run
    actor_logs = "".join(_last_attempt(p) for p in (run.run_dir / "logs").glob("actor_rank*.log"))
    syncs = SYNC_LINE.findall(actor_logs)
    assert len(syncs) == 2, (syncs, run.logs)  # one group per stage, formed once, reused by every later sync
    ranks = _ranks(run.run_dir, "actor", 2)
    assert sorted((int(rank), int(stage)) for _, rank, stage, _ in syncs) == [(0, 0), (1, 1)], syncs
    # Ray places the engine's two bundles on n4 and n5 in either order: node 0 serves HTTP.
    urls = {engines.strip() for *_, engines in syncs}
    url = re.fullmatch(r"http://([\d.]+):\d+", urls.pop())
    assert not urls and url and url.group(1) in (NODE_IP["n4"], NODE_IP["n5"]), syncs  # one engine, on n4 or n5
    http_ip = url.group(1)
    other_ip = NODE_IP["n5"] if http_ip == NODE_IP["n4"] else NODE_IP["n4"]
    # The restarted attempt's processes (an engine process writes its log afresh).
    logs = run.run_dir / "logs"
    node0, node1 = ((logs / name).read_text(errors="replace") for name in ("engine0.log", "engine0.node1.log"))
    assert f"Uvicorn running on http://{http_ip}:" in node0, node0[-2000:]
    assert "Uvicorn running" not in node1, node1[-2000:]  # node 1 serves no HTTP
    assert f"'host': '{other_ip}'" in node1 and "'node_rank': 1" in node1, node1[-2000:]  # SGLang's server_args
    for master, rank, _, _ in syncs:
        assert master == NODE_IP[ranks[int(rank)][0]], (syncs, ranks)  # the group meets on its sender's node
        for log, engine_rank in ((node0, 1), (node1, 2)):  # each engine rank joins from its own node
            joined = (
                rf"init custom process group: master_address={re.escape(master)}, .*rank={engine_rank}, world_size=3,"
            )
            assert re.search(joined, log), log[-2000:]
    assert {m for m, *_ in syncs} == {NODE_IP["n1"], NODE_IP["n2"]}, syncs  # two nodes sent
    engine_log = node0
    coordinator = NODE_IP[ranks[0][0]]
    updates = re.findall(
        rf'{re.escape(coordinator)}:\d+ - "POST /update_weights_from_distributed HTTP/1.1" 200', engine_log
    )
    versions = re.findall(r"Weight version changed\. old_version='[^']*' new_version='(\d+)'", engine_log)
    # The restarted attempt: its first sync, then one per actor step (the actor trains from step 2,
    # after the critic warm-up step, so at least step 3 is left), each one bucket per stage.
    assert len(updates) >= 4 and max(map(int, versions)) >= 1, (updates, versions)
