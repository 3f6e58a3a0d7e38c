"""``ActorWorker.sync_weights`` end to end on a 2-rank gloo trainer world with two pipeline stages
(one sender each, ragged: 3 and 2 buckets) and two fake engines (``tests/workers/fake_engine.py``).

Covered: the control plane rank 0 runs (pause in retract mode, begin, every bucket's request in
``sync_order`` over each stage's own group without a cache flush, end, one flush, continue), the data plane (every tensor reaches every engine
with its values; a sender broadcasts only the buckets released to it), the groups' reuse and
re-formation, and the error paths (an engine failing a bucket, an engine refusing the session, an
engine refusing a bucket without receiving it, which leaves its sender's broadcast pending as NCCL
does for a dead engine, an engine that receives a bucket and never answers, one that hangs on it,
whose sender aborts its group and tells rank 0 through the gate): rank 0 raises with the engine's message, the other rank returns ``{}``,
the engines end the session and resume, nothing waits for the 300 s group timeout, and the next
call succeeds. The store gate alone: ``tests/test_weight_sync.py``.

Why fake engines: they log every call in order and inject failures at a chosen bucket, which a
real SGLang engine cannot; they still form real gloo groups and receive real broadcasts. The
real-engine path is covered by ``tests/test_from_hf.py`` and
``tests/rollout/test_engine_integration.py``, which take minutes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sao_megatron.models.hf_io import TensorSpec
from sao_megatron.weight_sync import sync_order
from tests.distributed import BACKEND_ENV, run_distributed, world_backend
from tests.workers.fake_engine import EngineProcess, Faults, weight_name, weight_value

SHAPES = [  # per pipeline stage, per bucket: its tensors' shapes (ragged stages: 3 and 2 buckets)
    [[(3, 5), (7,)], [(2, 3, 4)], [(1,), (5, 2), (11,)]],
    [[(4, 3)], [(9,), (2, 2)]],
]
ORDER = sync_order([len(stage) for stage in SHAPES])
TENSORS = sum(len(bucket) for stage in SHAPES for bucket in stage)
BUCKET_MB = 1
SYNC_TIMEOUT_S = 10.0
"""``rollout.weight_sync_timeout_s`` of the trainer ranks: a sender's wait for one bucket."""
SENDERS_PER_STAGE = 3
"""rollout.weight_sync_senders = 6 over two stages: three a stage at most (one rank a stage here)."""
WORLD_TIMEOUT_S = 60.0  # a world takes ~8 s (~25 s on a busy host); a hang fails before 300 s
PAUSE, BEGIN, END, FLUSH, RESUME = (
    ("/pause_generation",),
    ("/begin_weight_update",),
    ("/end_weight_update",),
    ("/flush_cache",),
    ("/continue_generation",),
)


def _names(stage: int, bucket: int) -> list[str]:
    return [weight_name(stage, bucket, i) for i in range(len(SHAPES[stage][bucket]))]


class FakeStream:
    """``HFWeightStream(senders=...)`` of two pipeline stages of one rank each (rank r is stage r and
    its sender, lane r), without Megatron: the plan is :data:`SHAPES`, the values ``weight_value``."""

    def __init__(
        self,
        module: Any,
        model_cfg: Any,
        group: Any = None,
        senders: int = 0,
        feed_groups: Any = None,
        feed_timeout_s: float = 0.0,
    ):
        assert group is not None and feed_groups is not None, "sync_weights gathers on groups of its own"
        assert senders == SENDERS_PER_STAGE, "rollout.weight_sync_senders over the pipeline stages"
        self.senders = self.lane_stages = [0, 1]
        self.device = torch.device("cpu")  # where the gathered tensors are (the gather streams')
        self.stage = self.lane = dist.get_rank()

    def lane_label(self, lane: int) -> str:
        return f"pp{lane}"

    def steps(self, bucket_bytes: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(writer=self.stage) for _ in SHAPES[self.stage]]

    def bucket_plan(self, bucket_bytes: int) -> list[list[list[TensorSpec]]]:
        assert bucket_bytes == BUCKET_MB << 20
        return [
            [
                [TensorSpec(n, shape, torch.float32) for n, shape in zip(_names(s, k), bucket, strict=True)]
                for k, bucket in enumerate(stage)
            ]
            for s, stage in enumerate(SHAPES)
        ]

    broken: tuple[int, int] | None = None
    """``(stage, bucket)`` whose gather fails (as an out-of-memory would), on every call while set."""

    def buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for k, bucket in enumerate(SHAPES[self.stage]):
            if (self.stage, k) == FakeStream.broken:
                raise RuntimeError(f"gather of stage {self.stage} bucket {k}: CUDA out of memory")
            yield [(n, weight_value(n, shape)) for n, shape in zip(_names(self.stage, k), bucket, strict=True)]


