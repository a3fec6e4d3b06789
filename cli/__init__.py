"""The ``kernelctl`` command line, the top layer: :mod:`cli.app` is the root Typer app (the console script)
and every other module here is one verb or one tight verb group (see the README's layout table).

Nothing below ``cli`` imports it; a verb module imports the packages it drives (kernelpack, controller,
agents) lazily inside its command where they are heavy, so ``kernelctl --help`` stays fast.
"""
