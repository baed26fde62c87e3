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
    assert "launched outside the graphs: 1.5 a step, 12.5 us a step" in lines[2]
    assert lines[3].split() == ["1.00", "x", "12.50", "us", "fill"]
    assert lines[4].split() == ["0.50", "x", "0.00", "us", "Memcpy", "HtoD"]
