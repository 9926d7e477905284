"""loadtests/profiles/profile_served.py's reading of py-spy's raw profiles (the profiling itself needs py-spy and minutes)."""

from loadtests.profiles.profile_served import parse_raw, shares

STEP = "thread (11): duet-step-loop;Thread.run (threading.py:982);StepLoop._run (engine_core/step_loop.py:179)"
LOOP = "thread (10): MainThread;BaseEventLoop.run_forever (asyncio/base_events.py:608)"
FWD = STEP + ";EngineCore.step (engine_core/engine_core.py:58);ModelRunner.forward (engine_core/model_runner.py:58)"
RAW = "\n".join([
    f"{FWD};Linear.forward (torch/nn/modules/linear.py:134);mkl_blas_def_sgemm_kernel_0_zen (libtorch_cpu.so) 50",
    f"{FWD};Linear.forward (torch/nn/modules/linear.py:134);mkl_blas_def_sgemm_scopy_down16_bdz (libtorch_cpu.so) 30",
    f"{FWD};DecoderModel.compute_logits (engine_core/model.py:173);mkl_blas_def_sgemm_kernel_0_zen (libtorch_cpu.so) 10",
    (f"{FWD};Linear.forward (torch/nn/modules/linear.py:134);pybind11::gil_scoped_release::~gil_scoped_release "
     "(libtorch_python.so) 5"),
    f"{STEP};EngineCore.step (engine_core/engine_core.py:59);PagedScheduler.process (engine_paged/scheduler.py:90) 5",
    f"{LOOP};epoll_wait (libc.so.6) 90",
    f"{LOOP};EngineServicer.Generate (engine_core/servicer.py:80) 10",
    "not a sample line",
])


def test_shares_split_the_step_thread_and_the_forward_by_cost():
    got = shares(parse_raw(RAW))
    assert got["step_thread_samples"] == 100
    assert got["step_thread_pct"] == {"forward": 90.0, "process": 5.0, "waiting for the GIL": 5.0}
    assert got["forward_samples"] == 90
    assert got["forward_pct"] == {"linear: GEMM compute": 55.6, "linear: MKL re-packing the weight": 33.3,
                                  "lm head": 11.1}
    assert got["event_loop_busy_pct"] == 10.0


def test_an_empty_profile_has_no_shares():
    assert shares(parse_raw("")) == {"step_thread_samples": 0, "step_thread_pct": {}, "forward_samples": 0,
                                     "forward_pct": {}, "event_loop_busy_pct": 0.0}
