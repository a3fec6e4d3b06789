"""Simulators, on top of the runtime packages (nothing in kernelctl, kernelpack, controller or agents imports
them): :mod:`sim.judge` (the judge simulator, ``kernelctl sim judge``) and :mod:`sim.fleet` (the fleet
simulator, ``kernelctl sim fleet``)."""
