"""``python -m packtool``: the command line."""

from packtool.cli import main

main()
