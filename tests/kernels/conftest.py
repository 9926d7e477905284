"""Kernel tests run every Triton kernel on CPU tensors in Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated; the kernel package decorates lazily, on first launch,
for the interpreter setting in force then, so setting the variable here (before any kernel test launches
anything) is enough even if another test package imported triton or the kernels first. The autouse fixture
keeps it set for each kernel test even if the surrounding environment says otherwise.

`DUET_KERNEL_TEST_DEVICE=cuda` (what `make gpu-check` sets on a CUDA machine) runs the same tests compiled for
real: the interpreter stays off and tensors are made on the GPU (torch's default device), so every kernel is
checked against its reference there; the CPU kernels' tests (test_cpu_*.py) keep their tensors on the CPU.
"""

from __future__ import annotations

import os

ON_CUDA = os.environ.get("DUET_KERNEL_TEST_DEVICE", "cpu") == "cuda"
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    # test_cpu_*.py check the C kernels of CPU tensors: they stay on the CPU on any machine
    on_cuda = ON_CUDA and not request.module.__name__.split(".")[-1].startswith("test_cpu_")
    if ON_CUDA:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if on_cuda:
        torch.set_default_device("cuda")
    torch.manual_seed(0)
    yield
    if on_cuda:
        torch.set_default_device("cpu")


class PagedKV:
    """A random paged KV cache holding `lens[i]` tokens for sequence i, pages scattered in random order."""

    def __init__(self, lens, page_size, num_kv_heads, head_dim, dtype):
        pages_per_seq = [-(-n // page_size) for n in lens]
        num_pages = sum(pages_per_seq) + 2  # spare pages that no sequence owns
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape).to(dtype)
        self.v_cache = torch.randn(shape).to(dtype)
        width = max(pages_per_seq) + 1  # one unused column: entries past a sequence's pages must be ignored
        # padding entries point at real (other sequences') pages, so a kernel that reads them gets it wrong
        self.block_tables = torch.randint(0, num_pages, (len(lens), width), dtype=torch.int32)
        order = torch.randperm(num_pages).tolist()
        for i, n in enumerate(pages_per_seq):
            self.block_tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        self.lens = torch.tensor(lens, dtype=torch.int32)


@pytest.fixture
def paged_kv():
    return PagedKV


def tolerance(dtype):
    """(atol, rtol) for comparing a kernel with its fp32-computing reference at a given output dtype."""
    return {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}[dtype]


@pytest.fixture
def tol():
    return tolerance
