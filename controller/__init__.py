"""The controller (imports kernelctl and kernelpack; never agents, cli or sim): the changelog database, the rollout
state machine (``rollouts``), the judge (``gates.decide``, ``judge``), the tick, the HTTP API (``api``), the
scheduler and leadership, metrics and notifications."""