def _worker() -> Any:
    """An ``ActorWorker`` without Megatron: its own ``__init__``, with the rank set-up and the
    model build stubbed out (so every attribute it sets is set, as in a real run)."""
    import sao_megatron.workers.actor as actor

    actor.init_rank = lambda parallel, seed: None  # type: ignore[assignment]  # the world is up already
    actor.build_actor_role = lambda model, cfg, **kw: SimpleNamespace(module=None)  # type: ignore[assignment]
    cfg = SimpleNamespace(
        model=None,
        seed=0,
        actor=SimpleNamespace(parallel=SimpleNamespace(pipeline_parallel=2)),
        engine_tp=1,
        sync_flat=False,
        sync_bucket_mb=BUCKET_MB,
        sync_timeout_s=SYNC_TIMEOUT_S,
        sync_senders=2 * SENDERS_PER_STAGE,
        export_inflight_mb=1024,
        export_timeout_s=300.0,  # the gather group's (no model here to size it from)
        export_gb_per_s=0.5,
        update_policy="retract",
        routing_replay="off",
    )
    return actor.ActorWorker(cfg)  # type: ignore[arg-type]


def _trainer(
    rank: int, world_size: int, urls: list[str], versions: list[int], broken: tuple[int, int] | None = None
) -> list[dict[str, Any]]:
    """One trainer rank: ``sync_weights`` once per version (``broken``: the first call's failing
    gather, :attr:`FakeStream.broken`). Per call: its result (or rank 0's error), its seconds, and
    the ``[group, first tensor]`` of each bucket this rank broadcast. At the end each sender
    destroys its group, as a finished run leaves the engines."""
    import sao_megatron.models.hf_weights as hf_weights
    from sao_megatron.weight_sync import SyncAborted, WeightSync

    hf_weights.HFWeightStream = FakeStream  # type: ignore[misc]  # BroadcastSync.sync imports it at call time
    sent: list[list[str]] = []
    send = WeightSync.send

    def recording_send(self: WeightSync, bucket: list[tuple[str, torch.Tensor]]) -> int:
        sent.append([self.group_name, bucket[0][0]])
        return send(self, bucket)

    WeightSync.send = recording_send  # type: ignore[method-assign]
    w = _worker()
    outcomes = []
    for call, version in enumerate(versions):
        FakeStream.broken = broken if call == 0 else None
        before, t0 = len(sent), time.perf_counter()
        result: dict[str, float] | None = None
        error, aborted = None, False
        try:
            result = w.sync_weights(urls, version, "127.0.0.1")
        except RuntimeError as err:
            error, aborted = str(err), isinstance(err, SyncAborted)
        seconds = time.perf_counter() - t0
        outcomes.append(
            {"result": result, "error": error, "aborted": aborted, "seconds": seconds, "sent": sent[before:]}
        )
    w.broadcast.close()
    return outcomes


