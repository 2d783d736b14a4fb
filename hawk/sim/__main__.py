"""``python -m hawk.sim``: see :mod:`hawk.sim.command`."""

from hawk.sim.command import main

main()
