"""The node agent (imports kernelctl and kernelpack; never controller, cli or sim): inventory, the controller
client, the bundle cache, the outbox and the trial (``trial`` in the agent, ``trial_worker`` in its child)."""
