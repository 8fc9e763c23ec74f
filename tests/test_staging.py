"""HostStaging: persistent per-input host buffers (the CUDA path's pinned
copies), exercised on CPU with the same buffer logic."""
import torch

from qoqserve.engine.staging import HostStaging


def test_values_arrive_intact_and_buffers_are_reused_and_grown():
    st = HostStaging(torch.device("cpu"))
    st.persistent = True  # the CUDA code path (unpinned here: no GPU)
    a = st.put("ids", [3, 1, 2])
    first = st._buffers["ids"]
    assert a.tolist() == [3, 1, 2]
    b = st.put("tables", list(range(6)), (2, 3))
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]]
    st.put("ids", [7] * 10)
    assert st._buffers["ids"] is first  # no allocation for a step that fits
    big = st.put("ids", list(range(1000)))
    assert big.tolist() == list(range(1000)) and st._buffers["ids"].numel() >= 1000


def test_cpu_makes_plain_tensors():
    st = HostStaging(torch.device("cpu"))
    assert st.put("x", [1, 2, 3, 4], (2, 2)).tolist() == [[1, 2], [3, 4]] and not st._buffers
