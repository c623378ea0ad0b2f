"""The head's reservation found by counting room on the eligible nodes (`_Counted`, for jobs whose ranks are all
alike) is the one the search over instants finds: the same start, flavor and nodes, whatever the cluster, the running
jobs' ends and the queue."""

from __future__ import annotations

import pytest
from hypothesis import given

from libs import placement
from libs.placement import schedule
from tests.support.placement import NOW
from tests.support.strategies import SETTINGS, Scenario, scenarios


@SETTINGS
@given(scenarios())
def test_a_reservation_by_counting_is_the_one_a_search_over_instants_finds(scenario: Scenario) -> None:
    counted = schedule(scenario.queue, scenario.nodes, scenario.flavors, running=scenario.running, now=NOW)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(placement._Counted, "first_fit", lambda *_: None)  # every reservation by the search
        searched = schedule(scenario.queue, scenario.nodes, scenario.flavors, running=scenario.running,
                            now=NOW)
    assert counted == searched
