"""--cpu-bind: the plan's rule, the default thread count, the config's check, and that binding an
engine process puts its loop on the compute cores and its other Python threads on the serving ones."""

from __future__ import annotations

import os
import threading

import pytest

from hawk.config import ConfigError, ServeConfig
from hawk.serve import cpu_binding
from hawk.serve.cpu_binding import BindMode, CorePlan, CpuBindError, mode_of, parse_cores, plan_cores
from hawk.serve.launcher import ChildSpec, default_prompt_threads, default_threads, omp_places, plan_cluster_cores


def test_auto_leaves_the_last_core_to_serving_on_a_cpu_engine():
    plan = plan_cores("auto", 1, (0, 1), on_cpu=True)
    assert plan is not None and plan.engines == ((0,),) and plan.serving == (1,)
    assert "engine compute on cores 0, serving threads on 1" in plan.describe()


def test_auto_splits_the_rest_evenly_between_engines():
    plan = plan_cores("auto", 2, range(8), on_cpu=True)
    assert plan is not None and plan.engines == ((0, 1, 2), (3, 4, 5)) and plan.serving == (7,)


@pytest.mark.parametrize("kw", [dict(on_cpu=False), dict(on_cpu=True, tensor_parallel=True)])
def test_auto_binds_nothing_off_the_cpu_or_with_tp_ranks(kw):
    assert plan_cores("auto", 1, range(16), **kw) is None


def test_auto_binds_nothing_without_a_core_to_spare():
    assert plan_cores("auto", 1, (0,), on_cpu=True) is None
    assert plan_cores("auto", 2, (0, 1), on_cpu=True) is None  # gn-* on the 2-core box: as before


def test_nobind_and_lists():
    assert plan_cores("nobind", 1, (0, 1), on_cpu=True) is None
    plan = plan_cores("1-2", 1, range(4), on_cpu=False)  # a list binds wherever it is given
    assert plan is not None and plan.engines == ((1, 2),) and plan.serving == (0, 3)
    plan = plan_cores("0|1", 2, range(3), on_cpu=True)
    assert plan is not None and plan.engines == ((0,), (1,)) and plan.serving == (2,)


def test_list_errors():
    with pytest.raises(CpuBindError, match="not among"):
        plan_cores("5", 1, (0, 1), on_cpu=True)
    with pytest.raises(CpuBindError, match="2 core groups for 3"):
        plan_cores("0|1", 3, range(4), on_cpu=True)
    with pytest.raises(CpuBindError, match="bad core range"):
        parse_cores("3-1")


def test_parse_and_mode():
    assert parse_cores("1-3,5,2") == (1, 2, 3, 5)
    assert mode_of("auto") is BindMode.AUTO and mode_of("nobind") is BindMode.NOBIND and mode_of("0-3") is BindMode.LIST


@pytest.mark.parametrize("bad", ["yes", "1-", "|1", "1||2", ""])
def test_config_refuses_malformed_values(bad):
    with pytest.raises(ConfigError, match="--cpu-bind"):
        ServeConfig(cpu_bind=bad).validate()


def test_default_threads_are_the_engines_cores_where_bound():
    assert default_threads(CorePlan(((0, 1, 2),), (3,), "t"), 1) == 3
    assert default_threads(None, 2) == max(1, (os.cpu_count() or 1) // 2)


def test_a_prompt_step_borrows_the_serving_cores_only_under_auto_with_one_engine():
    one = CorePlan(((0, 1, 2),), (3,), "auto")
    assert default_prompt_threads(ServeConfig(transfer="colocated"), one) == 4
    assert default_prompt_threads(ServeConfig(transfer="colocated", prompt_threads=3), one) == 3  # given: kept
    assert default_prompt_threads(ServeConfig(transfer="colocated", cpu_bind="0-2"), one) is None  # a list: as given
    assert default_prompt_threads(ServeConfig(), CorePlan(((0,), (1,)), (2,), "auto")) is None  # engines would share it
    assert default_prompt_threads(ServeConfig(transfer="colocated"), None) is None
    assert omp_places([0, 3]) == {"OMP_PLACES": "{0},{3}", "OMP_PROC_BIND": "close"}


def test_the_launcher_plans_by_where_engines_compute(monkeypatch):
    monkeypatch.setattr(cpu_binding, "allowed_cores", lambda: (0, 1))
    colocated = ServeConfig(transfer="colocated")
    assert plan_cluster_cores(["colocated"], colocated) == CorePlan(((0,),), (1,), plan_cores("auto", 1, (0, 1), True).why)
    on_gpu = ServeConfig(transfer="colocated", prefill_device="cuda:0")
    assert plan_cluster_cores(["colocated"], on_gpu) is None


def test_child_spec_carries_its_cores_through_json():
    spec = ChildSpec("colocated", ServeConfig(transfer="colocated"), "127.0.0.1", 0, "/tmp/r", 1, "colocated-0",
                     compute_cores=[0], serving_cores=[1])
    back = ChildSpec.from_json(spec.to_json())
    assert back.cores() == CorePlan(((0,),), (1,), "auto")
    assert ChildSpec.from_json(ChildSpec("prefill", ServeConfig(), "h", 0, "/r", 1).to_json()).cores() is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_binding_moves_the_engine_loop_and_the_rest_apart():
    cores = sorted(os.sched_getaffinity(0))
    compute, serving = cores[:1], cores[1:2]
    before = os.sched_getaffinity(0)
    started, release = threading.Event(), threading.Event()

    def loop() -> None:
        started.set()
        release.wait(10)

    try:
        cpu_binding.bind_before_build(compute)
        engine = threading.Thread(target=loop, name="hawk-test-engine")
        helper = threading.Thread(target=release.wait, args=(10,), name="hawk-test-helper")
        engine.start(), helper.start()
        started.wait(10)
        assert os.sched_getaffinity(engine.native_id) == set(compute)  # inherited from the build
        cpu_binding.bind_after_build([engine], serving)
        assert os.sched_getaffinity(engine.native_id) == set(compute)
        assert os.sched_getaffinity(helper.native_id) == set(serving)
        assert os.sched_getaffinity(0) == set(serving)  # this (the main) thread serves
        cpu_binding.set_thread_cores([engine.native_id], cores)  # built on every core, to borrow them ...
        cpu_binding.bind_after_build([engine], serving, compute)
        assert os.sched_getaffinity(engine.native_id) == set(compute)  # ... then narrowed to its own
    finally:
        release.set()
        cpu_binding.set_thread_cores(cpu_binding.process_threads(), before)
