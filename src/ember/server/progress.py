"""A progress bar on stderr while the engine process loads the weights."""

from __future__ import annotations

from tqdm import tqdm

from ember.engine.ipc import LoadProgress


class LoadProgressBar:
    """One tqdm bar per model, fed by the engine's LoadProgress messages."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar: tqdm | None = None
        self._model: str | None = None

    def update(self, progress: LoadProgress) -> None:
        if not self.enabled:
            return
        if progress.model != self._model or self._bar is None:
            self.close()
            self._model = progress.model
            self._bar = tqdm(
                total=progress.total,
                desc=f"Loading {progress.model}",
                unit=" tensors",
                dynamic_ncols=True,
            )
        assert self._bar is not None
        self._bar.update(progress.done - self._bar.n)

    def close(self) -> None:
        """End the bar; a later load (another model, a reload, a new engine) starts a new one."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._model = None
