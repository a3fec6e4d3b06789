"""kernelctl: canary rollouts of GPU kernel bundles. Root CLI, settings and the agent/controller wire contract."""

__version__ = "0.1.0"
