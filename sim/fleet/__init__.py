"""The fleet simulator (``kernelctl sim fleet``): thousands of simulated agents against a REAL controller.

One light asyncio process drives N agents that speak the real wire models (:mod:`kernelctl.wire`) over HTTP
against a ``kernelctl serve`` subprocess on a real database. Modules, by job: :mod:`.config` (the run's
settings and plan), :mod:`.scenarios` (what each scenario does and must end with), :mod:`.bundles` (signed
bundles, built once), :mod:`.database` (a throw-away PostgreSQL database), :mod:`.agents` (the simulated
agents), :mod:`.operator` (the operator's side: push, baseline, rollout, faults), :mod:`.run` (orchestration),
:mod:`.report` (measurements, checks, table) and :mod:`.cli` (the Typer ``app``).
"""
