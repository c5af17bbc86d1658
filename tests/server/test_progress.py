"""The load progress bar survives what follows the first load: a reload of the same model, another
model loaded on demand, a new engine after a lost one."""

from __future__ import annotations

from ember.engine.ipc import LoadProgress
from ember.server.progress import LoadProgressBar


def test_a_model_loaded_again_after_the_bar_closed_gets_a_new_bar():
    bar = LoadProgressBar(enabled=True)
    bar.update(LoadProgress("m", 1, 4))
    bar.update(LoadProgress("m", 4, 4))
    bar.close()
    bar.update(LoadProgress("m", 2, 4))  # the same model again: no stale state
    bar.update(LoadProgress("other", 1, 2))
    bar.close()
    bar.close()
