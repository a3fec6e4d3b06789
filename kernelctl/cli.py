"""Temporary re-export (issue 15): the root app moved to :mod:`cli.app`; delete once nothing runs
``python -m kernelctl.cli`` (tests/e2e/test_demo.py)."""

from cli.app import app

__all__ = ["app"]

if __name__ == "__main__":  # pragma: no cover
    app()
