"""The autoscaler's policy fold, without a broker: clamp, up fast, hold, down after the cooldown,
the remembered starving size, the preprocessors' busy ratio, and a bounded number of decisions
over a whole job; the fold of the busy reports; and the settings' checks."""

from __future__ import annotations

import pytest

from conveyor.platform.messages import JobSignals, PreprocessorLoad
from conveyor.services.autoscaler.config import AutoscalerSettings
from conveyor.services.autoscaler.measure import PoolLoad
from conveyor.services.autoscaler.policy import PolicyConfig, ScalingPolicy, Signals
from conveyor.services.autoscaler.trainers import TrainerPolicy, TrainerPoolConfig

CONFIG = PolicyConfig(min_replicas=1, max_replicas=6, up_interval_s=10, cooldown_s=60)


def job(wait: float | None, *, lag: int = 0, trainers: int = 1) -> JobSignals:
    return JobSignals(job_id="j", trainers=trainers, data_wait_ratio=wait, batches_lag=lag)


def signals(at: float, replicas: int, *, jobs: list[JobSignals], shards_lag: int = 0,
            partitions: int = 8, busy: float | None = None) -> Signals:  # fmt: skip
    return Signals(at=at, replicas=replicas, partitions=partitions, shards_lag=shards_lag,
                   jobs=jobs, busy_ratio=busy)  # fmt: skip


def test_starving_trainers_with_waiting_work_scale_up_by_the_missing_share() -> None:
    policy = ScalingPolicy(CONFIG)
    verdict = policy.decide(signals(0, 1, jobs=[job(0.6)], shards_lag=8))
    # 40% of the demand is met by 1 replica: 1 / 0.4 -> 3.
    assert (verdict.action, verdict.target) == ("up", 3)
    assert "60.0%" in verdict.reason and "8 shard tasks" in verdict.reason
    # The next step up waits until the new replicas show in the trainers' data wait.
    assert policy.decide(signals(5, 3, jobs=[job(0.3)], shards_lag=8)).action == "hold"
    verdict = policy.decide(signals(10, 3, jobs=[job(0.3)], shards_lag=8))
    assert (verdict.action, verdict.target) == ("up", 5)


def test_up_is_bounded_by_partitions_max_factor_and_waiting_tasks() -> None:
    policy = ScalingPolicy(CONFIG)
    # 99% wait would ask for 100x; max_up_factor 4 and 2 waiting tasks bound it to 1 + 2.
    assert policy.decide(signals(0, 1, jobs=[job(0.99)], shards_lag=2)).target == 3
    policy = ScalingPolicy(CONFIG)
    assert policy.decide(signals(0, 2, jobs=[job(0.99)], shards_lag=50, partitions=4)).target == 4
    held = policy.decide(signals(20, 4, jobs=[job(0.99)], shards_lag=50, partitions=4))
    assert (held.action, held.target) == ("hold", 4) and "ceiling" in held.reason


def test_no_up_without_waiting_work_or_below_the_target() -> None:
    policy = ScalingPolicy(CONFIG)
    # Trainers wait, but no shard task waits: more preprocessors would have nothing to take.
    assert policy.decide(signals(0, 2, jobs=[job(0.5)], shards_lag=0)).action == "hold"
    assert policy.decide(signals(1, 2, jobs=[job(0.04)], shards_lag=9)).action == "hold"
    assert policy.decide(signals(2, 2, jobs=[job(None)], shards_lag=9)).action == "hold"


def test_clamps_into_min_max_and_the_partition_count() -> None:
    policy = ScalingPolicy(CONFIG)
    verdict = policy.decide(signals(0, 0, jobs=[]))
    assert (verdict.action, verdict.target) == ("clamp", 1)
    verdict = policy.decide(signals(1, 5, jobs=[], partitions=3))
    assert (verdict.action, verdict.target) == ("clamp", 3)
    assert "3 partitions" in verdict.reason


def test_work_gone_returns_to_the_floor_after_the_cooldown() -> None:
    policy = ScalingPolicy(CONFIG)
    assert policy.decide(signals(0, 1, jobs=[job(0.8)], shards_lag=8)).target == 4
    assert policy.decide(signals(30, 4, jobs=[])).action == "hold"  # surplus starts at 30
    assert policy.decide(signals(89, 4, jobs=[])).action == "hold"
    verdict = policy.decide(signals(90, 4, jobs=[]))
    assert (verdict.action, verdict.target) == ("down", 1)
    assert "work is gone" in verdict.reason
    assert policy.decide(signals(500, 1, jobs=[])).action == "hold"  # at the floor


