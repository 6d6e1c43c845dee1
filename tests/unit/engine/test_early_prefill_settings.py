"""Early prefill's settings in one place (engine/early_prefill.py `EarlyPrefill`): made
from the engine's config as the flags give it, and the deadlock bound it decides."""
from __future__ import annotations

from testkit.engine_factories import make_scheduler

from epd.engine.config import EngineConfig
from epd.engine.early_prefill import MAX_IMAGE_WAIT_S, EarlyPrefill, gave_up_error
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig


def test_the_engine_config_gives_it_on_unless_turned_off():
    assert EarlyPrefill.of(EngineConfig()) == EarlyPrefill(True, 4, 600.0)  # None: on
    assert EarlyPrefill.of(EngineConfig(early_prefill=True)).is_on
    off = EarlyPrefill.of(EngineConfig.from_flat(early_prefill=False, max_num_image_waits=2))
    assert (off.is_on, off.max_num_image_waits, off.max_image_wait_s) == (False, 2, MAX_IMAGE_WAIT_S)


def test_may_wait_is_the_deadlock_bound():
    early = EarlyPrefill(max_num_image_waits=2)
    assert early.may_wait(1, num_blocks=5, num_free_blocks=5)
    assert not early.may_wait(2, num_blocks=5, num_free_blocks=5)  # two wait already
    assert not early.may_wait(0, num_blocks=6, num_free_blocks=5)  # its prompt would not fit


def test_a_scheduler_asks_the_one_it_is_given_or_its_configs():
    assert make_scheduler(max_num_image_waits=3).early_prefill == EarlyPrefill(max_num_image_waits=3)
    given = EarlyPrefill(max_num_image_waits=1)
    assert Scheduler(SchedulerConfig(), 8, early_prefill=given).early_prefill is given


def test_the_answer_of_a_request_given_up_on():
    assert gave_up_error(600.0) == "gave up waiting 600 s for an image"
