"""kernelctl's bottom layer, imported by every other package and importing none of them: the agent/controller
wire contract (``wire``), the domain vocabulary (``vocab``), settings, console output and exit codes
(``console``), the operator HTTP client (``opclient``) and the launcher of ``kernelctl serve`` (``procs``).
The ``kernelctl`` command itself is the top-level ``cli`` package."""

__version__ = "0.1.0"
