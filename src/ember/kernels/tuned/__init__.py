"""Kernel tables measured by `ember bench tune` on one GPU model each (``<gpu>.json``, the
tune.json as the command wrote it), read by `ember.kernels.tuning_files` on a GPU of that name."""
