"""The two engine kinds are laid out alike (engine_core/scheduler_protocol.py): the same modules with the same
roles, one step type, one allocator Protocol, and builders that take the kind's own config."""

from __future__ import annotations

import importlib
import inspect

import pytest

from duet.engine_config import PagedConfig, PrefixConfig
from engine_core.kv_pool import Allocator
from engine_core.scheduler_protocol import SchedulerOutput

KINDS = {"engine_paged": ("PagedScheduler", PagedConfig), "engine_prefix": ("PrefixScheduler", PrefixConfig)}


@pytest.mark.parametrize("package", sorted(KINDS))
def test_each_kind_has_the_same_modules_with_the_same_roles(package):
    scheduler_name, config_class = KINDS[package]
    scheduler = importlib.import_module(f"{package}.scheduler")
    postprocess = importlib.import_module(f"{package}.postprocess")
    sequence = importlib.import_module(f"{package}.sequence")
    block_manager = importlib.import_module(f"{package}.block_manager")
    worker = importlib.import_module(f"{package}.worker")
    assert hasattr(getattr(scheduler, scheduler_name), "_preempt")  # one name for giving a running request's pages up
    assert inspect.isclass(postprocess.OutputProcessor) and inspect.isclass(block_manager.BlockManager)
    assert inspect.isclass(sequence.ScheduledSeq)
    schedule = inspect.signature(getattr(scheduler, scheduler_name).schedule, eval_str=True)
    assert schedule.return_annotation == SchedulerOutput[sequence.ScheduledSeq] | None
    assert next(iter(inspect.signature(worker.build_scheduler, eval_str=True).parameters.values())).annotation \
        is config_class


def test_both_kinds_take_pages_through_the_one_allocator_protocol():
    from engine_paged.block_manager import BlockManager as PagedBlocks
    from engine_prefix.block_manager import BlockManager as PrefixBlocks
    from engine_prefix.radix_cache import RadixCache

    for init in (PagedBlocks.__init__, PrefixBlocks.__init__, RadixCache.__init__):
        assert inspect.signature(init, eval_str=True).parameters["allocator"].annotation is Allocator
