"""A tuning session's evolutionary search keeps a population sized to the trials it may measure."""

import pytest

from tightfit.device_rpc.tuning import MAX_POPULATION, MIN_POPULATION, search_population


@pytest.mark.parametrize("trials, population", [(1, MIN_POPULATION), (4, MIN_POPULATION), (40, 320),
                                                (64, MAX_POPULATION), (5000, MAX_POPULATION)])
def test_the_search_population_grows_with_the_session_up_to_metaschedules_own(trials, population):
    assert search_population(trials) == population
