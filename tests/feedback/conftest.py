"""Feedback tests time real runs: one torch thread keeps them steady on a shared two-core
machine, where two threads turn other jobs' load into 10x swings."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
