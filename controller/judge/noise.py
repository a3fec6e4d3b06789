"""Temporary re-export (issue 15): the noise models moved to :mod:`sim.judge.noise`; delete once
controller/sim_fleet.py moved to sim/fleet."""

from sim.judge.noise import *  # noqa: F403
from sim.judge.noise import simulate_reports  # noqa: F401