@pytest.fixture(scope="module", params=["gloo", "strict_nccl"], autouse=True)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test twice: the trainer world and every group on gloo, then on the strict NCCL-contract
    backend (``runtime/strict_nccl``: the world bound to each rank's device as ``parallel.py`` binds
    an NCCL world, ops that only enqueue, a watchdog). Under it a sender group made by splitting the
    bound world (its engine members outside it) fails naming the call site, as NCCL hangs there."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BACKEND_ENV, request.param)
        patch.setenv("SAO_STRICT_SPLIT_WAIT_S", "5")
        yield request.param


@pytest.fixture(scope="module")
def engines(backend: str) -> Iterator[list[EngineProcess]]:
    """Two fake engines for the module (each test resets them with its own faults)."""
    procs: list[EngineProcess] = []
    try:
        procs = [EngineProcess(), EngineProcess()]
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def _run(
    engines: list[EngineProcess],
    faults: list[Faults],
    versions: list[int],
    broken: tuple[int, int] | None = None,
    timeout_s: float = WORLD_TIMEOUT_S,
) -> tuple[list, list]:
    """The trainer world's per-rank outcomes and each engine's call log."""
    for engine, f in zip(engines, faults, strict=True):
        engine.reset(f)
    ranks = run_distributed(_trainer, 2, [e.url for e in engines], versions, broken, timeout_s=timeout_s)
    return ranks, [e.log() for e in engines]


def _brief(entry: dict[str, Any]) -> tuple:
    """A log entry as the test compares it: endpoint, group, and for an update its names and version."""
    if entry["endpoint"] == "/update_weights_from_distributed":
        return entry["endpoint"], entry["group_name"], tuple(entry["names"]), entry["version"]
    if "group_name" in entry:
        return entry["endpoint"], entry["group_name"]
    return (entry["endpoint"],)


def _update(prefix: str, stage: int, bucket: int, version: int) -> tuple:
    return (
        "/update_weights_from_distributed",
        f"{prefix}_pp{stage}",
        tuple(_names(stage, bucket)),
        str(version),
    )


def _session(prefix: str, version: int, order: list[tuple[int, int]] = ORDER) -> list[tuple]:
    return [PAUSE, BEGIN, *(_update(prefix, s, k, version) for s, k in order), END, FLUSH, RESUME]


def _groups(endpoint: str, prefix: str) -> list[tuple]:
    return [(endpoint, f"{prefix}_pp0"), (endpoint, f"{prefix}_pp1")]


def _sent(prefix: str, stage: int, order: list[tuple[int, int]] = ORDER) -> list[list[str]]:
    return [[f"{prefix}_pp{stage}", weight_name(stage, k, 0)] for s, k in order if s == stage]


def _assert_clean_updates(log: list[dict[str, Any]]) -> None:
    """Every received tensor had its values, and no update overlapped another on the engine."""
    for e in log:
        if e["endpoint"] == "/update_weights_from_distributed":
            assert e["bad"] == [] and not e["overlapped"], e
            assert e["flush_cache"] is False and e["load_format"] is None, e  # one flush, after the last
        if e["endpoint"] == "/pause_generation":
            assert e["mode"] == "retract", e  # rollout.update_policy's default


def _assert_synced(outcome: list[dict[str, Any]], prefix: str) -> None:
    """Both ranks of one call: rank 0's metrics, rank 1's ``{}``, each sender's every bucket."""
    zero, one = outcome
    assert zero["error"] is None and one["error"] is None
    assert zero["result"]["sync_senders"] == 2.0
    assert zero["result"]["sync_tensors"] == float(TENSORS)
    assert zero["result"]["sync_gb_per_s"] > 0
    assert one["result"] == {}
    assert zero["sent"] == _sent(prefix, 0) and one["sent"] == _sent(prefix, 1)