def test_pile_up_steps_down_one_at_a_time_and_never_to_a_starving_size() -> None:
    policy = ScalingPolicy(CONFIG)
    assert policy.decide(signals(0, 2, jobs=[job(0.5)], shards_lag=8)).target == 4
    piled = [job(0.0, lag=40, trainers=2)]  # 40 > 16 * 2 batches ready
    assert policy.decide(signals(10, 4, jobs=piled)).action == "hold"
    verdict = policy.decide(signals(70, 4, jobs=piled))
    assert (verdict.action, verdict.target) == ("down", 3)
    # Another full cooldown before the next step; then 3 -> 2 would be where trainers starved.
    assert policy.decide(signals(100, 3, jobs=piled)).action == "hold"
    held = policy.decide(signals(131, 3, jobs=piled))
    assert held.action == "hold" and "starved at 2" in held.reason
    # A wait between the thresholds breaks the surplus: the cooldown starts again.
    assert policy.decide(signals(132, 3, jobs=[job(0.03, lag=40, trainers=2)])).action == "hold"


def test_backlog_within_the_prefetch_window_is_no_surplus() -> None:
    policy = ScalingPolicy(CONFIG)
    jobs = [job(0.0, lag=20, trainers=2)]  # 20 <= 32
    for at in range(0, 300, 10):
        assert policy.decide(signals(at, 3, jobs=jobs)).action == "hold"


def test_a_job_from_starving_start_to_end_makes_a_bounded_number_of_decisions() -> None:
    """A fluid model of the pipeline: each replica makes 10 batches/s, the trainers use 35; the
    data wait is the unmet share of the demand, measured over the last 10 s."""
    policy = ScalingPolicy(CONFIG)
    replicas, history, changes = 1, [], []
    for at in range(0, 600):
        running = at < 400
        supply = 10.0 * replicas
        history.append(max(0.0, 1.0 - supply / 35.0))
        wait = sum(history[-10:]) / len(history[-10:])
        backlog = 100 if supply > 35 else 0
        jobs = [job(wait, lag=backlog, trainers=2)] if running else []
        verdict = policy.decide(signals(at, replicas, jobs=jobs, shards_lag=20 if running else 0))
        if verdict.target != replicas:
            changes.append((at, verdict.action, verdict.target))
            replicas = verdict.target
    # Fed by one step up; one step down finds that 3 replicas starve, and the pool goes back
    # to 4 for good (3 is remembered); the floor after the job and a whole cooldown.
    assert changes == [(0, "up", 4), (70, "down", 3), (74, "up", 4), (460, "down", 1)]


def test_busy_preprocessors_scale_up_by_their_load_and_idle_ones_hold() -> None:
    policy = ScalingPolicy(CONFIG)
    # Trainers starve and tasks wait, but 2 preprocessors busy 40%: more would idle too.
    held = policy.decide(signals(0, 2, jobs=[job(0.6)], shards_lag=8, busy=0.4))
    assert (held.action, held.target) == ("hold", 2)
    assert "busy only 40%" in held.reason
    # Busy 90% delivering 40% of the demand: 2 * 0.9 / 0.4 = 4.5 -> 5 (not 2 / 0.4 = 5 rounded
    # from an assumed 100%: 6 would be one more than the load asks).
    verdict = policy.decide(signals(1, 2, jobs=[job(0.6)], shards_lag=8, busy=0.9))
    assert (verdict.action, verdict.target) == ("up", 5)
    assert "preprocessors 90% busy" in verdict.reason
    policy = ScalingPolicy(CONFIG)
    assert policy.decide(signals(0, 2, jobs=[job(0.6)], shards_lag=8, busy=0.8)).target == 4


def test_idle_preprocessors_beside_calm_trainers_step_down_after_the_cooldown() -> None:
    policy = ScalingPolicy(CONFIG)
    calm = [job(0.0, lag=4, trainers=2)]  # no pile-up: only the busy ratio says surplus
    assert policy.decide(signals(0, 4, jobs=calm, busy=0.5)).action == "hold"
    assert policy.decide(signals(10, 4, jobs=calm, busy=0.2)).action == "hold"  # starts at 10
    verdict = policy.decide(signals(70, 4, jobs=calm, busy=0.2))
    assert (verdict.action, verdict.target) == ("down", 3)
    assert "busy only 20%" in verdict.reason
    # Busy again (the remaining 3 are needed): no surplus, no further step.
    for at in range(71, 300, 10):
        assert policy.decide(signals(at, 3, jobs=calm, busy=0.6)).action == "hold"


