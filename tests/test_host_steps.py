"""scripts/host_steps.py's GPU timeline: busy and idle time, graph replays' kernels against the ones launched outside."""

from types import SimpleNamespace

from torch.autograd import DeviceType

from scripts.host_steps import gpu_timeline


def _cpu(id_, name):
    return SimpleNamespace(device_type=DeviceType.CPU, id=id_, name=name)


def _gpu(name, start, end, launched_by, op=0):
    # as torch.profiler reports them: `id` the CUPTI correlation id of the runtime call that launched it,
    # `linked_correlation_id` the PyTorch op around that call (0: none, as around a graph replay)
    return SimpleNamespace(device_type=DeviceType.CUDA, is_user_annotation=False, device_index=0, name=name, key=name,
                           time_range=SimpleNamespace(start=start, end=end), id=launched_by, linked_correlation_id=op)


def test_gpu_timeline_splits_graph_replays_from_single_launches_and_counts_idle_time():
    events = [_cpu(1, "cudaGraphLaunch"), _cpu(2, "cudaLaunchKernel"), _cpu(3, "cudaGraphLaunch"), _cpu(4, "cudaMemcpyAsync"),
              _cpu(5, "cudaLaunchKernel"),
              # PyTorch ops: ids from their own counter, so they collide with the runtime calls' and are not launchers
              _cpu(3, "aten::fill_"), _cpu(1, "aten::copy_"),
              _gpu("gemm", 0, 100, 1), _gpu("ln", 100, 150, 1),       # step 1's replay
              _gpu("fill", 160, 170, 2, op=3),                          # outside, 10 us
              _gpu("gemm", 200, 300, 3), _gpu("ln", 300, 350, 3),     # step 2's replay
              _gpu("Memcpy HtoD", 210, 260, 4, op=1),                   # inside the replay's time: 0 us exposed
              _gpu("fill", 360, 375, 5, op=3)]                          # outside, 15 us
    text = gpu_timeline(events, wall_us=400.0, steps=2)
    lines = text.splitlines()
    # busy: 150 + 10 + 150 + 15 = 325 us of 400 -> 0.163 ms a step busy, 0.037 idle
    assert "wall 0.200 ms a step, GPU busy 0.163 ms (81.2%), idle 0.037 ms" in lines[0]
    assert "2.0 activities a step, 150.0 us a step" in lines[1]
    assert "replays span 150.0 us a step, 0.0 us of it between their activities (0.0 gaps a step" in lines[2]
    assert "launched outside the graphs: 1.5 a step, 12.5 us a step" in lines[3]
    assert lines[4].split() == ["1.00", "x", "12.50", "us", "fill"]
    assert lines[5].split() == ["0.50", "x", "0.00", "us", "Memcpy", "HtoD"]


def test_replay_gaps_are_the_time_inside_a_replay_no_activity_covers():
    from scripts.host_steps import replay_gaps

    # replay 1: 0-100, 102-150 (gap 2), 149-160 overlaps, 170-180 (gap 10); replay 2: 200-300, 301-310 (gap 1)
    replays = {7: [(102, 150), (0, 100), (149, 160), (170, 180)], 9: [(200, 300), (301, 310)]}
    text = replay_gaps(replays, steps=2)
    # spans 180 + 110 = 290 -> 145 a step; gaps 2 + 10 + 1 = 13 -> 6.5 a step, 1.5 gaps a step, median 2, one over 5
    assert text.split("(")[0].split() == ["replays", "span", "145.0", "us", "a", "step,", "6.5", "us", "of", "it",
                                          "between", "their", "activities"]
    assert "1.5 gaps a step, median 2.00 us, 0.5 over 5 us" in text
