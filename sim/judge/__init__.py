"""The judge simulator: synthetic trial reports from calibrated noise models (:mod:`sim.judge.noise`) run
through the real judge (:mod:`controller.judge`) to measure false-rollback and miss rates
(:mod:`sim.judge.sim`); ``kernelctl sim judge`` is :mod:`sim.judge.cli`."""
