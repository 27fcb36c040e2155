"""Suite-wide settings.

The exact-world tests run many tiny tensor operations; with PyTorch's default of one thread per
core, each of them pays a thread hand-off that costs far more than the work on a 2-core machine
(measured: a small log-softmax 12 ms instead of 0.2 ms under load). One intra-op thread is set for
every test; it changes no result.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