def test_sync_sends_every_bucket_in_order_and_reuses_the_groups(engines: list[EngineProcess]) -> None:
    """Two calls with healthy engines: each engine joins both stages' groups once, gets every
    bucket in ``sync_order`` over its stage's group inside one session per call, with the right
    values; rank 0 reports the metrics, rank 1 ``{}``."""
    ranks, logs = _run(engines, [Faults(), Faults()], [1, 2])
    for call in range(2):
        _assert_synced([ranks[0][call], ranks[1][call]], "sao_weight_sync")
    for e, log in enumerate(logs):
        head = _groups("/init_weights_update_group", "sao_weight_sync")
        assert [_brief(x) for x in log[:-2]] == [
            *head,
            *_session("sao_weight_sync", 1),
            *_session("sao_weight_sync", 2),
        ]
        assert sorted(_brief(x) for x in log[-2:]) == _groups("/destroy_weights_update_group", "sao_weight_sync")
        assert all(x["success"] for x in log), log
        assert [(x["rank"], x["world_size"], x["backend"]) for x in log[:2]] == [(e + 1, 3, world_backend())] * 2
        assert log[2]["mode"] == "retract"
        _assert_clean_updates(log)


def test_a_failed_bucket_ends_the_session_fast_and_the_next_sync_reforms(
    engines: list[EngineProcess],
) -> None:
    """Engine 1 receives stage 1's first bucket, then answers it with success false. Rank 0 raises
    with its message well before any group timeout, rank 1 returns ``{}``; both engines end the
    session and resume right after that update, with nothing posted after it; no sender broadcast
    past the buckets released to it. The next call re-forms the groups under new names (the old
    ones destroyed) and succeeds, so the failed session was ended."""
    failing = ("sao_weight_sync_pp1", weight_name(1, 0, 0))
    ranks, logs = _run(engines, [Faults(), Faults(fail_update=failing, message="cannot load")], [1, 2])
    zero, one = ranks[0][0], ranks[1][0]
    assert zero["result"] is None and zero["error"] is not None
    assert "weight sync to version 1 failed" in zero["error"] and "cannot load" in zero["error"]
    assert f"{engines[1].url}/update_weights_from_distributed: " in zero["error"]  # names the engine
    assert one["result"] == {} and one["error"] is None
    assert zero["seconds"] < 30 and one["seconds"] < 30
    released = ORDER[: ORDER.index((1, 0)) + 1]  # the buckets released up to the failed one
    assert zero["sent"] == _sent("sao_weight_sync", 0, released)
    assert one["sent"] == _sent("sao_weight_sync", 1, released)
    _assert_synced([ranks[0][1], ranks[1][1]], "sao_weight_sync_2")

    for e, log in enumerate(logs):
        brief = [_brief(x) for x in log]
        first = [*_groups("/init_weights_update_group", "sao_weight_sync"), *_session("sao_weight_sync", 1, released)]
        assert brief[: len(first)] == first  # end and continue right after the failed update
        failed = log[len(first) - 4]  # then end, flush, continue
        assert _brief(failed) == _update("sao_weight_sync", 1, 0, 1)
        assert failed["success"] is (e == 0) and failed["bad"] == []
        assert all(x["success"] for x in log[len(first) - 3 : len(first)]), log  # the session was open
        # The old groups destroyed (by each sender, before it forms its new one), the new ones formed:
        reform = brief[len(first) : len(first) + 4]
        old = _groups("/destroy_weights_update_group", "sao_weight_sync")
        new = _groups("/init_weights_update_group", "sao_weight_sync_2")
        assert sorted(reform) == sorted(old + new)
        assert reform.index(old[0]) < reform.index(new[0]) < reform.index(new[1])
        assert reform.index(old[1]) < reform.index(new[1])
        rest = brief[len(first) + 4 :]
        assert rest[:-2] == _session("sao_weight_sync_2", 2)
        assert sorted(rest[-2:]) == _groups("/destroy_weights_update_group", "sao_weight_sync_2")
        assert all(x["success"] for x in log if x is not failed), log
        _assert_clean_updates(log)


@pytest.fixture(scope="module")
def refused_begin(engines: list[EngineProcess]) -> tuple[list, list]:
    """Engine 1 refuses the first ``/begin_weight_update``; two calls (the second: no faults)."""
    return _run(engines, [Faults(), Faults(refuse_begin_on_call=1)], [1, 2])


