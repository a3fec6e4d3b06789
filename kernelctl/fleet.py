"""Temporary re-export (issue 15): the demo's fleet moved to :mod:`cli.demo_fleet`; delete once
scripts/gpu-fleet imports it from there."""

from cli.demo_fleet import BUNDLES_DIR, FleetError, LocalFleet, NodeSpec

__all__ = ["BUNDLES_DIR", "FleetError", "LocalFleet", "NodeSpec"]
