"""``shmstat.section(name, cuda=True)`` on a real GPU: the range's GPU time reaches ``<name>.gpu`` from CUDA events
resolved without synchronising the stream (run on the GPU machine; skipped with the reason elsewhere)."""

from __future__ import annotations

import pytest

import shmstat


@pytest.mark.gpu
def test_a_cuda_section_times_its_kernels_into_the_gpu_stat_without_synchronising():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seen: list[dict] = []
    shmstat.register_event_handler(lambda e: seen.append(dict(e.data)))
    shmstat.init(section_window_s=3600)  # in-process: the windows are logged when the Stats close
    x = torch.randn(2048, 2048, device="cuda")
    sec = shmstat.section("matmul", cuda=True)
    for _ in range(20):
        with sec:
            y = x @ x
    torch.cuda.synchronize()  # the test's own wait, so every pair has completed
    with sec:  # this exit resolves the completed pairs
        y = x @ x
    torch.cuda.synchronize()
    from shmstat.writer.sections import _records

    gpu = _records[("matmul", False)].gpu
    assert gpu is not None
    gpu._stat.close()
    data = next(d for d in seen if "matmul.gpu.count" in d)
    assert data["matmul.gpu.count"] >= 20 and data["matmul.gpu.p50"] > 0.0
    del y