def _first_call(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log up to the second call's pause."""
    return log[: [x["endpoint"] for x in log].index(PAUSE[0], 3)]


def test_a_refused_begin_posts_no_update_and_resumes_every_engine(refused_begin: tuple[list, list]) -> None:
    """Engine 1 refuses the session: rank 0 raises with the refusal, rank 1 returns ``{}``, no
    bucket is posted or broadcast, and both engines resume."""
    ranks, logs = refused_begin
    zero, one = ranks[0][0], ranks[1][0]
    assert zero["error"] is not None and zero["result"] is None
    assert "/begin_weight_update" in zero["error"] and "refused by fault injection" in zero["error"]
    assert one["result"] == {} and one["error"] is None
    assert zero["seconds"] < 30 and one["seconds"] < 30
    assert zero["sent"] == [] and one["sent"] == []
    for e, log in enumerate(logs):
        first = _first_call(log)
        brief = [_brief(x) for x in first]
        assert brief[:4] == [*_groups("/init_weights_update_group", "sao_weight_sync"), PAUSE, BEGIN]
        assert first[3]["success"] is (e == 0)
        assert RESUME in brief, brief
        resumed = brief.index(RESUME)
        assert set(brief[4:resumed]) <= {END} and first[resumed]["success"]  # at most the session's end
        assert not [x for x in brief if x[0] == "/update_weights_from_distributed"]


def test_a_refused_begin_ends_the_sessions_that_opened_so_the_next_sync_succeeds(
    refused_begin: tuple[list, list],
) -> None:
    """Engine 0 accepted the session engine 1 refused: it is told to end it (before it resumes),
    so that it accepts the next call's ``/begin_weight_update`` (SGLang refuses one while a
    session is open) and the next call, with no fault, succeeds."""
    ranks, logs = refused_begin
    brief = [_brief(x) for x in _first_call(logs[0])]
    assert brief[3:6] == [BEGIN, END, RESUME], f"engine 0's session was not ended: {brief}"
    assert ranks[0][1]["error"] is None, ranks[0][1]["error"]
    _assert_synced([ranks[0][1], ranks[1][1]], "sao_weight_sync_2")
    second = _session("sao_weight_sync_2", 2)
    for log in logs:
        assert [_brief(x) for x in log[-2 - len(second) : -2]] == second  # then the groups' destroys
        assert all(x["success"] for x in log[-2 - len(second) :]), log


def test_a_sender_whose_gather_fails_stops_the_sync_before_its_bucket_is_posted(
    engines: list[EngineProcess],
) -> None:
    """Stage 1's sender fails to gather its bucket 1 (out of memory): it tells rank 0 at once, so
    rank 0 never posts that bucket (the engines would wait in a broadcast nobody sends), stops
    stage 0 at its next bucket, and ends and resumes the engines. Every rank is back within
    seconds; rank 0 raises naming the sender and its error; the next call succeeds."""
    ranks, logs = _run(engines, [Faults(), Faults()], [1, 2], broken=(1, 1))
    zero, one = ranks[0][0], ranks[1][0]
    assert zero["result"] is None and zero["error"] is not None
    assert "trainer rank 1 (stage 1)" in zero["error"] and "CUDA out of memory" in zero["error"]
    assert one["result"] == {} and one["error"] is None
    assert zero["seconds"] < 30 and one["seconds"] < 30
    posted = ORDER[: ORDER.index((1, 1))]  # everything before the bucket that was never gathered
    assert zero["sent"] == _sent("sao_weight_sync", 0, posted)
    assert one["sent"] == _sent("sao_weight_sync", 1, posted)
    _assert_synced([ranks[0][1], ranks[1][1]], "sao_weight_sync_2")
    for log in logs:
        brief = [_brief(x) for x in log]
        first = [
            *_groups("/init_weights_update_group", "sao_weight_sync"),
            *_session("sao_weight_sync", 1, posted),
        ]
        assert brief[: len(first)] == first
        assert all(x["success"] for x in log), log
        _assert_clean_updates(log)


def test_a_bucket_an_engine_never_receives_aborts_its_group_at_the_timeout_and_the_next_sync_reforms(
    engines: list[EngineProcess],
) -> None:
    """Engine 1 refuses stage 1's first bucket without joining its broadcast: the sender's broadcast
    stays pending, as every broadcast to a dead engine does under NCCL (which only enqueues). The
    sender's wait ends at ``rollout.weight_sync_timeout_s`` (not the group's 300 s), it aborts its
    group, and rank 0 raises :class:`SyncAborted` naming the key; the engines ended the session and
    resumed. The next call forms new groups and syncs every bucket."""
    refused = ("sao_weight_sync_pp1", weight_name(1, 0, 0))
    ranks, logs = _run(engines, [Faults(), Faults(refuse_update=refused, message="refused")], [1, 2])
    zero, one = ranks[0][0], ranks[1][0]
    assert zero["result"] is None and zero["aborted"], zero
    assert f"rollout.weight_sync_timeout_s={SYNC_TIMEOUT_S:g}" in zero["error"], zero["error"]
    assert f"{engines[1].url}/update_weights_from_distributed: " in zero["error"] and "refused" in zero["error"]
    assert f"trainer rank 1: SyncAborted: {world_backend()} group sao_weight_sync_pp1: " in zero["error"]
    assert "the group was aborted" in zero["error"]
    assert one["result"] == {} and one["error"] is None
    assert SYNC_TIMEOUT_S <= one["seconds"] < SYNC_TIMEOUT_S + 20, one["seconds"]
    released = ORDER[: ORDER.index((1, 0)) + 1]
    assert one["sent"] == _sent("sao_weight_sync", 1, released)
    _assert_synced([ranks[0][1], ranks[1][1]], "sao_weight_sync_2")
    for e, log in enumerate(logs):
        brief = [_brief(x) for x in log]
        first = [*_groups("/init_weights_update_group", "sao_weight_sync"), *_session("sao_weight_sync", 1, released)]
        assert brief[: len(first)] == first  # end, flush and continue right after the refused bucket
        assert all(x["success"] for x in log[len(first) - 3 : len(first)]), log
        if e == 1:
            assert log[len(first) - 4]["success"] is False  # refused, never received
        assert brief[-2 - len(_session("sao_weight_sync_2", 2)) : -2] == _session("sao_weight_sync_2", 2)
        assert all(x["success"] for x in log[-2 - len(_session("sao_weight_sync_2", 2)) :]), log


def _first_session(released: list[tuple[int, int]]) -> list[tuple]:
    """The first call's log up to its resume: the groups formed, then the session up to the released buckets."""
    return [*_groups("/init_weights_update_group", "sao_weight_sync"), *_session("sao_weight_sync", 1, released)]


def test_an_engine_that_never_answers_a_bucket_fails_the_sync_at_the_bucket_timeout(
    engines: list[EngineProcess],
) -> None:
    """Engine 1 receives stage 1's first bucket and never answers it. Its sender's broadcast completed,
    so nothing but rank 0's bound on the engines' answers (``rollout.weight_sync_timeout_s`` plus
    ``ANSWER_MARGIN_S``, not the HTTP client's 600 s) ends the wait: rank 0 raises naming the key,
    the bucket and the silent engine, as :class:`SyncAborted` (the group is in an unknown state: the
    driver restarts every engine of it, so an engine that hangs while it answers ``/health`` cannot
    stop the run), posts nothing
    after that bucket, and the engines end the session and resume. The next call succeeds."""
    from sao_megatron.weight_sync.broadcast import ANSWER_MARGIN_S

    silent = ("sao_weight_sync_pp1", weight_name(1, 0, 0))
    ranks, logs = _run(engines, [Faults(), Faults(silent_update=silent)], [1, 2], timeout_s=2 * WORLD_TIMEOUT_S)
    zero, one = ranks[0][0], ranks[1][0]
    assert zero["result"] is None and zero["aborted"], zero
    bound = f"did not answer within {SYNC_TIMEOUT_S + ANSWER_MARGIN_S:g} s"
    assert f"trainer rank 0: TimeoutError: bucket {weight_name(1, 0, 0)}... (1 tensors) over group" in zero["error"]
    assert (
        f"engine(s) {engines[1].url} {bound} (rollout.weight_sync_timeout_s={SYNC_TIMEOUT_S:g} plus" in (zero["error"])
    ), zero["error"]
    assert "trainer rank 1" not in zero["error"]  # its sender sent every released bucket
    assert zero["seconds"] >= SYNC_TIMEOUT_S + ANSWER_MARGIN_S  # the bound, not an earlier give-up
    assert one["result"] == {} and one["error"] is None
    released = ORDER[: ORDER.index((1, 0)) + 1]
    assert zero["sent"] == _sent("sao_weight_sync", 0, released)
    assert one["sent"] == _sent("sao_weight_sync", 1, released)
    _assert_synced([ranks[0][1], ranks[1][1]], "sao_weight_sync_2")
    for e, log in enumerate(logs):
        brief = [_brief(x) for x in log]
        first = _first_session(released)
        assert brief[: len(first)] == first  # end, flush and continue after the silent bucket
        assert all(x["success"] for x in log[len(first) - 3 : len(first)]), log
        hung = log[len(first) - 4]
        assert hung.get("unanswered", False) is (e == 1) and hung["bad"] == [], hung  # received, unanswered
        second = _session("sao_weight_sync_2", 2)
        assert brief[-2 - len(second) : -2] == second
        assert all(x["success"] for x in log[-2 - len(second) :]), log


def test_a_sender_that_aborts_its_group_stops_the_coordinator_at_once(engines: list[EngineProcess]) -> None:
    """Engine 1 hangs on stage 1's first bucket: it neither joins its broadcast nor answers. The
    sender's wait ends at ``rollout.weight_sync_timeout_s``, it aborts its group and says so through
    the gate; rank 0, waiting for the engines' answers to that bucket, stops on that word (its own
    error is the gate's word, not its answer timeout, which comes ``ANSWER_MARGIN_S`` later) and
    raises :class:`SyncAborted`. The engines end the session and resume; the next call succeeds."""
    hung = ("sao_weight_sync_pp1", weight_name(1, 0, 0))
    ranks, logs = _run(engines, [Faults(), Faults(hang_update=hung)], [1, 2], timeout_s=2 * WORLD_TIMEOUT_S)
    zero, one = ranks[0][0], ranks[1][0]
    assert zero["result"] is None and zero["aborted"], zero
    gave_up = "the engines' answers were given up: sender 1, bucket 0: trainer rank 1 (stage 1): SyncAborted"
    assert f"trainer rank 0: RuntimeError: bucket {weight_name(1, 0, 0)}... (1 tensors) over group" in zero["error"]
    assert gave_up in zero["error"], zero["error"]
    assert "did not answer within" not in zero["error"], zero["error"]
    assert f"trainer rank 1: SyncAborted: {world_backend()} group sao_weight_sync_pp1: " in zero["error"]
    assert one["result"] == {} and one["error"] is None
    released = ORDER[: ORDER.index((1, 0)) + 1]
    assert one["sent"] == _sent("sao_weight_sync", 1, released)
    _assert_synced([ranks[0][1], ranks[1][1]], "sao_weight_sync_2")
    for e, log in enumerate(logs):
        brief = [_brief(x) for x in log]
        first = _first_session(released)
        assert brief[: len(first)] == first
        assert all(x["success"] for x in log[len(first) - 3 : len(first)]), log
        assert log[len(first) - 4].get("unanswered", False) is (e == 1)
        second = _session("sao_weight_sync_2", 2)
        assert brief[-2 - len(second) : -2] == second
        assert all(x["success"] for x in log[-2 - len(second) :]), log