def test_the_pool_load_counts_fresh_reports_of_preprocessors_that_stay() -> None:
    def load(worker: str, busy: float, at: float, leaving: bool = False) -> PreprocessorLoad:
        return PreprocessorLoad(worker_id=worker, busy_ratio=busy, slots=2, leaving=leaving, at=at)

    pool = PoolLoad()
    assert pool.busy(now=100, max_age_s=15) == (None, 0)
    for report in [load("a", 0.9, 95), load("b", 0.5, 98), load("c", 1.0, 80),
                   load("d", 0.7, 97), load("d", 0.0, 99, leaving=True),
                   load("b", 0.1, 90)]:  # fmt: skip
        pool.apply(report)
    # c is stale, d left, b's older report read late does not replace its newer one.
    busy, counted = pool.busy(now=100, max_age_s=15)
    assert busy == pytest.approx(0.7) and counted == 2
    with pytest.raises(ValueError, match="busy_ratio"):
        load("e", 1.5, 100)


def test_the_trainer_pool_follows_what_the_jobs_ask_within_bounds() -> None:
    policy = TrainerPolicy(TrainerPoolConfig(min_replicas=1, max_replicas=5, cooldown_s=30))
    # A queued job asks for more than the pool: up at once, to the ask (then to the ceiling).
    assert (policy.decide(at=0, replicas=1, asked=3, queued=1).target) == 3
    verdict = policy.decide(at=1, replicas=3, asked=9, queued=2)
    assert (verdict.action, verdict.target) == ("up", 5)
    assert verdict.reason == "jobs ask 9 trainers, 2 queued"
    assert policy.decide(at=2, replicas=5, asked=9, queued=1).action == "hold"
    # Fewer asked: down only after the cooldown, to the ask, never under the floor.
    assert policy.decide(at=10, replicas=5, asked=2, queued=0).action == "hold"
    assert policy.decide(at=39, replicas=5, asked=2, queued=0).action == "hold"
    verdict = policy.decide(at=40, replicas=5, asked=2, queued=0)
    assert (verdict.action, verdict.target) == ("down", 2)
    assert policy.decide(at=41, replicas=2, asked=0, queued=0).action == "hold"
    assert policy.decide(at=71, replicas=2, asked=0, queued=0).target == 1
    # A new ask in the cooldown resets it; a pool outside the bounds is clamped.
    assert policy.decide(at=80, replicas=1, asked=0, queued=0).action == "hold"
    verdict = policy.decide(at=81, replicas=9, asked=0, queued=0)
    assert (verdict.action, verdict.target) == ("clamp", 5)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        PolicyConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="calm_data_wait_ratio"):
        PolicyConfig(min_replicas=1, max_replicas=2, target_data_wait_ratio=0.01,
                     calm_data_wait_ratio=0.02)  # fmt: skip
    with pytest.raises(ValueError, match="idle_busy_ratio"):
        PolicyConfig(min_replicas=1, max_replicas=2, idle_busy_ratio=0.8)
    with pytest.raises(ValueError, match="trainer min_replicas"):
        TrainerPoolConfig(min_replicas=2, max_replicas=1)


def test_settings_refuse_what_their_driver_would_ignore() -> None:
    settings = AutoscalerSettings(driver="kubernetes", kubernetes_deployment="prep")
    assert settings.policy().min_replicas == 1
    with pytest.raises(ValueError, match="docker_project apply to the docker driver only"):
        AutoscalerSettings(driver="kubernetes", docker_project="conveyor")
    with pytest.raises(ValueError, match="driver local needs stack_dir"):
        AutoscalerSettings(driver="local")
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalerSettings(driver="kubernetes", min_replicas=4, max_replicas=2)
    # The trainer pool's settings do nothing unless it is scaled: refused then.
    assert AutoscalerSettings(driver="kubernetes").trainer_pool() is None
    with pytest.raises(ValueError, match="trainer_min_replicas need trainer_max_replicas > 0"):
        AutoscalerSettings(driver="kubernetes", trainer_min_replicas=2)
    pool = AutoscalerSettings(driver="kubernetes", trainer_max_replicas=4).trainer_pool()
    assert pool is not None and (pool.min_replicas, pool.max_replicas) == (1, 4)
